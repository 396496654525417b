"""What a fault-tolerant launcher starts: the quorum service, a job secret, each worker's Comm.

The quorum service speaks torchft's Lighthouse protocol and admits only members that prove
the job's secret (:mod:`stratagem.ft.quorum`); it is bound to one address (loopback on one node,
``--master-addr`` across nodes), never every interface. How fast a lost replica leaves the
quorum: a worker that dies in a collective makes its peers' collective fail at once (gloo
sees the reset connection); the next quorum then forms without it as soon as its heartbeat is
older than :data:`HEARTBEAT_TIMEOUT_MS` (its manager server died with it). A stalled worker
(SIGSTOP) stops heartbeating too; its peers' in-flight collective fails after ``timeout``.
"""

from __future__ import annotations

import contextlib
import gc
import os
import secrets
import stat
import tempfile
from datetime import timedelta
from typing import Any

import torch

from .._rendezvous import bracket_host, is_loopback
from .env import (
    GROUP_RANK_ENV,
    GROUP_SIZE_ENV,
    HOST_ENV,
    LIGHTHOUSE_ENV,
    MIN_REPLICAS_ENV,
    SLOT_ENV,
    SLOTS_ENV,
    TOKEN_FILE_ENV,
)

__all__ = ["QuorumService", "comm_from_env", "worker_env", "read_token_file",
           "lighthouse_address",
           "HEARTBEAT_TIMEOUT_MS", "JOIN_TIMEOUT_MS"]

#: A replica whose manager has not heartbeaten for this long leaves the quorum (torchft's
#: default is 5 s; its manager servers beat every 100 ms).
HEARTBEAT_TIMEOUT_MS = 1000
#: How long a quorum waits for live replicas that have not asked to join yet.
JOIN_TIMEOUT_MS = 1000


class QuorumService:
    """The quorum service on ``host`` (loopback by default), plus the job's secret: torchft's
    Lighthouse protocol, admitting only members that prove the secret
    (:class:`~stratagem.ft.quorum.VerifiedQuorumService`).

    ``min_replicas``: the fewest replicas a quorum may have. The secret is written to a file
    of mode 0600 in a private directory; workers find it through ``STRATAGEM_FT_TOKEN_FILE``
    (never on a command line). ``stop()`` shuts the server down and removes the directory.
    """

    def __init__(self, *, num_slots: int, min_replicas: int = 1, host: str = "127.0.0.1",
                 allow_remote: bool = False, port: int = 0,
                 token_file: str | None = None) -> None:
        from .comm import require_torchft
        from .quorum import VerifiedQuorumService

        require_torchft()
        if not allow_remote and not is_loopback(host):
            raise ValueError(f"the quorum service listens on loopback on one node, got host="
                             f"{host!r}. Fix: omit host, or pass the --master-addr of a "
                             "multi-node job with allow_remote=True")
        if min_replicas > num_slots:
            raise ValueError(f"min_replicas must be <= the number of workers, got min_replicas="
                             f"{min_replicas} > {num_slots}. Fix: lower --min-replicas")
        self._dir: str | None = None
        if token_file is not None:
            token = read_token_file(token_file)  # the user's secret (several nodes)
            self.token_file = token_file
        else:
            self._dir = tempfile.mkdtemp(prefix="stratagem-ft-")
            self.token_file = os.path.join(self._dir, "token")
            fd = os.open(self.token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            token = read_token_file(self.token_file)
        self.host = host
        self.num_slots = num_slots
        self.min_replicas = min_replicas
        try:
            # Admits only members that prove the job's secret (stratagem.ft.quorum).
            self._server = VerifiedQuorumService(
                bind=f"{bracket_host(host)}:{port}", token=token, min_replicas=min_replicas,
                join_timeout_ms=JOIN_TIMEOUT_MS, heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
                quorum_tick_ms=50)
        except BaseException:
            self._remove_secret()
            raise
        self.port = self._server.port

    def address(self) -> str:
        """``http://host:port`` of the Lighthouse."""
        return lighthouse_address(self.host, self.port)

    def env(self, slot: int) -> dict[str, str]:
        """The variables worker ``slot`` needs (see :mod:`stratagem.ft.env`)."""
        return worker_env(slot=slot, num_slots=self.num_slots, lighthouse=self.address(),
                          min_replicas=self.min_replicas, token_file=self.token_file,
                          host=self.host)

    def replica_ids(self, slot: int) -> set[str]:
        """The ids replica (group) ``slot`` has been heard under."""
        return self._server.ids_of(f"slot{slot}:")

    def asked_since(self, slot: int, since: float) -> bool:
        """Whether replica (group) ``slot`` has asked for a quorum at or after ``since``
        (``time.monotonic()``, this process's clock)."""
        return self._server.asked_since(f"slot{slot}:", since)

    def forget(self, ids: set[str]) -> None:
        """Forget ``ids`` of replicas the launcher knows are dead (see
        :meth:`~stratagem.ft.quorum.VerifiedQuorumService.evict`)."""
        self._server.evict(ids)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._server.shutdown()
        self._remove_secret()

    def _remove_secret(self) -> None:
        if self._dir is None:
            return  # the user's token file (a multi-node job): not ours to remove
        with contextlib.suppress(OSError):
            os.unlink(self.token_file)
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)

    def __enter__(self) -> QuorumService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def lighthouse_address(host: str, port: int) -> str:
    """The quorum service's URL at ``host:port`` (IPv6 in brackets)."""
    return f"http://{bracket_host(host)}:{port}"


def worker_env(*, slot: int, num_slots: int, lighthouse: str, min_replicas: int,
               token_file: str, host: str = "127.0.0.1") -> dict[str, str]:
    """A fault-tolerant worker's variables: its slot, the quorum service, the secret's file.
    Each worker is a process group of its own (``WORLD_SIZE=1``); the quorum joins them."""
    return {LIGHTHOUSE_ENV: lighthouse, SLOT_ENV: str(slot), SLOTS_ENV: str(num_slots),
            MIN_REPLICAS_ENV: str(min_replicas), TOKEN_FILE_ENV: token_file, HOST_ENV: host}


def read_token_file(path: str) -> bytes:
    """The job secret from ``path``: a regular file, not a link, readable by its owner only."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"the fault-tolerance token file {path} is not a regular file. "
                             "Fix: let the launcher create it")
        if info.st_mode & 0o077:
            raise ValueError(f"the fault-tolerance token file {path} is readable by others "
                             f"(mode {stat.S_IMODE(info.st_mode):o}). Fix: chmod 600 {path}")
        data = os.read(fd, 4096).strip()
    finally:
        os.close(fd)
    if len(data) < 16:
        raise ValueError(f"the fault-tolerance token in {path} is shorter than 16 bytes. Fix: "
                         "let the launcher create it")
    return data


def comm_from_env(*, timeout: float, device: torch.device | None, min_replicas: int,
                  startup_timeout: float | None = None) -> Any:
    """This worker's :class:`~stratagem.ft.comm.FaultTolerantComm`, from the launcher's
    variables. ``min_replicas`` (the strategy's) may raise the launcher's, never lower it."""
    from .comm import FaultTolerantComm

    env = os.environ
    missing = [k for k in (LIGHTHOUSE_ENV, SLOT_ENV, SLOTS_ENV) if k not in env]
    if missing:
        if env.get("SLURM_JOB_ID"):
            raise RuntimeError(
                f"fault_tolerant=True needs a fault-tolerant launcher; {missing} are not set: "
                "Slurm started this process itself (srun python ...), and Slurm does not "
                "restart one worker alone or heal it. Fix: one stratagem launcher per node, "
                "`srun --ntasks-per-node=1 stratagem run --fault-tolerant --nproc N "
                "--ft-token-file PATH train.py` (the same 0600 secret file on every node)")
        raise RuntimeError(
            f"fault_tolerant=True needs a fault-tolerant launcher; {missing} are not set (plain "
            "torchrun, srun or a Ray worker set none of them). Fix: start the job with "
            "`stratagem run --fault-tolerant ...` or sg.launch(..., fault_tolerant=True)")
    if not env.get(TOKEN_FILE_ENV):
        # Never unauthenticated by accident: every member of the quorum proves the job's
        # secret, so there is no fault tolerance without one.
        raise RuntimeError(
            f"fault_tolerant=True with no job secret: {TOKEN_FILE_ENV} is not set, and fault "
            "tolerance never runs unauthenticated. Fix: start the job with `stratagem run "
            "--fault-tolerant` (it makes the secret on one node); on several nodes give every "
            "node the same 0600 secret file with --ft-token-file PATH")
    token = read_token_file(env[TOKEN_FILE_ENV])  # checked before anything is contacted
    host = env.get(HOST_ENV, "127.0.0.1")
    job_store = None
    if "MASTER_PORT" in env:
        from torch.distributed import TCPStore

        with contextlib.suppress(Exception):
            job_store = TCPStore(env.get("MASTER_ADDR", "127.0.0.1"), int(env["MASTER_PORT"]),
                                 is_master=False, timeout=timedelta(seconds=30),
                                 wait_for_workers=False)
    floor = int(env.get(MIN_REPLICAS_ENV, "1"))
    slot = int(env[SLOT_ENV])
    life = int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    group_size = int(env.get(GROUP_SIZE_ENV, "1"))
    group_store = None
    group_comm = None
    group_rank = int(env.get(GROUP_RANK_ENV, "0"))
    if group_size > 1:
        if job_store is None:
            raise RuntimeError(
                "a fault-tolerant replica group of several processes needs the launcher's "
                "store (MASTER_ADDR/MASTER_PORT), which could not be reached. Fix: start the "
                "job with sg.launch(..., nnodes=K, fault_tolerant=True)")
        from torch.distributed import PrefixStore

        # One store namespace per life of the group: a restarted group never reads the
        # addresses its previous processes left.
        group_store = PrefixStore(f"ftgroup/{slot}/{life}", job_store)
        # The group's processes form torch.distributed's default group (fixed membership),
        # so that FSDP2 (Hierarchical(inner=Sharded)) finds it; the quorum across groups is
        # torchft's.
        from ..comm import Comm, nccl_device

        if device is not None and device.type == "cuda" and nccl_device(device) is not None:
            from .upstream import nccl_env_defaults

            # Not the error handling: the group's own NCCL group keeps torch's (a process
            # whose group-mate died ends, and the launcher restarts the whole group).
            nccl_env_defaults(error_handling=False)
        group_comm = Comm.default_group(PrefixStore("group", group_store), group_rank,
                                        group_size, timeout=timeout, device=device,
                                        startup_timeout=startup_timeout)
    # After a failed step every survivor runs a full garbage collection (the failed group's
    # last references sit in cycles: FaultTolerantComm._drop_group). With torch and its
    # compiler front end imported it walked ~0.5 s of objects in each survivor (py-spy),
    # which delayed its quorum request and took the CPU a replacement needs to start. What
    # exists before this worker's Comm (modules, the script's data) lives as long as the
    # worker: freeze it out of the cyclic collector (reference counting still frees it;
    # close() unfreezes). Process groups, their work and errors come after: still collected.
    frozen = gc.isenabled() and gc.get_freeze_count() == 0  # a user's own freeze stays
    if frozen:
        gc.freeze()
    comm = FaultTolerantComm(
        lighthouse=env[LIGHTHOUSE_ENV], slot=slot, num_slots=int(env[SLOTS_ENV]),
        token=token, min_replicas=max(floor, min_replicas),
        timeout=timeout, host=host, job_store=job_store, device=device,
        allow_remote=not is_loopback(host), joining=life > 0,
        group_rank=group_rank, group_size=group_size, group_store=group_store,
        group_comm=group_comm)
    comm.unfreeze_gc_on_close = frozen
    return comm
