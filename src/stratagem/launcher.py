"""Launch a function on N worker processes on this machine: ``sg.launch`` and its supervisor.

The parent process hosts the c10d ``TCPStore`` (like torchrun's agent store) so the store
outlives any worker; workers find it through the usual environment variables and connect as
clients. The store listens on 127.0.0.1 only (torch's own ``TCPStore`` would listen
on every interface, unauthenticated; see :mod:`stratagem._rendezvous`), and the workers'
collective backends are pinned to the loopback interface, so a job started here cannot be
reached from other machines. Results come back as bytes written with the standard :mod:`pickle` (real copies of
tensors, never shared memory that dies with the worker). The first failure stops every other
worker (SIGTERM, then SIGKILL after a grace period), so no process outlives the call.

Environment given to every worker (the contract ``Comm.from_env`` relies on), the names and
values torchrun's agent sets (``torch.distributed.elastic.agent.server.local_elastic_agent``)::

    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
    ROLE_NAME=default, ROLE_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT,
    TORCHELASTIC_USE_AGENT_STORE=True, TORCHELASTIC_RESTART_COUNT=0, TORCHELASTIC_MAX_RESTARTS,
    NODE_RANK (= GROUP_RANK) and STRATAGEM_NNODES (= GROUP_WORLD_SIZE), for clarity,
    OMP_NUM_THREADS=1 (unless set), GLOO_SOCKET_IFNAME=lo and NCCL_SOCKET_IFNAME=lo (unless
    set, and only with a loopback MASTER_ADDR), and with parameter-server shards
    STRATAGEM_PS_ADDRS=host:port,... and STRATAGEM_NUM_PS=K.

Simulated nodes: ``launch(fn, nprocs=N, nnodes=K)`` numbers the workers as torchrun
does on K machines of N/K processes each: worker ``r`` is local rank ``r % (N/K)`` of node
``r // (N/K)`` (torchrun assigns global ranks node by node, in node-rank order). Only the
environment differs from one node; every process still runs here and talks over loopback, which
is what lets tests exercise node groups (``Comm`` sub-groups, ``sg.Hierarchical``) on one machine.
Real separate network stacks are ``stratagem.testing.netns``'s job.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, cast

from stratagem._rendezvous import bound_tcp_store, is_loopback, loopback_env, loopback_tcp_store
from stratagem.errors import ParameterServerUnavailable, WorkerError
from stratagem.validation import check_choice, check_int

__all__ = ["launch", "start_ps_shards", "PSShards", "ps_server_command", "worker_env",
           "check_nnodes", "launch_node", "FTNode"]

#: Seconds between SIGTERM and SIGKILL when stopping processes.
TERMINATE_GRACE = 5.0
#: Seconds a worker that already returned its result gets to exit before it is killed.
EXIT_GRACE = 30.0
#: Fault-tolerant jobs: seconds after a spare took a dead worker's place before the next warm
#: spare process is started (see :func:`_spare_main`); no spare when the variable
#: ``STRATAGEM_FT_SPARES=0`` is set; ``STRATAGEM_FT_SPARE_DELAY`` overrides it.
SPARE_DELAY = 2.0
#: ... and after the job's start, where the workers' own start-up needs the CPUs.
SPARE_START_DELAY = 10.0
_MASTER_ADDR = "127.0.0.1"
_PR_SET_PDEATHSIG = 1
# os.environ is process-global; spawn copies it at start(), so concurrent launches must not
# interleave their temporary edits.
_ENV_LOCK = threading.Lock()


# --------------------------------------------------------------------------- helpers


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exitcode(code: int) -> str:
    """Human wording for a process exit code (negative = killed by that signal)."""
    if code < 0:
        return f"was killed by {_signal_name(-code)} ({-code})"
    return f"exited with code {code}"


def _package_root() -> str:
    """The directory holding the ``stratagem`` package, for children's PYTHONPATH."""
    return str(Path(__file__).resolve().parent.parent)


def child_pythonpath(env: Mapping[str, str]) -> str:
    """PYTHONPATH that makes this very ``stratagem`` importable in a child process."""
    parts = [_package_root()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join(dict.fromkeys(parts))


def check_nnodes(nprocs: int, nnodes: int) -> int:
    """Validate ``nnodes`` against ``nprocs`` and return the processes per node."""
    check_int("nnodes", nnodes, minimum=1,
              fix="pass e.g. nnodes=2 to simulate two nodes (1, the default, is a single node)")
    if nprocs % nnodes:
        raise ValueError(
            f"nprocs must be divisible by nnodes (every node runs the same number of "
            f"processes, as under torchrun), got nprocs={nprocs} and nnodes={nnodes}; pass "
            f"nprocs={nnodes * max(1, nprocs // nnodes)} or a nnodes that divides {nprocs}")
    return nprocs // nnodes


def worker_env(*, rank: int, world_size: int, master_port: int,
               master_addr: str = _MASTER_ADDR, ps_addrs: Sequence[str] = (),
               base: Mapping[str, str] | None = None, nnodes: int = 1,
               max_restarts: int = 0) -> dict[str, str]:
    """The environment variables one worker gets (see the module docstring).

    With ``nnodes=K`` the ``world_size`` workers form K nodes of ``world_size // K`` processes
    (``ValueError`` unless K divides ``world_size``), numbered node by node like torchrun's.
    """
    # No range check on rank: the benchmarks give their evaluator process rank world_size
    # (a store client outside the process group).
    local_world_size = check_nnodes(world_size, nnodes)
    node_rank, local_rank = divmod(rank, local_world_size)
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank), "GROUP_WORLD_SIZE": str(nnodes),
        # One homogeneous role, as torchrun has: role ranks are the global ranks.
        "ROLE_RANK": str(rank), "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(world_size),
        "NODE_RANK": str(node_rank), "STRATAGEM_NNODES": str(nnodes),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # Older torch reads the attempt number whenever the agent store is used.
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }
    base = os.environ if base is None else base
    if "OMP_NUM_THREADS" not in base:
        # N busy processes on a few cores: one intra-op thread each avoids oversubscription.
        env["OMP_NUM_THREADS"] = "1"
    if is_loopback(master_addr):
        # Gloo (and NCCL's bootstrap) would otherwise listen on the address the host
        # name resolves to, usually a LAN address, though every peer is on this machine.
        env.update(loopback_env(base))
    if ps_addrs:
        env["STRATAGEM_PS_ADDRS"] = ",".join(ps_addrs)
        env["STRATAGEM_NUM_PS"] = str(len(ps_addrs))
    return env


def _kill_tree(pid: int, sig: int) -> None:
    """Signal a worker's process group (it made itself leader), or the process alone."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _die_with_parent(parent_pid: int) -> None:
    """Ask Linux to SIGKILL us when our parent dies, so a killed launcher (``parent_pid``)
    leaves no orphans; a no-op where prctl is unavailable. Our parent is the launcher, or
    for a warm spare the launcher's fork server (:func:`_spare_context`), which exits with
    it."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == parent_pid:
        return
    try:  # a fork server's child, or the launcher died before prctl took effect
        os.kill(parent_pid, 0)
    except ProcessLookupError:
        os._exit(1)
    except PermissionError:
        pass


# --------------------------------------------------------------------------- PS shards


def ps_server_command(port_file: str, host: str = _MASTER_ADDR,
                      token_file: str | None = None) -> list[str]:
    """The command that starts one parameter-server shard writing its port to ``port_file``
    (and, with ``token_file``, requiring the token in that file: never on the command line)."""
    cmd = [sys.executable, "-m", "stratagem.ps.server", "--host", host, "--port", "0",
           "--port-file", port_file, "--parent-pid", str(os.getpid())]
    if token_file is not None:
        cmd += ["--token-file", token_file]
    return cmd


class PSShards:
    """Running parameter-server shard processes started by :func:`start_ps_shards`.

    ``token`` is the job's random shard token (None when started with ``auth=False``);
    :meth:`env` hands it to workers as ``STRATAGEM_PS_TOKEN_FILE`` (a 0600 file in the
    launcher's private temporary directory, removed by :meth:`stop`).

    ``stop()`` sends SIGTERM, waits up to ``grace`` seconds, then SIGKILLs whatever is left;
    it is idempotent and also runs on context-manager exit, whatever the outcome of the job.
    """

    def __init__(self, procs: list[subprocess.Popen[bytes]], addresses: list[str],
                 tmpdir: str, token: str | None = None, token_file: str | None = None) -> None:
        self.procs = procs
        self.addresses = addresses
        self._tmpdir = tmpdir
        self.token = token
        self.token_file = token_file

    def env(self) -> dict[str, str]:
        """``STRATAGEM_PS_ADDRS``, ``STRATAGEM_NUM_PS`` and ``STRATAGEM_PS_TOKEN_FILE`` for the
        workers (their ``PSClient`` reads the token from that file)."""
        if not self.addresses:
            return {}
        env = {"STRATAGEM_PS_ADDRS": ",".join(self.addresses),
               "STRATAGEM_NUM_PS": str(len(self.addresses))}
        if self.token_file is not None:
            env["STRATAGEM_PS_TOKEN_FILE"] = self.token_file
        return env

    def stop(self, grace: float = TERMINATE_GRACE) -> None:
        _stop_popens(self.procs, grace)
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> PSShards:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _stop_popens(procs: Sequence[subprocess.Popen[bytes]], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            _kill_tree(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill_tree(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=grace)


def start_ps_shards(num_ps: int, *, host: str = _MASTER_ADDR,
                    command: Callable[[str], list[str]] | None = None,
                    startup_timeout: float = 60.0,
                    env: Mapping[str, str] | None = None, auth: bool = True) -> PSShards:
    """Start ``num_ps`` parameter-server shard processes and wait until each is listening.

    ``command(port_file)`` builds each shard's argv (default :func:`ps_server_command`); the
    shard must write its bound port to ``port_file`` once it listens, and exit on SIGTERM.
    With ``auth`` (the default) and the default command the job gets a fresh random token,
    written to a 0600 file in a private temporary directory and passed as ``--token-file``;
    workers get it through :meth:`PSShards.env` (``STRATAGEM_PS_TOKEN_FILE``), so no other
    local user can call the shards (``shutdown`` included).
    Raises :class:`ParameterServerUnavailable` (after stopping the others) if a shard exits
    before writing its port or does not write it within ``startup_timeout`` seconds.
    """
    if num_ps < 0:
        raise ValueError(f"num_ps must be >= 0, got {num_ps}; pass 0 for no shards")
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = child_pythonpath(child_env)
    tmpdir = tempfile.mkdtemp(prefix="stratagem-ps-")  # mode 0700: ours alone
    token = token_file = None
    if auth and num_ps and command is None:  # a custom command has no way to receive it
        token = secrets.token_urlsafe(32)
        token_file = os.path.join(tmpdir, "token")
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as tf:
            tf.write(token)
    make = command or (lambda f: ps_server_command(f, host, token_file))
    procs: list[subprocess.Popen[bytes]] = []
    shards = PSShards(procs, [], tmpdir, token, token_file)
    try:
        files = [os.path.join(tmpdir, f"shard{i}.port") for i in range(num_ps)]
        for f in files:
            # Own session: a terminal Ctrl-C reaches the supervisor, which stops shards last.
            procs.append(subprocess.Popen(make(f), env=child_env, start_new_session=True))
        deadline = time.monotonic() + startup_timeout
        for i, (p, f) in enumerate(zip(procs, files, strict=True)):
            port = _await_port_file(p, f, deadline)
            if port is None:
                raise ParameterServerUnavailable(
                    f"parameter-server shard {i} did not write its port to {f} within "
                    f"{startup_timeout:g} s (command: {_cmd_text(p)}); check its output "
                    "above, or raise startup_timeout if the machine is very slow")
            shards.addresses.append(f"{host}:{port}")
    except BaseException:
        shards.stop()
        raise
    return shards


def _cmd_text(proc: subprocess.Popen[bytes]) -> str:
    return shlex.join(cast(list[str], proc.args))


def _await_port_file(proc: subprocess.Popen[bytes], path: str, deadline: float) -> int | None:
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip()
            if text:
                return int(text)  # a half-written file fails int() and is polled again
        code = proc.poll()
        if code is not None:
            raise ParameterServerUnavailable(
                f"parameter-server shard {describe_exitcode(code)} before listening "
                f"(command: {_cmd_text(proc)}); its error output is above")
        time.sleep(0.02)
    return None


# --------------------------------------------------------------------------- workers


def skip_final_collection() -> None:
    """Let this process exit without the interpreter's final garbage collections: every object
    goes to the collector's permanent generation (:func:`gc.freeze`). Called once a worker's
    work is done and reported. With torch and torchft imported, those collections walk every
    object: ~1 s of a core per process here (0.28 s frozen; a script importing torch,
    torchft and stratagem, then exiting), and a job starts many processes. At exit reference
    counting still frees what it frees (module globals, open files, ``atexit`` handlers
    run); only objects in reference cycles are left unfinalized, which Python does not
    promise to finalize at exit anyway (the ``__del__`` documentation), and which a
    fork-started worker (it skips finalization altogether) never finalizes either."""
    import gc

    gc.freeze()


def _worker_main(fn: Callable[..., Any], args: tuple[Any, ...], conn: Connection,
                 parent_pid: int) -> None:
    """Entry point of a spawned worker: run ``fn`` and send one pickled report back."""
    _die_with_parent(parent_pid)
    # Own process group so the supervisor can stop the worker's own children too.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    code = 0
    try:
        result = fn(*args)
        try:
            payload = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            raise TypeError(f"the return value of {fn.__qualname__} cannot be pickled "
                            f"({e}); return tensors, numbers or plain containers") from e
    except BaseException as e:  # noqa: BLE001 - every failure must reach the parent
        code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
        code = code or 1  # returning via sys.exit(0) is still not a return value
        payload = pickle.dumps(("err", f"{type(e).__name__}: {e}", traceback.format_exc()))
    try:
        conn.send_bytes(payload)
    finally:
        conn.close()
    _teardown_distributed()
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    skip_final_collection()


#: What a warm spare imports before it waits (the fork server imports it once): torch,
#: torch's compiler front end (a torch optimizer's constructor imports it, ~1 s), stratagem's
#: strategies and torchft.
SPARE_PRELOAD = ("torch", "torch._dynamo", "stratagem.strategy", "stratagem.ft.comm")


def _spare_main(assignments: Connection, result: Connection, parent_pid: int) -> None:
    """Entry point of a warm spare (fault-tolerant jobs): import now what every worker
    imports (:data:`SPARE_PRELOAD`), then wait for the supervisor to hand it a dead
    worker's place: ``(fn, args, env)`` through ``assignments`` (a pipe from the launching
    process: trusted), after which it is that worker. The job's end closes the pipe: exit."""
    _die_with_parent(parent_pid)
    import importlib

    for name in SPARE_PRELOAD:  # already imported when forked from the fork server
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    try:
        fn, args, env = assignments.recv()
    except (EOFError, OSError):
        os._exit(0)
    finally:
        assignments.close()
    os.environ.update(env)
    _worker_main(fn, args, result, parent_pid)


#: Jobs of this process using the spares' fork server, and whether this process's launches
#: started it (only then do they stop it; a caller's own fork server is left alone).
_SPARE_SERVER_LOCK = threading.Lock()
_spare_server_users = 0
_spare_server_ours = False


def _spare_context() -> Any:
    """How warm spares start: forked from a fork server that imported :data:`SPARE_PRELOAD`
    once (on its first spare), instead of each spare being a fresh interpreter that imports
    torch, torchft and torch's compiler front end again: ~3.5 s of a core here, taken from
    the training processes each time a spare starts after a replacement. 'spawn' where
    there is no fork server. The server inherits the first spare's environment (every
    spare's is the same) and runs until the last job of this process that uses it calls
    :func:`_release_spare_context` (its children die with it)."""
    global _spare_server_users, _spare_server_ours
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    with _SPARE_SERVER_LOCK:
        if _spare_server_users == 0:
            server = getattr(forkserver, "_forkserver", None)
            _spare_server_ours = getattr(server, "_forkserver_pid", 0) is None
        _spare_server_users += 1
        if _spare_server_ours:
            ctx.set_forkserver_preload(list(SPARE_PRELOAD))
    return ctx


def _release_spare_context(ctx: Any) -> None:
    """The end of a job that took :func:`_spare_context` (after every worker it forked has
    stopped): the last such job of this process stops the fork server if this process's
    launches started it, so a caller's process does not keep an idle interpreter holding
    torch, and the next job's server starts with that job's environment."""
    global _spare_server_users
    if ctx.get_start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    with _SPARE_SERVER_LOCK:
        _spare_server_users -= 1
        if _spare_server_users == 0 and _spare_server_ours:
            with contextlib.suppress(Exception):
                forkserver._forkserver._stop()  # type: ignore[attr-defined]


def _spare_delay() -> float:
    """:data:`SPARE_DELAY`, or ``STRATAGEM_FT_SPARE_DELAY`` seconds (benchmarks)."""
    text = os.environ.get("STRATAGEM_FT_SPARE_DELAY", "")
    try:
        value = float(text) if text else SPARE_DELAY
    except ValueError:
        raise ValueError(f"STRATAGEM_FT_SPARE_DELAY must be seconds >= 0, got {text!r}. Fix: "
                         f"unset it (default {SPARE_DELAY:g})") from None
    if not value >= 0:
        raise ValueError(f"STRATAGEM_FT_SPARE_DELAY must be seconds >= 0, got {text!r}. Fix: "
                         f"unset it (default {SPARE_DELAY:g})")
    return value


class _Spare:
    """One warm spare process and its two pipe ends (see :func:`_spare_main`)."""

    def __init__(self, ctx: Any, env: Mapping[str, str]) -> None:
        assign_r, self.assign = ctx.Pipe(duplex=False)
        self.result, result_w = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_spare_main, args=(assign_r, result_w, os.getpid()),
                                name="stratagem-spare", daemon=False)
        with _patched_environ(env):
            self.proc.start()
        assign_r.close()
        result_w.close()

    def take(self, fn: Callable[..., Any], args: tuple[Any, ...], env: Mapping[str, str]
             ) -> tuple[BaseProcess, Connection] | None:
        """Hand the spare a worker's place; None when it is gone (the caller starts one)."""
        if self.proc.exitcode is not None:
            self.stop()
            return None
        try:
            self.assign.send((fn, args, dict(env)))
        except (OSError, ValueError):
            self.stop()
            return None
        self.assign.close()
        return self.proc, self.result

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.assign.close()
        with contextlib.suppress(OSError):
            self.result.close()
        if self.proc.exitcode is None and self.proc.pid is not None:
            _kill_tree(self.proc.pid, signal.SIGKILL)
        self.proc.join(timeout=TERMINATE_GRACE)


def _teardown_distributed() -> None:
    """Release the process groups before the interpreter exits (see
    :func:`stratagem.comm.release_all` for why a gloo group left to interpreter finalization
    aborts the worker after its work is done)."""
    comm_mod = sys.modules.get("stratagem.comm")
    if comm_mod is not None:
        comm_mod.release_all()
        return
    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is None:
        return
    with contextlib.suppress(Exception):
        if dist_mod.is_available() and dist_mod.is_initialized():
            dist_mod.destroy_process_group()


def _check_picklable_target(fn: Callable[..., Any]) -> None:
    if not callable(fn):
        raise TypeError(f"launch() needs a callable fn, got {type(fn).__name__}")
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise ValueError(
            f"launch() starts workers with 'spawn', which cannot import {fn.__qualname__!r} "
            "defined interactively (notebook/REPL); move it to a .py module and import it")


@contextlib.contextmanager
def _patched_environ(values: Mapping[str, str]) -> Iterator[None]:
    """Temporarily set variables in os.environ, which spawn copies into the child."""
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in values}
        os.environ.update(values)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _node_done(store: Any, node: FTNode) -> None:
    """The end of a job across nodes. Another node's launcher says it is done, however it
    ended; node 0, whose quorum service and store the others' last steps may still need,
    waits (after its own success) until all of them have (at most :data:`NODE_WAIT` s)."""
    with contextlib.suppress(Exception):
        if node.node_rank > 0:
            store.add(_FT_NODES_DONE, 1)
            return
        end = time.monotonic() + NODE_WAIT
        while (done := int(store.add(_FT_NODES_DONE, 0))) < node.nnodes - 1:
            if time.monotonic() > end:
                print(f"stratagem: node 0: only {done} of the {node.nnodes - 1} other nodes "
                      f"finished within {NODE_WAIT:g} s of this one; stopping the quorum "
                      "service anyway", file=sys.stderr, flush=True)
                return
            time.sleep(0.1)


class _Supervisor:
    """Watches the workers' result pipes and exit sentinels until all are done or one fails.
    Workers are numbered from 0 here; ``offset`` (the first one's rank in a job across nodes)
    is added where they are named."""

    def __init__(self, offset: int = 0) -> None:
        self.offset = offset
        self.procs: list[BaseProcess] = []
        self.readers: dict[Connection, int] = {}
        self.results: dict[int, Any] = {}
        self.errors: dict[int, tuple[str, str]] = {}  # rank -> (summary, traceback)
        self.exited: set[int] = set()

    def add(self, proc: BaseProcess, reader: Connection) -> None:
        self.readers[reader] = len(self.procs)
        self.procs.append(proc)

    def restart(self, rank: int, proc: BaseProcess, reader: Connection) -> None:
        """Replace the failed worker ``rank`` by a new process (restart="failed")."""
        old = self.procs[rank]
        if old.exitcode is None and old.pid is not None:
            _kill_tree(old.pid, signal.SIGKILL)
            old.join(timeout=TERMINATE_GRACE)
        for conn in [c for c, r in self.readers.items() if r == rank]:
            conn.close()
            del self.readers[conn]
        self.procs[rank] = proc
        self.readers[reader] = rank
        self.errors.pop(rank, None)
        self.exited.discard(rank)

    def _read(self, conn: Connection) -> None:
        rank = self.readers.pop(conn)
        try:
            kind, *rest = pickle.loads(conn.recv_bytes())
        except EOFError:
            return  # died without a report: the sentinel gives the exit code
        except Exception as e:  # noqa: BLE001 - e.g. a result class the parent can't import
            self.errors[rank] = (f"its result could not be unpickled here: {e}",
                                 traceback.format_exc())
            return
        finally:
            conn.close()
        if kind == "ok":
            self.results[rank] = rest[0]
        else:
            self.errors[rank] = (rest[0], rest[1])

    def poll(self, timeout: float) -> WorkerError | None:
        """Wait up to ``timeout`` s for events; return the first failure, if any."""
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs) if r not in self.exited}
        ready = wait([*self.readers, *sentinels], timeout=timeout)
        failed: list[tuple[bool, int]] = []
        for obj in ready:
            if isinstance(obj, Connection) and obj in self.readers:
                rank = self.readers[obj]
                self._read(obj)
                if rank in self.errors:
                    failed.append((False, rank))
        for obj in ready:
            if isinstance(obj, int) and obj in sentinels:
                rank = sentinels[obj]
                self.exited.add(rank)
                self.procs[rank].join(timeout=1.0)
                # Drain a report written just before exit (e.g. the traceback of a raise).
                conn = next((c for c, r in self.readers.items() if r == rank), None)
                if conn is not None and conn.poll(0):
                    self._read(conn)
                if self._exitcode(rank) != 0 or rank not in self.results:
                    failed.append((rank not in self.errors, rank))
        if not failed:
            return None
        # A rank that crashed without a report is the likeliest root cause: its peers'
        # collectives fail *because* it vanished. Otherwise the lowest rank wins.
        _, rank = max(failed, key=lambda f: (f[0], -f[1]))
        return self._error(rank)

    def describe(self, rank: int) -> str:
        """One line on why worker ``rank`` stopped (its exception, or its exit)."""
        if rank in self.errors:
            summary, tb = self.errors[rank]
            last = tb.strip().splitlines()[-1] if tb.strip() else summary
            return f"worker {self.offset + rank} raised {last}"
        code = self.procs[rank].exitcode
        how = describe_exitcode(code) if code is not None else "vanished"
        return f"worker {self.offset + rank} {how}"

    def _exitcode(self, rank: int) -> int:
        code = self.procs[rank].exitcode
        return 0 if code is None else code

    def _error(self, rank: int) -> WorkerError:
        code = self.procs[rank].exitcode
        if rank in self.errors:
            summary, tb = self.errors[rank]
            return WorkerError(f"worker rank {self.offset + rank} raised {summary}\n\n{tb}",
                               rank=self.offset + rank,
                               exitcode=code, traceback_text=tb)
        how = describe_exitcode(code) if code is not None else "closed its result pipe"
        hint = ""
        if code == 1:
            hint = (" (if it failed while importing, fn must live in an importable module: "
                    "see the worker's output above)")
        return WorkerError(f"worker rank {self.offset + rank} {how} before returning a "
                           f"result{hint}", rank=self.offset + rank, exitcode=code)

    @property
    def done(self) -> bool:
        return len(self.exited) == len(self.procs)

    def stop_all(self, grace: float = TERMINATE_GRACE) -> None:
        """SIGTERM every live worker, SIGKILL after ``grace`` s, and reap them."""
        live = [(p, p.pid) for p in self.procs if p.exitcode is None and p.pid is not None]
        for _, pid in live:
            _kill_tree(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p, _ in live:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p, pid in live:
            if p.exitcode is None:
                _kill_tree(pid, signal.SIGKILL)
                p.join(timeout=grace)
            # The worker's own children (its process group) may outlive it: sweep them.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        for conn in self.readers:
            conn.close()
        self.readers.clear()


def run_script(script: str, argv: Sequence[str], module: bool = False) -> None:
    """Run a training script (or module) as ``__main__`` in this process, with ``argv``: the
    worker body of ``stratagem run --fault-tolerant`` (workers started by :func:`launch`)."""
    import runpy

    sys.argv = [script, *argv]
    if module:
        runpy.run_module(script, run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def launch(fn: Callable[..., Any], nprocs: int, num_ps: int = 0, args: tuple[Any, ...] = (),
           *, nnodes: int = 1, timeout: float | None = None,
           env: Mapping[str, str] | None = None, max_restarts: int | None = None,
           restart: str = "all", fault_tolerant: bool = False,
           min_replicas: int = 1) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` worker processes; return their results in rank order.

    Workers are started with the ``spawn`` method, so ``fn`` must be importable (defined at
    module level of a .py file) and the calling script needs an ``if __name__ == "__main__"``
    guard. With ``num_ps=K``, K parameter-server shards are started first and stopped after.
    ``env`` adds variables to every worker's environment. ``nnodes=K`` simulates K nodes of
    ``nprocs // K`` processes (``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``... as torchrun
    sets them on each node; ``ValueError`` naming both numbers unless K divides ``nprocs``).

    A strategy named in the workers' environment (``STRATAGEM_STRATEGY`` and
    ``STRATAGEM_STRATEGY_ARGS``, from ``env`` or this process) is built here first, without
    joining anything: an unknown argument or a bad value raises its ``TypeError`` /
    ``ValueError`` here, before any worker starts.

    On failure: the first worker to raise, exit non-zero or die by a signal is reported as
    :class:`~stratagem.WorkerError` naming its rank (with its traceback when it raised), after
    every other worker has been stopped (SIGTERM, SIGKILL after a few seconds). If the job
    runs longer than ``timeout`` seconds everything is stopped and ``WorkerError`` is raised.
    A ``KeyboardInterrupt`` in the caller also stops every worker before propagating.

    Restarts (off by default): with ``max_restarts=N`` a failure is retried instead
    of raised. ``restart="all"`` (like torchrun) stops every worker and starts the whole group
    again, at most N times in total; ``restart="failed"`` starts again only the worker that
    failed, at most N times per rank, while the others keep running — for asynchronous
    strategies whose workers share no process group (``comm=sg.Comm.single()``, the state on
    parameter-server shards). Each attempt sees its number in ``TORCHELASTIC_RESTART_COUNT``
    (per rank with ``"failed"``). When the budget is spent the failure is raised as above.

    Fault tolerance: ``fault_tolerant=True`` starts the quorum service (torchft's
    Lighthouse, on loopback) and a job secret, makes each worker a replica of its own (a
    strategy built in it with the default ``fault_tolerant=None`` turns fault tolerance on:
    ``Mirrored``, ``LocalSGD``, ``DiLoCo``), and restarts a dead worker alone
    (``restart="failed"``, ``max_restarts`` 10 per worker unless given): the survivors keep
    training without it and heal it from a live peer when it is back. ``min_replicas`` is the
    fewest replicas a quorum may have. With ``nnodes=K`` each simulated node is one replica
    group of ``nprocs // K`` processes (``Hierarchical``: sync inside, fault tolerant
    across): a dead process takes its group down, and the launcher restarts that whole
    group (``min_replicas`` then counts groups). Every process runs on this machine; a
    fault-tolerant job across real nodes is :func:`launch_node` on each (``stratagem run
    --nnodes K --fault-tolerant``).
    """
    check_int("nprocs", nprocs, minimum=1, fix="pass e.g. nprocs=2")
    check_int("num_ps", num_ps, minimum=0, fix="pass 0 for no shards")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    if max_restarts is None:
        max_restarts = 10 if fault_tolerant else 0
    check_int("max_restarts", max_restarts, minimum=0, fix="pass 0 to never restart")
    check_int("min_replicas", min_replicas, minimum=1,
              fix="pass the fewest live replicas training may continue with, e.g. 2")
    if fault_tolerant:
        if num_ps:
            raise ValueError(
                f"fault_tolerant=True runs synchronous strategies, without parameter-server "
                f"shards; got num_ps={num_ps}. Fix: drop num_ps, or launch without fault "
                "tolerance")
        if min_replicas > nnodes if nnodes > 1 else min_replicas > nprocs:
            what = f"the replica groups (nnodes={nnodes})" if nnodes > 1 else f"nprocs={nprocs}"
            raise ValueError(f"min_replicas must be <= {what}, got min_replicas="
                             f"{min_replicas}. Fix: lower min_replicas")
        restart = "failed"
    check_choice("restart", restart, ("all", "failed"),
                 fix="'failed' restarts only the dead worker (async strategies without a "
                     "process group)")
    check_nnodes(nprocs, nnodes)
    _check_picklable_target(fn)
    # A strategy named in the workers' environment is built here first, so a bad
    # argument raises once in the caller instead of in every worker.
    from stratagem._argcheck import check_launch_env

    check_launch_env({**os.environ, **(env or {})}, world_size=nprocs,
                     local_world_size=nprocs // nnodes, num_ps=num_ps)
    return _launch(fn, nprocs, num_ps, args, nnodes=nnodes, timeout=timeout, env=env,
                   max_restarts=max_restarts, restart=restart, fault_tolerant=fault_tolerant,
                   min_replicas=min_replicas, node=None)


@dataclass(frozen=True)
class FTNode:
    """This machine's place in a fault-tolerant job across nodes (``stratagem run --nnodes K
    --node-rank i --master-addr A --master-port Q --fault-tolerant``), for
    :func:`launch_node`.

    ``master_addr`` (an IP address) and ``master_port``: node 0's job store; node 0's quorum
    service listens on ``master_addr:master_port + 1``. ``host``: this node's own address on
    the network the nodes share (the one that routes to ``master_addr``); every server of this
    node's workers binds it alone. ``token_file``: the job's secret, the same on every node.
    ``group``: processes per replica group (it divides the processes per node: a group never
    spans nodes).
    """

    node_rank: int
    nnodes: int
    master_addr: str
    master_port: int
    host: str
    token_file: str
    group: int = 1

    @property
    def quorum_port(self) -> int:
        """Where node 0's quorum service listens: the port after the store's."""
        return self.master_port + 1


#: Seconds a node waits for node 0's store and quorum service, and node 0 for the other
#: nodes' launchers to finish at the end (they may still need its quorum service).
NODE_WAIT = 300.0


def launch_node(fn: Callable[..., Any], *, nproc: int, node: FTNode,
                args: tuple[Any, ...] = (), env: Mapping[str, str] | None = None,
                min_replicas: int = 1, max_restarts: int | None = None) -> list[Any]:
    """One node's share of a fault-tolerant job across nodes: the launcher and supervisor of
    ``nproc`` workers on this machine (global ranks ``node.node_rank * nproc + i``), as
    :func:`launch` with ``fault_tolerant=True`` is on one machine; returns this node's
    results. Node 0 also hosts the job store and the quorum service, and waits (at most
    :data:`NODE_WAIT` s) for the other nodes' launchers to finish before stopping them. A
    dead worker is restarted by its own node's launcher, alone (or with its replica group)."""
    check_int("nproc", nproc, minimum=1, fix="pass e.g. nproc=2")
    if max_restarts is None:
        max_restarts = 10
    check_int("max_restarts", max_restarts, minimum=0, fix="pass 0 to never restart")
    check_int("min_replicas", min_replicas, minimum=1,
              fix="pass the fewest live replicas training may continue with, e.g. 2")
    if nproc % node.group:
        raise ValueError(f"a replica group of {node.group} processes must not span nodes: it "
                         f"must divide the {nproc} processes per node. Fix: pass a divisor of "
                         f"{nproc}")
    groups = nproc * node.nnodes // node.group
    if min_replicas > groups:
        raise ValueError(f"min_replicas must be <= the job's {groups} replica groups, got "
                         f"min_replicas={min_replicas}. Fix: lower min_replicas")
    _check_picklable_target(fn)
    from stratagem._argcheck import check_launch_env

    check_launch_env({**os.environ, **(env or {})}, world_size=nproc * node.nnodes,
                     local_world_size=nproc, num_ps=0)
    return _launch(fn, nproc, 0, args, nnodes=node.nnodes, timeout=None, env=env,
                   max_restarts=max_restarts, restart="failed", fault_tolerant=True,
                   min_replicas=min_replicas, node=node)


def _job_store(node: FTNode | None) -> Any:
    """The job's store: on loopback (one machine), bound to ``master_addr`` (node 0 of several)
    or a client of node 0's (the other nodes)."""
    if node is None:
        # Port 0 lets the OS pick a free port with no race; the store lives as long as the
        # launch and listens on loopback only.
        return loopback_tcp_store(_MASTER_ADDR, 0, timeout=timedelta(seconds=60))
    if node.node_rank == 0:
        return bound_tcp_store(node.master_addr, node.master_port,
                               timeout=timedelta(seconds=60))
    from torch.distributed import TCPStore

    try:
        return TCPStore(node.master_addr, node.master_port, is_master=False,
                        timeout=timedelta(seconds=NODE_WAIT), wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError
        raise WorkerError(f"node {node.node_rank} could not reach node 0's job store at "
                          f"{node.master_addr}:{node.master_port} within {NODE_WAIT:g} s ({e}). "
                          "Fix: start node 0 with the same --master-addr/--master-port, or "
                          "check the network between the nodes") from e


_FT_READY = "stratagem/ft/quorum_ready"
_FT_FINISHED = "stratagem/ft/finished"
_FT_NODES_DONE = "stratagem/ft/nodes_done"


def _launch(fn: Callable[..., Any], nprocs: int, num_ps: int, args: tuple[Any, ...], *,
            nnodes: int, timeout: float | None, env: Mapping[str, str] | None,
            max_restarts: int, restart: str, fault_tolerant: bool, min_replicas: int,
            node: FTNode | None) -> list[Any]:
    """:func:`launch`'s and :func:`launch_node`'s supervisor (arguments checked there).
    ``nprocs``: the workers on this machine; with ``node`` they are ranks ``offset ..
    offset + nprocs - 1`` of ``world`` across ``nnodes`` real nodes."""
    world = nprocs * nnodes if node is not None else nprocs
    offset = node.node_rank * nprocs if node is not None else 0
    deadline = None if timeout is None else time.monotonic() + timeout
    ctx = mp.get_context("spawn")
    shards: PSShards | None = None
    quorum: Any = None
    sup: _Supervisor | None = None
    spares: list[_Spare] = []
    store = _job_store(node)
    spare_ctx = _spare_context() if fault_tolerant else ctx  # released in the finally
    try:
        if num_ps:
            shards = start_ps_shards(num_ps)
        # Fault tolerant on K simulated nodes: each node is one replica group; on real nodes,
        # --replica-group-size.
        if node is not None:
            group = node.group
        else:
            group = nprocs // nnodes if fault_tolerant and nnodes > 1 else 1
        lighthouse = ""
        if fault_tolerant:
            from .ft.launch import QuorumService, lighthouse_address

            if node is None:
                quorum = QuorumService(num_slots=nprocs if nnodes == 1 else nnodes,
                                       min_replicas=min_replicas)
                lighthouse = quorum.address()
            else:
                if node.node_rank == 0:
                    quorum = QuorumService(num_slots=world // group, min_replicas=min_replicas,
                                           host=node.master_addr, port=node.quorum_port,
                                           allow_remote=not is_loopback(node.master_addr),
                                           token_file=node.token_file)
                    store.set(_FT_READY, "1")
                else:  # node 0's quorum service: up before this node's workers start
                    try:
                        store.wait([_FT_READY], timedelta(seconds=NODE_WAIT))
                    except Exception as e:  # noqa: BLE001 - torch's store timeout/closed
                        raise WorkerError(
                            f"node {node.node_rank}: node 0's quorum service did not start "
                            f"within {NODE_WAIT:g} s ({e}). Fix: check node 0's output (it "
                            "needs stratagem[ft] and a free port "
                            f"{node.quorum_port} on {node.master_addr})") from e
                lighthouse = lighthouse_address(node.master_addr, node.quorum_port)
        base = {**os.environ, **(env or {})}
        port = store.port if node is None else node.master_port
        master_addr = _MASTER_ADDR if node is None else node.master_addr

        def environment(rank: int, attempt: int) -> dict[str, str]:
            rank += offset  # this machine's worker ``rank``: the job's ``offset + rank``
            wenv = worker_env(rank=rank, world_size=world, master_port=port,
                              master_addr=master_addr,
                              ps_addrs=shards.addresses if shards else (), base=base,
                              nnodes=nnodes, max_restarts=max_restarts)
            if shards is not None:
                wenv.update(shards.env())  # the shards' token file
            wenv.update(env or {})
            if fault_tolerant:
                from .ft.launch import worker_env as ft_env

                if node is None:
                    assert quorum is not None
                    wenv.update(quorum.env(rank // group))
                else:
                    wenv.update(ft_env(slot=rank // group, num_slots=world // group,
                                       lighthouse=lighthouse, min_replicas=min_replicas,
                                       token_file=node.token_file, host=node.host))
                if group > 1:
                    from .ft.env import GROUP_RANK_ENV, GROUP_SIZE_ENV

                    wenv.update({GROUP_RANK_ENV: str(rank % group),
                                 GROUP_SIZE_ENV: str(group)})
            wenv["TORCHELASTIC_RESTART_COUNT"] = str(attempt)  # Restarts
            return wenv

        # Fault tolerant: warm spares (torch imported, waiting) take dead workers' places at
        # once, so a replacement does not pay the interpreter's and torch's start-up after the
        # failure (~3-5 s here): one per process of a replica group (a group is restarted
        # whole). New spares start once the replacements had SPARE_DELAY s to start on their
        # own (they would share the CPUs).
        use_spares = os.environ.get("STRATAGEM_FT_SPARES", "1") != "0"
        delay = _spare_delay()
        spare_due = (time.monotonic() + max(delay, SPARE_START_DELAY)
                     if fault_tolerant and use_spares else None)

        def start(rank: int, attempt: int) -> tuple[BaseProcess, Connection]:
            nonlocal spare_due
            wenv = environment(rank, attempt)
            if spares and attempt > 0:
                taken = spares.pop().take(fn, tuple(args), wenv)
                spare_due = time.monotonic() + delay
                if taken is not None:
                    return taken
            r, w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker_main, args=(fn, tuple(args), w, os.getpid()),
                            name=f"stratagem-worker-{rank}", daemon=False)
            with _patched_environ(wenv):
                p.start()
            w.close()  # keep only the child's end open, so its death reads as EOF here
            return p, r

        sup = _Supervisor(offset)
        for rank in range(nprocs):
            sup.add(*start(rank, 0))
        # Restart budget (total for "all", per rank for "failed").
        attempts = [0] * nprocs
        last: dict[int, str] = {}
        ended: set[int] = set()
        finished = False  # several nodes: a replica of any node has finished training
        all_reported: float | None = None
        while not sup.done:
            left = 3600.0 if deadline is None else deadline - time.monotonic()
            if len(sup.results) == nprocs:
                # Every result is in hand: a worker stuck at exit (a non-daemon thread, a
                # hanging destructor) must not hold the caller forever.
                all_reported = all_reported or time.monotonic()
                left = min(left, all_reported + EXIT_GRACE - time.monotonic())
                if left <= 0:
                    stuck = [offset + r for r in range(nprocs) if r not in sup.exited]
                    warnings.warn(f"workers {stuck} returned but did not exit within "
                                  f"{EXIT_GRACE:g} s; they were killed", stacklevel=2)
                    break
            if left <= 0:
                running = [offset + r for r in range(nprocs) if r not in sup.exited]
                raise WorkerError(
                    f"launch timed out after {timeout:g} s with ranks {running} still running; "
                    "all workers were stopped. Find the hang (often a collective waiting for "
                    "a peer that never calls it) or pass a larger timeout=")
            if spare_due is not None and len(spares) < group and time.monotonic() >= spare_due \
                    and not sup.results:
                spares.append(_Spare(spare_ctx, environment(0, 0)))
            wait_s = min(left, 3600.0)
            if spare_due is not None and len(spares) < group:
                wait_s = max(0.0, min(wait_s, spare_due - time.monotonic() + 0.01))
            failure = sup.poll(wait_s)
            if node is not None and sup.results and not finished:
                finished = True  # tell the other nodes: a replica has finished training
                with contextlib.suppress(Exception):
                    store.set(_FT_FINISHED, "1")
            if failure is None:
                continue
            # Restarts. Every rank that exited without a result has failed.
            dead = sorted(r for r in sup.exited if r not in sup.results)
            if node is not None and not finished:
                with contextlib.suppress(Exception):
                    finished = bool(store.check([_FT_FINISHED]))
            if fault_tolerant and (sup.results or finished):
                # A replica has finished training, so the job is over; a replica lost
                # now has nothing left to train (its peers hold the final model) and a
                # replacement would find nobody to heal from.
                for r in dead:
                    if r not in ended:
                        ended.add(r)
                        who = (f"replica(s) {sorted(offset + w for w in sup.results)}"
                               if sup.results else "a replica on another node")
                        print(f"stratagem: {sup.describe(r)} after {who} finished training; "
                              "not restarted",
                              file=sys.stderr, flush=True)
                        sup.results[r] = None
                continue
            # The same exception twice in a row from one worker is a bug, not bad luck: no
            # restart will mend it.
            repeated = [r for r in dead if r in sup.errors and sup.describe(r) == last.get(r)]
            if group > 1:
                # A replica group goes down with any of its processes: the others fail in
                # the group's collectives (the same error each time). The group's failure
                # repeats only when every dead member's does.
                dead = sorted({m for r in dead for m in range(r - r % group, r - r % group
                                                              + group)})
                repeated = [r for r in repeated
                            if all(m in repeated
                                   for m in range(r - r % group, r - r % group + group))]
            last.update({r: sup.describe(r) for r in dead if r in sup.exited})
            if restart == "failed" and not repeated \
                    and all(attempts[r] < max_restarts for r in dead):
                if group > 1:  # one life number for every process of a restarted group
                    for r in dead:
                        attempts[r] = max(attempts[m] for m in dead if m // group == r // group)
                # A restarted replica group takes a fresh replica id: the ids its old processes
                # were heard under are forgotten once they are reaped, so the survivors' next
                # quorum does not wait for those heartbeats to age out (quorum service on this
                # launcher only; across nodes, the heartbeat timeout).
                gone = (set().union(*(quorum.replica_ids((offset + r) // group) for r in dead))
                        if group > 1 and quorum is not None else set())
                for r in dead:
                    attempts[r] += 1
                    # Say why: a worker restarted in silence hides the bug that kills it.
                    g = (offset + r) // group
                    why = (sup.describe(r) if r in sup.exited
                           else f"worker {offset + r} is in replica group {g}, which lost a "
                                "process")
                    alone = "alone" if group == 1 else f"with its replica group {g}"
                    print(f"stratagem: {why}; restarting worker {offset + r} {alone} (restart "
                          f"{attempts[r]} of {max_restarts})", file=sys.stderr, flush=True)
                    sup.restart(r, *start(r, attempts[r]))
                if gone:
                    quorum.forget(gone)
                continue
            if restart == "all" and attempts[0] < max_restarts:
                attempts[0] += 1
                sup.stop_all()
                sup = _Supervisor(offset)
                for rank in range(nprocs):
                    sup.add(*start(rank, attempts[0]))
                continue
            raise failure
        if node is not None and node.node_rank == 0:
            _node_done(store, node)
        return [sup.results[r] for r in range(nprocs)]
    finally:
        if node is not None and node.node_rank > 0:
            _node_done(store, node)
        for one in spares:
            one.stop()
        if sup is not None:
            sup.stop_all()
        if shards is not None:
            shards.stop()
        if quorum is not None:
            quorum.stop()
        if spare_ctx is not ctx:
            _release_spare_context(spare_ctx)
        del store
