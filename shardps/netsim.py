"""A simulated cluster of hosts on this machine: network namespaces, a bridge and tbf-shaped links.

    from shardps.netsim import NetCluster
    with NetCluster(hosts=4, link="500mbit", links={"h3": "100mbit"}) as net:
        servers = net.start_servers(["h0"])
        worker = net.start_worker("h1", ["--addresses", servers[0].address, ...])
        net.cut("h1"); net.heal("h1"); net.partition({"h0"}, {"h1", "h2"})

See docs/netsim.md; the implementation is shardps.deploy.netsim (and .netns: records, removal, the sweep).
"""

from shardps.deploy.netns import NetsimError, sweep_stale
from shardps.deploy.netsim import NetCluster, NetsimUnavailable, Server, format_rate, parse_rate, unavailable

__all__ = ["NetCluster", "NetsimError", "NetsimUnavailable", "Server", "format_rate", "parse_rate", "sweep_stale",
           "unavailable"]
