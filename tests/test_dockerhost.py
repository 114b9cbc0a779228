"""deploy/dockerhost.py's pure parts: the apt mirror debootstrap uses, and the undoing of what a dockerd changed
in the host's network (the rules below are what Docker 20.10 wrote on Debian 12, ``iptables -t T -S``)."""

from __future__ import annotations

from shardps.deploy.dockerhost import NetState, apt_mirror, differences, undo_plan

FILTER_BEFORE = ("-P INPUT ACCEPT", "-P FORWARD ACCEPT", "-P OUTPUT ACCEPT")
NAT_BEFORE = ("-P PREROUTING ACCEPT", "-P INPUT ACCEPT", "-P OUTPUT ACCEPT", "-P POSTROUTING ACCEPT")
FILTER_DOCKER = (
    "-P INPUT ACCEPT", "-P FORWARD DROP", "-P OUTPUT ACCEPT",
    "-N DOCKER", "-N DOCKER-ISOLATION-STAGE-1", "-N DOCKER-ISOLATION-STAGE-2", "-N DOCKER-USER",
    "-A FORWARD -j DOCKER-USER", "-A FORWARD -j DOCKER-ISOLATION-STAGE-1",
    "-A FORWARD -o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    "-A FORWARD -o docker0 -j DOCKER", "-A FORWARD -i docker0 ! -o docker0 -j ACCEPT",
    "-A FORWARD -i docker0 -o docker0 -j ACCEPT",
    "-A DOCKER-ISOLATION-STAGE-1 -i docker0 ! -o docker0 -j DOCKER-ISOLATION-STAGE-2",
    "-A DOCKER-ISOLATION-STAGE-1 -j RETURN", "-A DOCKER-ISOLATION-STAGE-2 -o docker0 -j DROP",
    "-A DOCKER-ISOLATION-STAGE-2 -j RETURN", "-A DOCKER-USER -j RETURN",
)
NAT_DOCKER = (
    *NAT_BEFORE, "-N DOCKER",
    "-A PREROUTING -m addrtype --dst-type LOCAL -j DOCKER",
    "-A OUTPUT ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER",
    "-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE", "-A DOCKER -i docker0 -j RETURN",
)
LINKS = frozenset({"lo", "eth0", "ifb0", "ifb1"})
BEFORE = NetState(LINKS, {"filter": FILTER_BEFORE, "nat": NAT_BEFORE}, frozenset(), "0")
AFTER = NetState(LINKS | {"docker0"}, {"filter": FILTER_DOCKER, "nat": NAT_DOCKER},
                 frozenset({"table ip filter", "table ip nat"}), "1")


def test_undo_plan_removes_dockers_jumps_then_chains_then_restores_policy_links_tables_and_forwarding():
    plan = [" ".join(c) for c in undo_plan(BEFORE, AFTER)]
    assert plan == [
        "iptables -t filter -D FORWARD -j DOCKER-USER",
        "iptables -t filter -D FORWARD -j DOCKER-ISOLATION-STAGE-1",
        "iptables -t filter -D FORWARD -o docker0 -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        "iptables -t filter -D FORWARD -o docker0 -j DOCKER",
        "iptables -t filter -D FORWARD -i docker0 ! -o docker0 -j ACCEPT",
        "iptables -t filter -D FORWARD -i docker0 -o docker0 -j ACCEPT",
        *(f"iptables -t filter -F {c}" for c in ("DOCKER", "DOCKER-ISOLATION-STAGE-1", "DOCKER-ISOLATION-STAGE-2",
                                                  "DOCKER-USER")),
        *(f"iptables -t filter -X {c}" for c in ("DOCKER", "DOCKER-ISOLATION-STAGE-1", "DOCKER-ISOLATION-STAGE-2",
                                                  "DOCKER-USER")),
        "iptables -t filter -P FORWARD ACCEPT",
        "iptables -t nat -D PREROUTING -m addrtype --dst-type LOCAL -j DOCKER",
        "iptables -t nat -D OUTPUT ! -d 127.0.0.0/8 -m addrtype --dst-type LOCAL -j DOCKER",
        "iptables -t nat -D POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE",
        "iptables -t nat -F DOCKER", "iptables -t nat -X DOCKER",
        "nft delete table ip filter", "nft delete table ip nat",
        "ip link delete docker0",
        "sysctl -q -w net.ipv4.ip_forward=0",
    ]
    assert differences(BEFORE, BEFORE) == []
    # a link; filter: a policy (went, appeared), 4 chains, 11 rules; nat: a chain, 4 rules; 2 nft tables; ip_forward
    assert len(differences(BEFORE, AFTER)) == 1 + 2 + 4 + 11 + 1 + 4 + 2 + 1


def test_undo_plan_leaves_what_docker_did_not_make():
    """Rules, chains, links and tables that were there before, or that are not Docker's, stay; so does a
    table that holds anything besides Docker's rules."""
    theirs = "-A INPUT -s 10.9.0.0/16 -j DROP"
    before = NetState(LINKS | {"br-lab"}, {"filter": (*FILTER_BEFORE, "-N LAB", theirs), "nat": NAT_BEFORE},
                      frozenset({"table ip filter"}), "1")
    after = NetState(LINKS | {"br-lab", "veth1a2b3c4", "sps01-x"},
                     {"filter": (*FILTER_DOCKER, "-N LAB", theirs, "-A FORWARD -i eth0 -j LAB"),
                      "nat": (*NAT_DOCKER, "-A POSTROUTING -o eth0 -j MASQUERADE")},
                     frozenset({"table ip filter", "table ip nat"}), "1")
    plan = [" ".join(c) for c in undo_plan(before, after)]
    assert not any("LAB" in c or "-o eth0" in c or "INPUT" in c for c in plan)
    assert "nft delete table ip filter" not in plan and "nft delete table ip nat" not in plan  # not only Docker's
    assert [c for c in plan if c.startswith("ip ")] == ["ip link delete veth1a2b3c4"]
    assert not any(c.startswith("sysctl") for c in plan)


def test_apt_mirror_reads_deb822_and_one_line_sources():
    deb822 = """Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main
"""
    assert apt_mirror({"/etc/apt/sources.list.d/debian.sources": deb822}, "bookworm") == "http://deb.debian.org/debian"
    assert apt_mirror({"/etc/apt/sources.list.d/debian.sources": deb822}, "trixie") is None
    disabled = "Enabled: no\n" + deb822
    assert apt_mirror({"a.sources": disabled}, "bookworm-security") == "http://deb.debian.org/debian-security"
    lines = ("# deb http://old.example/debian bookworm main\ndeb-src http://src.example/debian bookworm main\n"
             "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main contrib\n")
    assert apt_mirror({"/etc/apt/sources.list": lines}, "bookworm") == "http://mirror.example/debian"
    assert apt_mirror({"x.list.disabled": lines}, "bookworm") is None
