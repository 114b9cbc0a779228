"""The ``shardps`` command: server, worker, demo, sim, stats, ctl, health, ray.

Over 400 lines: one parser for seven subcommands (``ray`` has its own module,
shardps/cli_ray.py), each flag with its help and its environment variable
(docs/operations.md lists them; tests/test_docs.py checks the list), and the
dispatch; what each subcommand runs lives in the module it names (server/app.py,
examples/, deploy/demo.py, deploy/netsim.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
from typing import TypeVar

from shardps.cliargs import OPTIMIZERS, addresses, host_rate, positive_int, rate, sync_mode
from shardps.protos import env
from shardps.protos.security import Security

T = TypeVar("T")

def _security_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("security (env SHARDPS_TLS_CERT, SHARDPS_TLS_KEY, SHARDPS_TLS_CA, "
                             "SHARDPS_TLS_SERVER_NAME, SHARDPS_AUTH_TOKEN, SHARDPS_AUTH_TOKEN_FILE, "
                             "SHARDPS_WORKER_TOKEN, SHARDPS_OPERATOR_TOKEN, SHARDPS_PEER_TOKEN and their _FILE)")
    g.add_argument("--tls-cert", default=None, help="PEM certificate (a server's; a client's for mutual TLS)")
    g.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", default=None,
                   help="PEM CA: clients check servers with it; a server given one requires client certificates")
    g.add_argument("--token-file", default=None, help="file holding the shared bearer token (every audience)")
    g.add_argument("--worker-token-file", default=None,
                   help="file holding the workers' token (servers: admitted to the Workers service only; "
                        "workers: sent instead of the shared token)")
    g.add_argument("--operator-token-file", default=None,
                   help="file holding the operators' token (the Operator service: stats, ctl)")
    g.add_argument("--peer-token-file", default=None,
                   help="file holding the servers' token (the Peers service: replication, split tensors)")
    g.add_argument("--server-name", default=None, help="clients: the name the server certificate carries")


def security_from(args: argparse.Namespace) -> Security:
    return Security.from_env(tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                             token_file=args.token_file, server_name=args.server_name,
                             worker_token_file=args.worker_token_file,
                             operator_token_file=args.operator_token_file, peer_token_file=args.peer_token_file)


def _env_int(name: str) -> int | None:
    try:
        return env.get_int(name)
    except ValueError as e:
        raise SystemExit(f"shardps: {e}") from None


def _or(value: T | None, default: T) -> T:
    """``value`` unless it is None (0 is a value: SHARDPS_LEASE_SECONDS=0 turns leases off)."""
    return default if value is None else value


def _env_float(name: str) -> float | None:
    try:
        return env.get_float(name)
    except ValueError as e:
        raise SystemExit(f"shardps: {e}") from None


def _address_flag(p: argparse.ArgumentParser, help: str = "HOST:PORT,... in shard order") -> None:
    """--addresses, from SHARDPS_ADDRESSES when not given."""
    default = env.get(env.ADDRESSES)
    p.add_argument("--addresses", type=addresses, default=addresses(default) if default else None,
                   required=default is None, help=f"{help} (env {env.ADDRESSES})")


def worker_backups(shards: list[str], backups: list[str] | None) -> list[str] | None:
    """``shardps worker``'s backups: ``--backups``, else ``SHARDPS_BACKUPS`` where the shards (``--addresses``)
    are those of ``SHARDPS_ADDRESSES`` (the rule of ``connect``: the variable names the backups of those
    shards, not of shards given on the command line)."""
    from_env = env.get(env.ADDRESSES)
    if backups is not None or not from_env or shards != addresses(from_env):
        return backups
    return env.get_list(env.BACKUPS)


def _training_flags(p: argparse.ArgumentParser) -> None:
    """The job's flags that ``demo`` and ``sim`` share (their workers' command line: deploy/demo.py)."""
    from shardps.cliargs import compress_flags

    p.add_argument("--sync", type=sync_mode, default="bsp", help="bsp, asp, every:X or ssp:S (default bsp)")
    p.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer)")
    p.add_argument("--epochs", type=int, default=None,
                   help="passes over the data (default 10 for digits, 5 for movielens)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch, split over workers (default 64; the gpt example's: 8, movielens': 1000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wire", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of gradients up and weights down (default fp32; the masters stay fp32)")
    p.add_argument("--overlap", action="store_true",
                   help="push gradient buckets during backward, pull weights during the next forward")
    p.add_argument("--push-window", type=positive_int, default=None, metavar="N",
                   help="push to N shards at a time, in the order the next forward needs them (default: all)")
    compress_flags(p)
    p.add_argument("--timeout", type=float, default=600.0, help="give up after this many seconds")
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last stdout line")
    p.add_argument("--quiet", action="store_true", help="no progress output")


HEALTH_HELP = "exit 0 only if the server answers SERVING (a container healthcheck)"


def _health_flags(hp: argparse.ArgumentParser) -> argparse.ArgumentParser:
    port = env.get(env.PORT)
    hp.add_argument("--address", default=f"127.0.0.1:{port}" if port else None,
                    help=f"HOST:PORT of the server (default 127.0.0.1:${env.PORT} when that is set)")
    hp.add_argument("--etcd", metavar="etcd://HOST:PORT",
                    help="check the coordinator instead: exit 0 only if this etcd answers (its container's check)")
    hp.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)")
    _security_flags(hp)
    return hp


def health_main(argv: list[str]) -> int:
    """``shardps health ...``, parsed and run without the rest of the CLI: a healthcheck runs every few
    seconds in every server's container, and what the other commands import at once is not its to pay for."""
    from shardps.worker.datapath.reach import run_health

    hp = _health_flags(argparse.ArgumentParser(prog="shardps health", description=HEALTH_HELP))
    args = hp.parse_args(argv)
    if args.etcd:
        return etcd_health(args.etcd, args.timeout)
    if not args.address:
        hp.error(f"--address is required (or {env.PORT} set, or --etcd)")
    return run_health(args.address, timeout=args.timeout, security=security_from(args))


def etcd_health(url: str, timeout: float) -> int:
    """``shardps health --etcd URL``: 0 only if an endpoint of the etcd at ``url`` answers within ``timeout``."""
    from shardps.server.checks import parse_coordinator
    from shardps.server.coordinator import CoordinatorError, Etcd

    try:
        client = Etcd(parse_coordinator(url), timeout=timeout)
    except ValueError as e:
        print(f"shardps health: {e}", file=sys.stderr)
        return 2
    try:
        client.check(timeout)
    except CoordinatorError as e:
        print(f"{url}: {e}")
        return 1
    finally:
        client.close()
    print(f"{url}: SERVING")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # The choices come from the light modules beside the ones that accept them (examples/moe_flags.py,
    # examples/movielens_flags.py, worker/pipeline/names.py, protos/sizes.py): the parser imports no torch,
    # so `shardps --help` and a refused flag answer at once (tests/test_cli.py). Here, not at the top, so that
    # `shardps health` (health_main) stays lighter still.
    from shardps.cli_ray import add_ray_parser
    from shardps.cliargs import compress_flags
    from shardps.protos.sizes import DEFAULT_CHUNK_BYTES

    p = argparse.ArgumentParser(prog="shardps", description="Sharded gRPC parameter servers for PyTorch.")
    p.add_argument("--log-level", default=env.get(env.LOG_LEVEL) or "WARNING",
                   help="logging level (env SHARDPS_LOG_LEVEL; default WARNING)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("server", help="run one parameter server (one shard, or --shards N)")
    s.add_argument("--host", default=env.get(env.HOST) or "127.0.0.1",
                   help=f"address to bind (default loopback; env {env.HOST})")
    s.add_argument("--port", type=int, default=_or(_env_int(env.PORT), 0),
                   help=f"port to bind (0: a free one, printed on start; env {env.PORT})")
    s.add_argument("--shard-index", type=int, default=_or(_env_int(env.SHARD_INDEX), 0),
                   help=f"this server's shard (default 0; env {env.SHARD_INDEX})")
    s.add_argument("--num-shards", type=int, default=_or(_env_int(env.NUM_SHARDS), 1),
                   help=f"shards of the job (default 1; env {env.NUM_SHARDS})")
    s.add_argument("--shards", type=int, default=1, metavar="N",
                   help="serve N consecutive shards from --shard-index in this process, each on its own "
                        "port (--port, --port+1, ...; 0: free ones): a model cut finer than the server hosts "
                        "(see DistributedOptimizer(push_window=...)); default 1")
    s.add_argument("--sync", type=sync_mode, default=None, help="fix the sync mode (default: the first worker's)")
    s.add_argument("--num-workers", type=int, default=None, help="fix the worker count (with --sync)")
    s.add_argument("--chunk-bytes", type=int, default=DEFAULT_CHUNK_BYTES,
                   help=f"bytes per streamed chunk on Pull (default {DEFAULT_CHUNK_BYTES})")
    s.add_argument("--max-wait", type=float, default=300.0,
                   help="longest a barrier or version wait may block, in seconds (default 300)")
    s.add_argument("--metrics-port", type=int, default=_env_int(env.METRICS_PORT),
                   help="serve Prometheus /metrics on this port (0: a free one; default off; env SHARDPS_METRICS_PORT)")
    s.add_argument("--metrics-host", default=env.get(env.METRICS_HOST) or "127.0.0.1",
                   help="address the metrics endpoint binds (default loopback; env SHARDPS_METRICS_HOST)")
    s.add_argument("--torch-threads", type=int, default=None,
                   help="torch intra-op threads for the optimizer step (default: half the cores)")
    s.add_argument("--checkpoint-dir", default=env.get(env.CHECKPOINT_DIR),
                   help="write checkpoints here and restore the newest complete one on start "
                        "(env SHARDPS_CHECKPOINT_DIR)")
    s.add_argument("--checkpoint-every", type=int, default=_or(_env_int(env.CHECKPOINT_EVERY), 0),
                   help=f"checkpoint every N versions (steps) (env {env.CHECKPOINT_EVERY})")
    s.add_argument("--lease-seconds", type=float, default=_or(_env_float(env.LEASE_SECONDS), 10.0),
                   help="evict a worker silent for this long; barriers then complete without it "
                        f"(default 10; env {env.LEASE_SECONDS})")
    s.add_argument("--frame-inline-bytes", type=int, default=_env_int(env.FRAME_INLINE_BYTES), metavar="N",
                   help="frame a Pull of up to N bytes under the shard's lock; larger ones are framed by a "
                        "thread of their own while the first responses go out (default 2 MiB; env "
                        f"{env.FRAME_INLINE_BYTES})")
    s.add_argument("--checkpoint-seconds", type=float, default=0.0,
                   help="checkpoint at the first step after every T seconds")
    r = s.add_argument_group("replication")
    r.add_argument("--replicas", type=int, choices=(1, 2), default=_or(_env_int(env.REPLICAS), 1),
                   help="2: keep a backup of every shard on the next server, which takes over when it dies; "
                        f"this server then also holds the backup of the previous shard (default 1; env {env.REPLICAS})")
    r.add_argument("--replica-port", type=int, default=_or(_env_int(env.REPLICA_PORT), 0),
                   help="with --replicas 2: port of the backup this server holds (0: a free one, printed on "
                        f"start; env {env.REPLICA_PORT})")
    r.add_argument("--replica-target", default=env.get(env.REPLICA_TARGET), metavar="HOST:PORT",
                   help="with --replicas 2: the next server's --replica-port, where this shard's backup lives "
                        f"(or set it later: shardps ctl attach-replica; env {env.REPLICA_TARGET})")
    r.add_argument("--replica-timeout", type=float, default=None, metavar="SECONDS",
                   help="with --replicas 2: how long a primary waits for its backup to confirm a change (plus 1s "
                        "per 20 MB) before it goes on alone, degraded: a backup cut off by the network holds "
                        "Pushes this long (default 30)")
    r.add_argument("--coordinator", default=env.get(env.COORDINATOR) or None, metavar="etcd://HOST:PORT,...",
                   help="who serves each shard is etcd's to say: a primary acknowledges only while it holds its "
                        "lease there, a backup takes over only by a transaction after that lease expired "
                        "(docs/operations.md, 'Fencing'); default none (env SHARDPS_COORDINATOR)")
    r.add_argument("--job", default=env.get(env.JOB) or "shardps", metavar="NAME",
                   help="with --coordinator: the job's name in etcd (its keys: /shardps/NAME/shards/<i>); jobs "
                        "sharing an etcd need their own (default shardps; env SHARDPS_JOB)")
    r.add_argument("--coordinator-ttl", type=int, default=5, metavar="SECONDS",
                   help="with --coordinator: the primary's lease in etcd, renewed every third of it; a takeover "
                        "waits this long after the primary was last heard (default 5, at least 2)")
    r.add_argument("--start-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="with --coordinator: how long start-up waits for etcd to answer and for this server's "
                        "claim on its shard (a lease left by its previous run expires meanwhile); default 30")
    r.add_argument("--backup-only", type=int, default=None, metavar="SHARD",
                   help="a spare: hold only a backup of shard SHARD on --replica-port, no shard of its own "
                        "(to give a shard a copy again after a takeover: shardps ctl attach-replica)")
    r.add_argument("--advertise-address", default=env.get(env.ADVERTISE_ADDRESS), metavar="HOST:PORT",
                   help="how other servers reach this one (its backup checks it before taking over); "
                        f"default HOST:PORT, or this machine's name:PORT when binding 0.0.0.0 (env "
                        f"{env.ADVERTISE_ADDRESS})")
    _security_flags(s)

    w = sub.add_parser("worker", help="run one worker of an example")
    w.add_argument("--example", choices=["digits"], default="digits")
    _address_flag(w)
    w.add_argument("--backups", type=addresses, default=None,
                   help="each shard's backup (--replicas 2), HOST:PORT,... in shard order; learnt when "
                        f"registering otherwise (env {env.BACKUPS}, where the addresses are {env.ADDRESSES}'s)")
    wid, nw = _env_int(env.WORKER_ID), _env_int(env.NUM_WORKERS)
    w.add_argument("--worker-id", type=int, default=wid, required=wid is None, help=f"(env {env.WORKER_ID})")
    w.add_argument("--num-workers", type=int, default=nw, required=nw is None, help=f"(env {env.NUM_WORKERS})")
    w.add_argument("--sync", type=sync_mode, default="bsp")
    w.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    w.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer)")
    w.add_argument("--epochs", type=int, default=10, help="passes over the data (default 10)")
    w.add_argument("--batch-size", type=int, default=64, help="global batch, split over workers")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--progress", action="store_true", help="show a progress bar on stderr")
    w.add_argument("--wire", choices=("fp32", "bf16"), default="fp32",
                   help="dtype of gradients up and weights down (default fp32; the masters stay fp32)")
    w.add_argument("--overlap", action="store_true",
                   help="push gradient buckets during backward, pull weights during the next forward")
    w.add_argument("--push-window", type=positive_int, default=None, metavar="N",
                   help="push to N shards at a time, in the order the next forward needs them (default: all)")
    compress_flags(w)
    w.add_argument("--metrics-port", type=int, default=None,
                   help=f"serve Prometheus /metrics on this port (0: a free one; default off; env {env.METRICS_PORT})")
    w.add_argument("--metrics-host", default=None,
                   help=f"address the metrics endpoint binds (default loopback; env {env.METRICS_HOST})")
    _security_flags(w)

    st = sub.add_parser("stats", help="a table of the shards of a running job")
    _address_flag(st)
    st.add_argument("--watch", type=float, nargs="?", const=2.0, default=None,
                    help="refresh every N seconds (default 2) until Ctrl-C")
    st.add_argument("--timeout", type=float, default=10.0, help="RPC deadline in seconds")
    _security_flags(st)

    _health_flags(sub.add_parser("health", help=HEALTH_HELP))

    c = sub.add_parser("ctl", help="control a running job")
    _address_flag(c, "HOST:PORT,... in shard order (promote: the backups' replica ports)")
    c.add_argument("--timeout", type=float, default=30.0, help="RPC deadline in seconds")
    _security_flags(c)
    csub = c.add_subparsers(dest="action", required=True)
    ss = csub.add_parser("set-sync", help="switch the sync mode live: bsp, asp, every:X, ssp:S")
    ss.add_argument("sync", type=sync_mode)
    csub.add_parser("checkpoint", help="write a checkpoint on every shard now (servers with --checkpoint-dir)")
    pr = csub.add_parser("promote", help="make the backups at --addresses (servers' replica ports) serve their "
                                         "shards (workers do this themselves when a primary dies)")
    pr.add_argument("--force", action="store_true", help="even while the primary still answers SERVING")
    ar = csub.add_parser("attach-replica", help="give shard --shard a backup at TARGET (a server's replica port), "
                                                "e.g. after a failover; waits until it is in sync")
    ar.add_argument("--shard", type=int, required=True, help="index into --addresses")
    ar.add_argument("target", metavar="TARGET", help="HOST:PORT of the backup endpoint")

    d = sub.add_parser("demo", help="servers + workers as processes on loopback, training digits (or a char-GPT)")
    d.add_argument("--example", choices=("digits", "gpt", "moe", "movielens"), default="digits",
                   help="digits: an MLP, data-parallel workers (default); gpt: the tinyshakespeare char-GPT, one "
                        "worker, its weights streamed from the servers with --stream (docs/streaming.md); moe: a "
                        "char-GPT with mixture-of-experts layers, the servers in this process, the workers as its "
                        "threads (docs/moe.md); movielens: matrix factorisation on MovieLens-100K, its tables on "
                        "the servers, against one process (test RMSEs; docs/sparse.md)")
    d.add_argument("--servers", type=int, default=2)
    d.add_argument("--workers", type=int, default=None, help="workers (default 2; the gpt example has one)")
    _training_flags(d)
    from shardps.deploy.demo_examples import GPT_DEFAULTS
    from shardps.examples.moe_flags import MODEL_DEFAULTS as MOE_DEFAULTS
    from shardps.examples.moe_flags import add_flags as add_moe_flags
    from shardps.examples.movielens_flags import DEFAULTS as ML_DEFAULTS

    md = d.add_argument_group("the char-GPTs' size and length (--example gpt and moe)")
    for name, what in (("steps", "training steps"), ("dim", "model width"), ("layers", "transformer blocks"),
                       ("context", "characters per sample")):
        md.add_argument(f"--{name}", type=int, default=None,
                        help=f"{what} (default {GPT_DEFAULTS[name]} for gpt, {MOE_DEFAULTS[name]} for moe"
                             + (f", {ML_DEFAULTS['dim']} for movielens)" if name == "dim" else ")"))
    gd = d.add_argument_group("--example gpt (docs/streaming.md)")
    gd.add_argument("--stream", action="store_true",
                    help="stream the weights from the servers module by module, at most --max-live-mb held")
    gd.add_argument("--max-live-mb", type=float, default=64.0,
                    help="the worker's budget of live parameter + gradient bytes, MiB (default 64)")
    add_moe_flags(d.add_argument_group("--example moe (docs/moe.md)"), model=False)
    d.add_argument("--plot", metavar="PNG", default=None,
                   help="save the loss curve and staleness histogram (needs matplotlib: shardps[plot])")
    d.add_argument("--replicas", type=int, choices=(1, 2), default=1,
                   help="2: every shard has a backup on the next server (default 1)")
    d.add_argument("--kill-server", type=int, default=None, metavar="I",
                   help="failover drill (with --replicas 2): SIGKILL server I once its shard has done "
                        "--kill-at-step steps")
    d.add_argument("--kill-at-step", type=int, default=20, metavar="N", help="steps (default 20)")
    sm = sub.add_parser("sim", help="the demo on a simulated cluster: hosts in network namespaces, shaped links",
                        description="Builds a NetCluster (one network namespace per host, a bridge, tbf-shaped links "
                                    "in both directions; needs root), starts the servers on the first hosts (h0, h1, "
                                    "...) and the workers on the next ones, one process per host, and trains the "
                                    "example across the links. Hosts left over stay idle. See docs/netsim.md.")
    sm.add_argument("--hosts", type=int, default=6, help="hosts in the cluster, at least --servers + --workers "
                                                          "(default 6)")
    sm.add_argument("--link", type=rate, default="1gbit",
                    help="every host's link rate, both directions: NUMBER and kbit, mbit or gbit (default 1gbit)")
    sm.add_argument("--host-link", type=host_rate, action="append", default=[], metavar="HOST=RATE",
                    help="one host's own rate, e.g. h5=100mbit for a slow straggler (repeatable)")
    sm.add_argument("--example", choices=["digits"], default="digits")
    sm.add_argument("--servers", type=int, default=2, help="servers, on hosts h0 .. h(S-1) (default 2)")
    sm.add_argument("--workers", type=int, default=4, help="workers, on hosts hS .. h(S+W-1) (default 4)")
    sm.add_argument("--coordinator", action="store_true",
                    help="start etcd (Debian's etcd-server: make tools) on the last host, which must be left over, "
                         "and run every server with --coordinator on it (docs/operations.md)")
    _training_flags(sm)
    add_ray_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "torch" not in sys.modules:  # OpenMP reads it as torch loads (a test calling main has torch already)
        os.environ.update(env.openmp_defaults(os.environ))
    if argv[:1] == ["health"]:
        return health_main(argv[1:])
    args = build_parser().parse_args(argv)
    from shardps.deploy.lifeline import watch_parent

    watch_parent()  # started by LocalCluster or the demo: stop when that process is gone
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "server":
        from shardps.server.checks import (  # (light: before the server)
            check_coordinator,
            check_replicas,
            check_shards,
            check_spare,
        )

        if args.replicas not in (1, 2):  # from SHARDPS_REPLICAS: argparse checks choices of flags only
            print(f"shardps server: --replicas / {env.REPLICAS} must be 1 or 2, got {args.replicas}", file=sys.stderr)
            return 2
        extra = {} if args.frame_inline_bytes is None else {"frame_inline_bytes": args.frame_inline_bytes}
        if args.replica_timeout is not None:
            extra["replica_timeout_s"] = args.replica_timeout
        if args.frame_inline_bytes is not None and args.frame_inline_bytes < 0:
            print(f"shardps server: --frame-inline-bytes / {env.FRAME_INLINE_BYTES} must be >= 0, "
                  f"got {args.frame_inline_bytes}", file=sys.stderr)
            return 2
        if args.replica_timeout is not None and not args.replica_timeout > 0:
            print(f"shardps server: --replica-timeout must be > 0, got {args.replica_timeout}", file=sys.stderr)
            return 2
        if args.coordinator:
            try:
                check_coordinator(args.coordinator, args.job, args.coordinator_ttl)
            except ValueError as e:
                print(f"shardps server: {e}", file=sys.stderr)
                return 2
            extra.update(coordinator=args.coordinator, job=args.job, coordinator_ttl=args.coordinator_ttl,
                         start_timeout_s=args.start_timeout)
        if args.backup_only is not None:
            try:
                check_spare(args.backup_only, args.num_shards)
            except ValueError as e:
                print(f"shardps server: {e}", file=sys.stderr)
                return 2
            from shardps.server.app import run_spare

            return run_spare(host=args.host, replica_port=args.replica_port, backup_of=args.backup_only,
                             num_shards=args.num_shards, chunk_bytes=args.chunk_bytes, max_wait_s=args.max_wait,
                             torch_threads=args.torch_threads, security=security_from(args),
                             lease_s=args.lease_seconds, metrics_host=args.metrics_host,
                             metrics_port=args.metrics_port, checkpoint_dir=args.checkpoint_dir,
                             checkpoint_every=args.checkpoint_every, **extra)
        try:
            check_replicas(args.replicas, args.num_shards, args.replica_target)
            check_shards(args.shards, args.shard_index, args.num_shards, args.replicas)
        except ValueError as e:
            print(f"shardps server: {e}", file=sys.stderr)
            return 2
        from shardps.server.app import run_server

        return run_server(shards=args.shards, host=args.host, port=args.port, shard_index=args.shard_index,
                          num_shards=args.num_shards, sync=args.sync, num_workers=args.num_workers,
                          chunk_bytes=args.chunk_bytes, max_wait_s=args.max_wait,
                          metrics_host=args.metrics_host, metrics_port=args.metrics_port,
                          torch_threads=args.torch_threads, security=security_from(args),
                          checkpoint_dir=args.checkpoint_dir, checkpoint_every=args.checkpoint_every,
                          checkpoint_seconds=args.checkpoint_seconds, lease_s=args.lease_seconds,
                          replicas=args.replicas, replica_port=args.replica_port,
                          replica_target=args.replica_target, advertise=args.advertise_address, **extra)
    if args.command == "worker":
        from shardps.examples.digits import main_worker

        args.backups = worker_backups(args.addresses, args.backups)
        return main_worker(args, security_from(args))
    if args.command == "health":  # after top-level flags (`shardps --log-level debug health`)
        from shardps.worker.datapath.reach import run_health

        return run_health(args.address, timeout=args.timeout, security=security_from(args))
    if args.command in ("stats", "ctl"):
        from shardps.admin import (
            run_attach_replica,
            run_checkpoint,
            run_promote,
            run_set_sync,
            run_stats,
        )
        from shardps.worker.errors import ShardError

        try:
            sec = security_from(args)
            if args.command == "stats":
                return run_stats(args.addresses, watch=args.watch, timeout=args.timeout, security=sec)
            if args.action == "checkpoint":
                return run_checkpoint(args.addresses, timeout=args.timeout, security=sec)
            if args.action == "promote":
                return run_promote(args.addresses, force=args.force, timeout=args.timeout, security=sec)
            if args.action == "attach-replica":
                return run_attach_replica(args.addresses, args.shard, args.target, timeout=args.timeout,
                                          security=sec)
            return run_set_sync(args.addresses, args.sync, timeout=args.timeout, security=sec)
        except (ShardError, TimeoutError, ValueError) as e:
            print(f"shardps {args.command}: {e}", file=sys.stderr)
            return 1
    if args.command == "ray":
        from shardps.cli_ray import run_ray

        return run_ray(args)
    if args.command == "demo":
        for name in ("servers", "workers", "epochs"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                print(f"shardps demo: --{name} must be >= 1", file=sys.stderr)
                return 2
        from shardps.deploy.demo_examples import digits_problem, run_example

        if args.example != "digits":
            return run_example(args)
        problem = digits_problem(args)
        if problem is not None:
            print(f"shardps demo: {problem}", file=sys.stderr)
            return 2
        from shardps.deploy.demo import run_demo

        return run_demo(args)
    if args.command == "sim":
        from shardps.deploy.demo import run_sim

        for name in ("servers", "workers", "epochs", "hosts"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                print(f"shardps sim: --{name} must be >= 1", file=sys.stderr)
                return 2
        if args.hosts < args.servers + args.workers + int(args.coordinator):
            print(f"shardps sim: --hosts {args.hosts} is fewer than --servers {args.servers} + --workers "
                  f"{args.workers}{' + 1 (etcd, --coordinator)' if args.coordinator else ''}: each server and "
                  f"worker has a host of its own", file=sys.stderr)
            return 2
        if args.coordinator and shutil.which("etcd") is None:
            print("shardps sim: --coordinator: etcd is not installed (Debian's etcd-server: make tools)",
                  file=sys.stderr)
            return 2
        return run_sim(args)
    return 2
