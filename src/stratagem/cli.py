"""The ``stratagem`` command line: ``run | ps | demo | bench``.

``stratagem run`` is a thin layer over torchrun (``python -m torch.distributed.run``): it
picks a free port for single-node jobs, optionally starts parameter-server shards first,
exports the strategy choice for ``sg.from_env()``, forwards SIGINT/SIGTERM and propagates
torchrun's exit code. Single-node jobs listen on loopback only: torchrun runs as
``python -m stratagem._torchrun``, whose agent store binds 127.0.0.1 instead of every
interface, and the workers' gloo/NCCL sockets are pinned to the loopback interface; a
non-loopback ``--master-addr`` on one node is refused. Multi-node jobs with the static
rendezvous (``--nnodes K --node-rank i --master-addr A``) listen on the private
network only: the store on ``A`` alone (node 0), the workers' gloo/NCCL sockets on the interface
that holds this node's address (derived from the route to ``A``, or ``--iface``).
Subcommands are registered with :func:`subcommand`; modules behind ``ps``, ``demo`` and
``bench`` are imported only when that subcommand runs.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from .ps.flags import add_shard_arguments, nonneg_int
from .validation import int_argument

__all__ = ["main", "subcommand", "build_parser", "torchrun_command", "parse_strategy_args",
           "network_env"]

#: Seconds torchrun gets to stop its workers after a forwarded signal (its own grace is 30 s).
FORWARD_GRACE = 40.0
_PR_SET_CHILD_SUBREAPER = 36


@dataclass(frozen=True)
class _Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None] | None
    handler: Callable[..., int]
    passthrough: bool  # the handler takes the raw argv (the subcommand parses its own flags)
    epilog: str | None = None  # shown after the options by --help, line breaks kept


_COMMANDS: dict[str, _Command] = {}


def subcommand(name: str, help: str, *, configure: Callable[[argparse.ArgumentParser], None]
               | None = None, passthrough: bool = False, epilog: str | None = None
               ) -> Callable[[Callable[..., int]], Callable[..., int]]:
    """Register ``handler(args: argparse.Namespace) -> int`` as ``stratagem NAME``.

    ``configure(parser)`` adds the subcommand's arguments. With ``passthrough=True`` the
    handler is called as ``handler(argv: list[str])`` with everything after NAME, unparsed.
    ``epilog`` is printed after the options by ``stratagem NAME --help``.
    """
    def register(handler: Callable[..., int]) -> Callable[..., int]:
        _COMMANDS[name] = _Command(name, help, configure, handler, passthrough, epilog)
        return handler
    return register


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stratagem", description="Distribution strategies for PyTorch.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for cmd in _COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help, epilog=cmd.epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if cmd.passthrough:
            p.add_argument("argv", nargs=argparse.REMAINDER, help="arguments for the command")
        elif cmd.configure is not None:
            cmd.configure(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``stratagem`` command; returns the process exit code."""
    if argv is None:  # the program itself, not a caller in its own process
        import atexit

        from stratagem.launcher import skip_final_collection

        # Registered first, so it runs after every other exit handler: the command's own
        # process exits without walking torch's objects (a launcher imports torchft).
        atexit.register(skip_final_collection)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in _COMMANDS and _COMMANDS[argv[0]].passthrough:
        # argparse's REMAINDER mishandles leading flags (``demo --help``): hand over raw argv.
        return _COMMANDS[argv[0]].handler(argv[1:])
    args = build_parser().parse_args(argv)
    return _COMMANDS[args.command].handler(args)


# --------------------------------------------------------------------------- run


_nproc = int_argument(minimum=1, fix="pass the number of worker processes per node, e.g. "
                                     "--nproc 2")



def _nnodes(text: str) -> str:
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or (
            len(parts) == 2 and int(parts[0]) > int(parts[1])):
        raise argparse.ArgumentTypeError(
            f"expected N or MIN:MAX with 1 <= MIN <= MAX, got {text!r}; e.g. --nnodes 2 or 1:4")
    return text


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_strategy_args(items: Sequence[str]) -> dict[str, Any]:
    """``["period=4", "mode=sync"]`` -> ``{"period": 4, "mode": "sync"}`` (values parsed as
    int, float, bool (true/false), None (none/null), else str)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"--strategy-arg must look like key=value with a Python "
                             f"identifier as key, got {item!r}; e.g. --strategy-arg period=4")
        out[key] = _parse_value(value)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _single_node(args: argparse.Namespace) -> bool:
    return args.nnodes in (None, "1", "1:1") and args.rdzv_backend is None


def _static_multi_node(args: argparse.Namespace) -> bool:
    """Several nodes meeting at node 0's store (``--master-addr``), torchrun's static
    rendezvous: the store is ours to bind."""
    return not _single_node(args) and args.rdzv_backend is None


def _loopback_job(args: argparse.Namespace) -> bool:
    """A single-node job whose rendezvous address is loopback: nothing needs to listen beyond
    it."""
    from stratagem._rendezvous import is_loopback

    return _single_node(args) and is_loopback(args.master_addr or "127.0.0.1")


def torchrun_command(args: argparse.Namespace, *, master_port: int | None = None) -> list[str]:
    """The torchrun argv for parsed ``stratagem run`` arguments."""
    # Single node: torchrun with its agent store bound to loopback (stratagem._torchrun);
    # torchrun's own store would listen on every interface, unauthenticated.
    # Several nodes (static rendezvous): the same runner binds the store to --master-addr only.
    ours = _loopback_job(args) or _static_multi_node(args)
    runner = "stratagem._torchrun" if ours else "torch.distributed.run"
    cmd = [sys.executable, "-m", runner, "--nproc-per-node", str(args.nproc)]
    if _single_node(args):
        # Like --standalone, but with the static rendezvous: a free local port and the store
        # hosted by the agent, so no rendezvous id or endpoint needs inventing.
        port = args.master_port or master_port or _free_port()
        cmd += ["--nnodes", "1", "--node-rank", "0",
                "--master-addr", args.master_addr or "127.0.0.1", "--master-port", str(port)]
    else:
        cmd += ["--nnodes", args.nnodes or "1"]
        for flag, value in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr),
                            ("--master-port", args.master_port),
                            ("--rdzv-backend", args.rdzv_backend),
                            ("--rdzv-endpoint", args.rdzv_endpoint), ("--rdzv-id", args.rdzv_id)):
            if value is not None:
                cmd += [flag, str(value)]
    if args.max_restarts is not None:
        cmd += ["--max-restarts", str(args.max_restarts)]
    if args.module:
        cmd.append("--module")
    return [*cmd, args.script, *args.script_args]


def _configure_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=_nproc, default=None,
                   help="worker processes on this node (required unless the cluster sets it: "
                        "PET_NPROC_PER_NODE, SKYPILOT_NUM_GPUS_PER_NODE)")
    p.add_argument("--num-ps", type=nonneg_int, default=0,
                   help="parameter-server shard processes to start first (single node)")
    p.add_argument("--nnodes", type=_nnodes, default=None,
                   help="N or MIN:MAX nodes (default 1: everything listens on 127.0.0.1 only). "
                        "With more than one node the rendezvous store listens on "
                        "--master-addr, unauthenticated: see the note below")
    p.add_argument("--node-rank", type=nonneg_int, default=None,
                   help="this node's rank, 0 to N-1 (required with --nnodes N > 1; node 0 "
                        "hosts the rendezvous store and must hold --master-addr)")
    p.add_argument("--master-addr", default=None,
                   help="address of node 0's rendezvous store (default 127.0.0.1 on one node, "
                        "where any other address is refused; required with several nodes)")
    p.add_argument("--master-port", type=nonneg_int, default=None)
    p.add_argument("--iface", default=None,
                   help="network interface for the workers' gloo/NCCL sockets on several nodes "
                        "(default: the interface this machine uses to reach --master-addr)")
    p.add_argument("--max-restarts", type=nonneg_int, default=None)
    p.add_argument("--fault-tolerant", action="store_true",
                   help="keep training through lost workers (Mirrored, LocalSGD, DiLoCo, sync EASGD; "
                        "Hierarchical with --replica-group-size): "
                        "start the quorum service, restart a dead worker alone (up to "
                        "--max-restarts per worker, default 10) and heal it from a live peer; "
                        "on several nodes also --ft-token-file; needs stratagem[ft]")
    p.add_argument("--ft-token-file", default=None, metavar="PATH",
                   help="with --fault-tolerant on several nodes (required there): the job's "
                        "secret for the heal transport, the same file on every node (mode "
                        "0600, not a symbolic link, at least 16 bytes, e.g. `umask 077; "
                        "openssl rand -hex 32 > PATH`); one node makes its own")
    p.add_argument("--replica-group-size", type=_nproc, default=1,
                   help="with --fault-tolerant: processes per replica group (a node of "
                        "--strategy hierarchical: sync inside, fault tolerant across); a "
                        "process that dies takes its group down and the group is restarted "
                        "whole. Must divide --nproc (default 1)")
    p.add_argument("--min-replicas", type=_nproc, default=1,
                   help="with --fault-tolerant: the fewest live workers training continues "
                        "with (a smaller quorum waits at most the strategy's timeout, then "
                        "fails naming the missing workers)")
    p.add_argument("--rdzv-backend", default=None, help="torchrun rendezvous backend (c10d...)")
    p.add_argument("--rdzv-endpoint", default=None)
    p.add_argument("--rdzv-id", default=None)
    p.add_argument("--strategy", default=None,
                   help="strategy for sg.from_env() in the script: mirrored, easgd, easgd-async, "
                        "eamsgd, local_sgd, diloco, diloco-async, ps-async, ps-sync, one_device, "
                        "hierarchical, sharded")
    p.add_argument("--strategy-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="strategy keyword argument (repeatable)")
    p.add_argument("-m", "--module", action="store_true",
                   help="treat SCRIPT as a module name (python -m)")
    p.add_argument("script", help="training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _set_subreaper() -> None:
    """Adopt orphaned descendants (Linux), so workers outliving a killed torchrun are found."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError):
                # Fields after the ")" that ends the command name: state, ppid, ...
                if (d / "stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    out.add(int(d.name))
    return out


def _reap_orphans(keep: set[int], grace: float = 5.0) -> None:
    """Stop and reap this process's children not in ``keep`` (adopted workers included)."""
    pids = _children() - keep
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
            pids &= _children()
            time.sleep(0.05)
        if not pids:
            return


_RUN_EPILOG = """\
network exposure: a single-node job (no --nnodes or --nnodes 1, no --rdzv-backend,
loopback --master-addr) listens on 127.0.0.1 only: the rendezvous store, the workers'
gloo/NCCL sockets (unless you set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) and the
--num-ps shards; a non-loopback --master-addr on one node is refused. A multi-node job
(--nnodes N --node-rank R --master-addr A) must be reachable by the other nodes: node 0's
rendezvous store (a c10d TCPStore at A:--master-port) listens on A only, never 0.0.0.0,
and the workers' gloo/NCCL sockets on the interface this machine uses to reach A (or
--iface); none of them authenticates anyone. Whoever reaches them can read and write
rendezvous keys and disturb the collectives. With --rdzv-backend c10d the store is
torch's own and listens on every interface, and the agents unpickle the state read from
it (code execution). Run multi-node jobs only on a private network (cluster fabric, VPN,
VLAN) and firewall the store port and the hosts' ephemeral ports from anything outside
the job. Parameter-server shards for several machines: `stratagem ps` with a token (and
TLS). See docs/reliability.md, "Network exposure"."""


def network_env(args: argparse.Namespace, env: dict[str, str]) -> str | None:
    """Check the addresses of a job and pin its collectives to the right interface (in
    ``env``); returns an error message (exit 2) or None, for one node and for several."""
    from stratagem._rendezvous import (
        interface_env,
        interface_of_address,
        interface_towards,
        is_loopback,
        is_wildcard,
        loopback_env,
    )

    if _single_node(args):
        if args.iface is not None:
            return (f"--iface {args.iface} is for jobs on several nodes; a single-node job "
                    "keeps its collectives on loopback. Fix: drop --iface, or pass --nnodes N "
                    "--node-rank R --master-addr A")
        if not _loopback_job(args):
            return (f"--master-addr {args.master_addr} is not a loopback address, but this is "
                    "a single-node job (no --nnodes, or --nnodes 1): the rendezvous store would "
                    "be reachable from the network for nothing. Fix: omit --master-addr (the "
                    "job then listens on 127.0.0.1 only), or pass --nnodes N --node-rank R for "
                    "a multi-node job")
        env.update(loopback_env(env))  # Gloo/NCCL listen on loopback, not the LAN
        return None
    if args.rdzv_backend is not None:
        print(f"stratagem run: warning: --rdzv-backend {args.rdzv_backend} uses torch's own "
              "rendezvous store, which listens on EVERY interface, unauthenticated (and the "
              "c10d backend unpickles what it reads there); prefer the static rendezvous "
              "(--nnodes N --node-rank R --master-addr A), whose store listens on A only",
              file=sys.stderr)
        return None
    nnodes = int(args.nnodes.split(":")[-1])
    if args.master_addr is None or is_wildcard(args.master_addr):
        return (f"--nnodes {args.nnodes} needs --master-addr set to node 0's address on the "
                f"network the nodes share (got {args.master_addr!r}); the store listens on "
                "that address only, never on every interface. Fix: e.g. --master-addr 10.0.0.1")
    if args.node_rank is None or args.node_rank >= nnodes:
        return (f"--nnodes {args.nnodes} needs --node-rank between 0 and {nnodes - 1} (got "
                f"{args.node_rank}); node 0 hosts the rendezvous store at --master-addr")
    if args.node_rank == 0:
        try:
            local = is_loopback(args.master_addr) or interface_of_address(
                socket.gethostbyname(args.master_addr)) is not None
        except OSError:
            local = False
        if not local:
            return (f"--node-rank 0 hosts the rendezvous store on --master-addr "
                    f"{args.master_addr}, but no interface of this machine holds that address. "
                    "Fix: start node 0 on the machine that holds it, or pass that machine's "
                    "address as --master-addr on every node")
    if args.iface is not None:
        names = {name for _, name in socket.if_nameindex()}
        if args.iface not in names:
            return (f"--iface {args.iface}: no such interface on this machine (have: "
                    f"{', '.join(sorted(names))}); pass the interface of the network the "
                    "nodes share")
        iface, source = args.iface, None
        env.update({"GLOO_SOCKET_IFNAME": iface, "NCCL_SOCKET_IFNAME": iface})
    else:
        try:
            source, found = interface_towards(args.master_addr)
        except OSError as e:
            return (f"cannot find a route from this machine to --master-addr "
                    f"{args.master_addr} ({e}). Fix: check the address, or pass --iface NAME")
        if found is None:
            return (f"cannot tell which interface holds {source}, this machine's address "
                    f"towards --master-addr {args.master_addr}. Fix: pass --iface NAME")
        iface = found
        env.update(interface_env(iface, env))
    if is_loopback(args.master_addr):
        return None  # several "nodes" on this very machine: nothing leaves it
    print(f"stratagem run: node {args.node_rank} of {nnodes}: the rendezvous store "
          f"{'listens' if args.node_rank == 0 else 'is'} on {args.master_addr}:"
          f"{args.master_port or 29500} only and the workers' gloo/NCCL sockets on "
          f"{env.get('GLOO_SOCKET_IFNAME', iface)}{f' ({source})' if source else ''}; nothing "
          "authenticates peers, keep this network private (see stratagem run --help)",
          file=sys.stderr)
    return None


def cluster_env(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str | None:
    """Fill the rendezvous arguments not given as flags from the environment a cluster's
    launcher set (Slurm under ``srun``, a Kubeflow ``TrainJob``, SkyPilot:
    :func:`stratagem.clusters.resolve_node`); returns an error message (exit 2) or None.
    Flags always win; the address and port are taken from the environment only for a job
    of several nodes."""
    from stratagem.clusters import ClusterEnvError, resolve_node

    if args.rdzv_backend is not None:
        return None if args.nproc is not None else (
            "--nproc is required with --rdzv-backend")
    try:
        place = resolve_node(env, nnodes=args.nnodes, node_rank=args.node_rank,
                             master_addr=args.master_addr, master_port=args.master_port,
                             nproc_per_node=args.nproc)
    except ClusterEnvError as exc:
        return str(exc)
    if place.nproc_per_node is None:
        return ("--nproc is required: the worker processes to start on this node (no "
                "PET_NPROC_PER_NODE or SKYPILOT_NUM_GPUS_PER_NODE in the environment)")
    found = place.from_environment()
    args.nproc = place.nproc_per_node
    several = place.nnodes is not None and str(place.nnodes) not in ("1", "1:1")
    applied = ["nproc_per_node"] + (["nnodes", "node_rank", "master_addr", "master_port"]
                                     if several else [])
    used = {k: found[k] for k in applied if k in found}
    for name in used.keys() - {"nproc_per_node"}:
        setattr(args, name, str(place.nnodes) if name == "nnodes" else getattr(place, name))
    if used:
        parts = [f"{k.replace('_per_node', '')}={getattr(place, k)} ({v}"
                 f"{': ' + place.how[k] if k in place.how and k.startswith('master') else ''})"
                 for k, v in used.items()]
        print(f"stratagem run: from the environment: {', '.join(parts)}", file=sys.stderr)
    return None


@subcommand("run", "run a training script on N workers (on top of torchrun)",
            configure=_configure_run, epilog=_RUN_EPILOG)
def _run(args: argparse.Namespace) -> int:
    problem = cluster_env(args)
    if problem is not None:
        print(f"stratagem run: error: {problem}", file=sys.stderr)
        return 2
    try:
        strategy_args = parse_strategy_args(args.strategy_arg)
    except ValueError as e:
        print(f"stratagem run: error: {e}", file=sys.stderr)
        return 2
    if strategy_args and not args.strategy:
        print("stratagem run: error: --strategy-arg needs --strategy NAME "
              f"(got {args.strategy_arg}); e.g. --strategy local_sgd --strategy-arg period=4",
              file=sys.stderr)
        return 2
    if args.strategy:
        from stratagem.registry import cli_name_problem

        # Names first, read from the strategy's source: a misspelt argument fails before
        # torch's import (most of this command's start-up).
        problem = cli_name_problem(args.strategy, strategy_args)
        if problem is not None:
            print(f"stratagem run: error: {problem}", file=sys.stderr)
            return 2
        from stratagem._argcheck import cli_problem

        # Built once here, as every worker will build it: fail now, not in each of them.
        nnodes = int((args.nnodes or "1").split(":")[-1])
        problem = cli_problem(args.strategy, strategy_args, world_size=args.nproc * nnodes,
                              local_world_size=args.nproc, num_ps=args.num_ps)
        if problem is not None:
            print(f"stratagem run: error: {problem}", file=sys.stderr)
            return 2
    if args.num_ps and not _single_node(args):
        print(f"stratagem run: error: --num-ps {args.num_ps} starts shards on this machine only "
              "and works for single-node jobs; for several nodes start shards with "
              "`stratagem ps --host H --port P` and export STRATAGEM_PS_ADDRS=host:port,...",
              file=sys.stderr)
        return 2
    from stratagem.launcher import child_pythonpath, start_ps_shards

    env = dict(os.environ)
    env["PYTHONPATH"] = child_pythonpath(env)
    env.setdefault("OMP_NUM_THREADS", "1")  # also silences torchrun's oversubscription banner
    problem = network_env(args, env)
    if problem is not None:
        print(f"stratagem run: error: {problem}", file=sys.stderr)
        return 2
    if args.strategy:
        env["STRATAGEM_STRATEGY"] = args.strategy
        env["STRATAGEM_STRATEGY_ARGS"] = json.dumps(strategy_args)
    if args.fault_tolerant:
        return _run_fault_tolerant(args, env)
    if args.replica_group_size != 1:
        print("stratagem run: error: --replica-group-size is for --fault-tolerant jobs. Fix: "
              "add --fault-tolerant, or drop --replica-group-size", file=sys.stderr)
        return 2
    _set_subreaper()
    before = _children()
    shards = start_ps_shards(args.num_ps) if args.num_ps else None
    try:
        if shards is not None:
            env.update(shards.env())
        return _supervise(torchrun_command(args), env)
    finally:
        if shards is not None:
            shards.stop()
        _reap_orphans(keep=before)


def _run_fault_tolerant(args: argparse.Namespace, env: dict[str, str]) -> int:
    """``stratagem run --fault-tolerant``: the workers run under :func:`stratagem.launch`'s
    supervisor (not torchrun, which restarts every worker when one fails), each a replica of
    its own; a dead one is restarted alone and heals from a live peer. On several
    nodes each node's launcher is :func:`stratagem.launcher.launch_node` (node 0 hosts the
    store on --master-addr:--master-port and the quorum service on the next port)."""
    from stratagem.errors import WorkerError
    from stratagem.launcher import launch, launch_node, run_script

    if args.num_ps or args.rdzv_backend is not None or (
            args.nnodes is not None and ":" in args.nnodes):
        print("stratagem run: error: --fault-tolerant runs on one node, or on a fixed number "
              "of nodes meeting at node 0 (--nnodes N --node-rank R --master-addr A), without "
              "--num-ps, --rdzv-backend or --nnodes MIN:MAX. Fix: drop those flags, or launch "
              "without --fault-tolerant", file=sys.stderr)
        return 2
    size = args.replica_group_size
    if args.nproc % size:
        print(f"stratagem run: error: --replica-group-size {size} does not divide --nproc "
              f"{args.nproc} (a replica group never spans nodes). Fix: pass a divisor of "
              "--nproc", file=sys.stderr)
        return 2
    nnodes = int(args.nnodes or "1")  # N (MIN:MAX was refused above)
    groups = args.nproc * nnodes // size
    if args.min_replicas > groups:
        what = (f"--nproc {args.nproc}" if size == 1 and nnodes == 1
                else f"the job's {groups} replica groups")
        print(f"stratagem run: error: --min-replicas {args.min_replicas} is more than {what}. "
              "Fix: lower --min-replicas", file=sys.stderr)
        return 2
    if nnodes > 1:
        node = _ft_node(args, size)
        if isinstance(node, str):
            print(f"stratagem run: error: {node}", file=sys.stderr)
            return 2
    elif args.ft_token_file is not None:
        print("stratagem run: error: --ft-token-file is for fault-tolerant jobs on several "
              "nodes; on one node the launcher makes a fresh secret of its own. Fix: drop "
              "--ft-token-file, or pass --nnodes N --node-rank R --master-addr A",
              file=sys.stderr)
        return 2
    extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
    extra.setdefault("RUST_LOG", "warn")
    script = (args.script, list(args.script_args), args.module)
    try:
        if nnodes > 1:
            print(f"stratagem run: node {node.node_rank} of {nnodes}, fault tolerant: the job "
                  f"store {'listens' if node.node_rank == 0 else 'is'} on "
                  f"{node.master_addr}:{node.master_port} and the quorum service on "
                  f"{node.master_addr}:{node.quorum_port} (node 0), this node's workers' "
                  f"servers on {node.host} only; heals need the token, the store and the "
                  "quorum service authenticate nobody: keep this network private",
                  file=sys.stderr)
            launch_node(run_script, nproc=args.nproc, node=node, args=script, env=extra,
                        min_replicas=args.min_replicas, max_restarts=args.max_restarts)
        else:
            launch(run_script, nprocs=args.nproc, args=script, env=extra, fault_tolerant=True,
                   min_replicas=args.min_replicas, nnodes=groups,
                   max_restarts=args.max_restarts)
    except WorkerError as e:
        print(f"stratagem run: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _ft_node(args: argparse.Namespace, group: int) -> Any:
    """This node's :class:`~stratagem.launcher.FTNode` for ``stratagem run --fault-tolerant
    --nnodes N ...``, or the one-line reason it cannot run (the addresses were checked by
    :func:`network_env`)."""
    from stratagem._rendezvous import interface_of_address, interface_towards
    from stratagem.ft.launch import read_token_file
    from stratagem.launcher import FTNode

    path = args.ft_token_file
    if path is None:
        return (f"--fault-tolerant on {args.nnodes} nodes needs the job's secret in a file "
                "every node can read, for the heal transport that crosses the network. Fix: "
                "create one (umask 077; openssl rand -hex 32 > ft.token), copy it to every "
                "node and pass --ft-token-file ft.token")
    try:
        read_token_file(path)
    except (OSError, ValueError) as e:
        what = e if isinstance(e, ValueError) else f"cannot read {path} ({e.strerror})"
        return (f"--ft-token-file: {what}" + ("" if isinstance(e, ValueError) else
                ". Fix: pass a regular file of mode 0600 (not a symbolic link)"))
    port = args.master_port or 29500
    if port >= 65535:
        return (f"--master-port {port}: the quorum service listens on the next port, "
                f"{port + 1}, which does not exist. Fix: pass a lower --master-port")
    try:
        master = socket.gethostbyname(args.master_addr)
        host = master if args.node_rank == 0 else interface_towards(master)[0]
    except OSError as e:
        return f"cannot resolve --master-addr {args.master_addr} ({e}). Fix: pass its IP address"
    if args.iface is not None and interface_of_address(host) not in (args.iface, None):
        return (f"--iface {args.iface}: this node reaches --master-addr {args.master_addr} "
                f"from {host}, on interface {interface_of_address(host)}; the fault-tolerant "
                "workers' servers listen there. Fix: drop --iface, or route the job's network "
                f"through {args.iface}")
    return FTNode(node_rank=args.node_rank, nnodes=int(args.nnodes), master_addr=master,
                  master_port=port, host=host, token_file=os.path.abspath(path), group=group)


def _supervise(cmd: list[str], env: dict[str, str]) -> int:
    """Run torchrun, forwarding SIGINT/SIGTERM/SIGHUP; SIGKILL it if it ignores them."""
    # Own session: a terminal Ctrl-C reaches only us, and we forward it exactly once.
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    kill_at: list[float] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        if kill_at:  # a second signal: stop waiting politely
            kill_at[0] = 0.0
        else:
            kill_at.append(time.monotonic() + FORWARD_GRACE)
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)

    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous: dict[int, Any] = {}
    with contextlib.suppress(ValueError):  # not the main thread: no forwarding possible
        for s in sigs:
            previous[s] = signal.signal(s, forward)
    try:
        while True:
            try:
                code = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if kill_at and time.monotonic() >= kill_at[0]:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:  # we are unwinding on an exception: take torchrun down too
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return 128 - code if code < 0 else code


# --------------------------------------------------------------------------- ps, demo, bench


def _configure_ps(p: argparse.ArgumentParser) -> None:
    add_shard_arguments(p)


def _import_or_explain(command: str, module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        print(f"stratagem {command}: cannot import {module} ({e}); is stratagem fully "
              "installed (pip install -e '.[examples]')?", file=sys.stderr)
        return None


@subcommand("ps", "start one parameter-server shard (for multi-machine jobs)",
            configure=_configure_ps)
def _ps(args: argparse.Namespace) -> int:
    server = _import_or_explain("ps", "stratagem.ps.server")
    if server is None:
        return 2
    # One start-up line (address, auth, TLS, limits) and rate-limited refusal lines go to
    # the log; start-up errors (empty token, bad TLS material, port in use) are one line.
    return int(server.serve_from_args(args, "stratagem ps"))


def _delegate(command: str, module: str) -> Callable[[list[str]], int]:
    def handler(argv: list[str]) -> int:
        mod = _import_or_explain(command, module)
        if mod is None:
            return 2
        return int(mod.main(argv) or 0)
    return handler


subcommand("demo", "run the main demo job (see the README)", passthrough=True)(
    _delegate("demo", "stratagem.demo"))
subcommand("bench", "run the benchmarks", passthrough=True)(_delegate("bench", "stratagem.bench"))


if __name__ == "__main__":
    sys.exit(main())
