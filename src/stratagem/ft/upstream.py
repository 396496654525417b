"""The one place stratagem uses torchft beyond its public API.

Every other module of stratagem talks to torchft through its public API only (``Manager``'s
public methods, ``ProcessGroupGloo``, ``LighthouseServer``, ``CheckpointTransport``) and
through the small functions here. What this module does that torchft does not offer:

- it builds ``torchft.Manager``'s manager server on one host and under an exact replica id,
  by replacing the module global ``torchft.manager.ManagerServer`` while a manager is built
  (:func:`build_manager`, :func:`manager_server_on`);
- it commits an elided transaction (``stratagem.ft.comm``'s "Quorum elision") by doing the
  step bookkeeping of ``Manager.should_commit`` itself, writing the manager's private
  counters (:func:`commit_bookkeeping`), which is safe only while ``should_commit`` still
  keeps exactly those counters (:func:`should_commit_is_elidable`, read from its bytecode
  names);
- it reads the manager's private quorum id (:func:`quorum_id`);
- it hosts the reconfigurable gloo group's rendezvous store itself, on one host, by setting
  the group's private ``_rendezvous_store`` before torchft's ``get_reconfigure_handle``
  would create one on every interface (:func:`bound_gloo_group`), and signs each handle
  with the member's claim (:mod:`stratagem.ft.membership`);
- on CUDA it gives that group an NCCL backend for CUDA tensors beside gloo for CPU ones,
  built for each quorum in the group's private ``_create_pg`` and aborted when the quorum
  changes (:func:`bound_gloo_group` with ``device=``);
- it checks every quorum a manager is given before the manager touches an address in it,
  by wrapping the manager's private ``_client`` (:func:`verify_quorums`), and reads the
  manager server's address and replica id from the keys torchft publishes them under
  (:func:`manager_identity`).

:data:`RELIANCES` lists each private symbol relied on: what is expected of it, why, and the
public torchft hook that would make the workaround unnecessary (also in
``docs/design/torchft-boundary.md``). :func:`check_contract` checks them all against the
installed torchft. At run time a broken reliance never goes unnoticed: the manager server
and the gloo store (which would otherwise listen on every interface) raise
:class:`TorchftContractError`; quorum elision, the quorum-id cache and the NCCL backend fall
back (every step asks for a quorum; the live slots are gathered at every call; CUDA tensors go
over gloo through host memory) with a :class:`TorchftContractWarning` naming the symbol.

torchft is an optional dependency: importing this module does not import it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import json
import threading
import types
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .._rendezvous import bound_tcp_store, bracket_host
from ..errors import StratagemError

__all__ = ["RELIANCES", "Reliance", "ServerInstall", "TorchftContractError",
           "TorchftContractWarning", "bound_gloo_group", "build_manager", "check_contract",
           "commit_bookkeeping", "manager_identity", "manager_server_on", "problems_for",
           "quorum_id", "should_commit_is_elidable", "verify_quorums"]

#: What in stratagem depends on a reliance (:attr:`Reliance.feature`).
MANAGER_SERVER = "manager-server"  #: the manager server bound to one host, under an exact id
ELISION = "quorum-elision"  #: a transaction committed without torchft's quorum and vote
QUORUM_ID = "quorum-id"  #: the live slots cached until the quorum changes
GLOO_STORE = "gloo-store"  #: the gloo group's rendezvous store bound to one host
MEMBERSHIP = "verified-membership"  #: every quorum checked before its addresses are used
NCCL_GROUP = "nccl-group"  #: the group's CUDA collectives over NCCL, rebuilt with the quorum


class TorchftContractError(StratagemError):
    """The installed torchft no longer has a private symbol stratagem relies on, where
    going on without it would be unsafe (a server listening on every interface)."""


class TorchftContractWarning(UserWarning):
    """The installed torchft no longer has a private symbol stratagem relies on; stratagem
    falls back to a slower path that needs only torchft's public API."""


@dataclass(frozen=True)
class Reliance:
    """One private torchft symbol (or signature) stratagem relies on.

    ``kind`` says what :func:`check_contract` inspects on the object ``module``.``obj``
    (``obj`` empty: the module itself):

    - ``"attribute"``: the object has the attributes ``expects``;
    - ``"names"``: its code (unwrapped) refers to each of ``expects`` among its bytecode
      names (``co_names``: attributes and globals it loads or stores);
    - ``"keywords"``: its code makes a call passing all of ``expects`` as keywords;
    - ``"constants"``: its code holds each of ``expects`` as a string constant.
    """

    symbol: str  #: the exact torchft symbol, as :func:`check_contract` reports it
    kind: str
    module: str
    obj: str
    expects: tuple[str, ...]
    feature: str  #: what in stratagem breaks without it (MANAGER_SERVER, ELISION, ...)
    why: str  #: why stratagem needs it
    hook: str  #: the public torchft API that would make the workaround unnecessary

    @property
    def target(self) -> str:
        """The dotted name of the object inspected."""
        return f"{self.module}.{self.obj}" if self.obj else self.module


_SERVER_HOOK = ("a `bind` (host:port) argument to torchft.Manager for its manager server, "
                "and a way to give it the exact replica id (no uuid appended)")
_COMMIT_HOOK = ("a public Manager method that records a step committed (or failed) by the "
                "caller without the manager server's vote, e.g. "
                "Manager.commit_local(ok: bool, participants: int)")

#: Every private torchft symbol stratagem relies on (see the module docstring).
RELIANCES: tuple[Reliance, ...] = (
    Reliance(
        symbol="torchft.manager.ManagerServer", kind="attribute", module="torchft.manager",
        obj="", expects=("ManagerServer",), feature=MANAGER_SERVER,
        why="replaced while a Manager is built, so that its manager server binds the job's "
            "host instead of every interface ([::]) and keeps a replacement's exact replica id",
        hook=_SERVER_HOOK),
    Reliance(
        symbol="torchft.manager.Manager.__init__", kind="names", module="torchft.manager",
        obj="Manager.__init__", expects=("ManagerServer",), feature=MANAGER_SERVER,
        why="the replacement of torchft.manager.ManagerServer takes effect only while "
            "Manager.__init__ looks the server class up as a module global when it runs",
        hook=_SERVER_HOOK),
    Reliance(
        symbol="torchft.manager.ManagerServer(bind=, replica_id=)", kind="keywords",
        module="torchft.manager", obj="Manager.__init__", expects=("bind", "replica_id"),
        feature=MANAGER_SERVER,
        why="the replacement overrides the `bind` and `replica_id` keywords Manager.__init__ "
            "passes to ManagerServer (it takes keywords only)",
        hook=_SERVER_HOOK),
    Reliance(
        symbol="torchft.manager.Manager._step", kind="names", module="torchft.manager",
        obj="Manager.should_commit", expects=("_step",), feature=ELISION,
        why="an elided commit advances the step count as should_commit does",
        hook=_COMMIT_HOOK),
    Reliance(
        symbol="torchft.manager.Manager._batches_committed", kind="names",
        module="torchft.manager", obj="Manager.should_commit", expects=("_batches_committed",),
        feature=ELISION,
        why="an elided commit adds the quorum's size to the batches committed as "
            "should_commit does",
        hook=_COMMIT_HOOK),
    Reliance(
        symbol="torchft.manager.Manager._commit_failures", kind="names",
        module="torchft.manager", obj="Manager.should_commit", expects=("_commit_failures",),
        feature=ELISION,
        why="an elided commit resets (or counts) consecutive commit failures as "
            "should_commit does",
        hook=_COMMIT_HOOK),
    Reliance(
        symbol="torchft.manager.Manager._checkpoint_transport", kind="names",
        module="torchft.manager", obj="Manager.should_commit",
        expects=("_checkpoint_transport",), feature=ELISION,
        why="an elided commit closes the heal window of the manager's checkpoint transport "
            "as should_commit does",
        hook=_COMMIT_HOOK),
    Reliance(
        symbol="torchft.checkpointing.CheckpointTransport.disallow_checkpoint", kind="names",
        module="torchft.manager", obj="Manager.should_commit",
        expects=("disallow_checkpoint",), feature=ELISION,
        why="should_commit must still close the heal window through the transport's "
            "disallow_checkpoint, which an elided commit calls in its place",
        hook=_COMMIT_HOOK),
    Reliance(
        symbol="torchft.manager.Manager._quorum_id", kind="names", module="torchft.manager",
        obj="Manager._async_quorum", expects=("_quorum_id",), feature=QUORUM_ID,
        why="FaultTolerantComm.live_slots caches the quorum's slots until the quorum id "
            "(updated by each quorum) changes",
        hook="a public Manager.quorum_id() accessor"),
    Reliance(
        symbol="torchft.process_group.ProcessGroup._rendezvous_store", kind="names",
        module="torchft.process_group", obj="ProcessGroup.get_reconfigure_handle",
        expects=("_rendezvous_store",), feature=GLOO_STORE,
        why="set before get_reconfigure_handle runs, so that the group's rendezvous store is "
            "stratagem's, bound to the job's host, not a TCPStore on every interface",
        hook="a `store`/`host` argument to the reconfigurable process groups for their "
             "rendezvous store"),
    Reliance(
        symbol="torchft.process_group.ProcessGroup.get_reconfigure_handle", kind="constants",
        module="torchft.process_group", obj="ProcessGroup.get_reconfigure_handle",
        expects=("store",), feature=GLOO_STORE,
        why="its JSON handle's 'store' entry is rewritten to advertise the job's host instead "
            "of socket.gethostname()",
        hook="a `store`/`host` argument to the reconfigurable process groups for their "
             "rendezvous store"),
    Reliance(
        symbol="torchft.process_group.create_store_client", kind="names",
        module="torchft.process_group", obj="ProcessGroupWrapper.reconfigure",
        expects=("create_store_client",), feature=GLOO_STORE,
        why="while a member's group is rebuilt, its rendezvous store client is stratagem's "
            "(members only, keys under a secret-derived prefix), put in place of the "
            "TCPStore client that ProcessGroupWrapper.reconfigure looks this name up for",
        hook="a `store_factory` argument to the reconfigurable process groups"),
    Reliance(
        symbol="torchft.process_group.ProcessGroupWrapper._create_pg", kind="names",
        module="torchft.process_group", obj="ProcessGroupWrapper.reconfigure",
        expects=("_create_pg",), feature=NCCL_GROUP,
        why="on CUDA, stratagem's group builds its backends for each quorum in _create_pg, "
            "as torchft's own groups do: gloo for CPU tensors and NCCL for CUDA tensors in "
            "one process group, aborted when the quorum changes",
        hook="a reconfigurable torchft process group with one backend per device (gloo for "
             "cpu, NCCL for cuda)"),
    Reliance(
        symbol="torchft.manager.Manager._client", kind="names", module="torchft.manager",
        obj="Manager._async_quorum", expects=("_client", "_quorum"), feature=MEMBERSHIP,
        why="the quorum a manager's server returns is checked (every member proves the job's "
            "secret) before the manager uses an address in it, by wrapping the client "
            "_async_quorum calls _quorum on",
        hook="a Manager argument `verify_quorum: Callable[[QuorumResult], None]` called "
             "before the quorum is used, or authenticated quorum members in torchft itself"),
    Reliance(
        symbol="torchft.manager.Manager.should_commit(_client.should_commit)", kind="names",
        module="torchft.manager", obj="Manager.should_commit",
        expects=("_client", "should_commit"), feature=MEMBERSHIP,
        why="the commit vote across a replica group's processes is taken over the group's "
            "own process group, by the wrapped client should_commit calls",
        hook="a Manager argument for the vote across its group (or an authenticated "
             "manager server)"),
    Reliance(
        symbol="torchft.manager.MANAGER_ADDR_KEY, REPLICA_ID_KEY", kind="attribute",
        module="torchft.manager", obj="", expects=("MANAGER_ADDR_KEY", "REPLICA_ID_KEY"),
        feature=MEMBERSHIP,
        why="a replica's proof names its manager server's address and replica id, which "
            "torchft publishes in the replica group's store under these keys",
        hook="public Manager accessors for its server's address and its replica id"),
)


# ---------------------------------------------------------------------- the check
def _resolve(module: str, obj: str) -> Any:
    target: Any = importlib.import_module(module)
    for part in filter(None, obj.split(".")):
        target = getattr(target, part)
    return target


def _code(target: Any) -> types.CodeType | None:
    code = getattr(inspect.unwrap(target), "__code__", None)
    return code if isinstance(code, types.CodeType) else None


def _string_constants(code: types.CodeType) -> Iterator[Any]:
    """The constants of ``code``, the items of its tuple constants (keyword names, constant
    dict keys) included."""
    for const in code.co_consts:
        yield const
        if isinstance(const, tuple):
            yield from const


def _check(reliance: Reliance) -> str | None:
    """What is wrong with ``reliance`` in the installed torchft, or None."""
    try:
        target = _resolve(reliance.module, reliance.obj)
    except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError
        return (f"cannot inspect {reliance.target} ({type(exc).__name__}: {exc}); it is "
                f"where this is checked")
    if reliance.kind == "attribute":
        missing = [n for n in reliance.expects if not hasattr(target, n)]
        return (f"attribute missing from {reliance.target} (expected: {', '.join(missing)})"
                if missing else None)
    code = _code(target)
    if code is None:
        return f"{reliance.target} has no Python code to inspect"
    if reliance.kind == "names":
        missing = [n for n in reliance.expects if n not in code.co_names]
        return (f"{reliance.target} no longer refers to {', '.join(missing)} (expected among "
                f"its bytecode names)" if missing else None)
    if reliance.kind == "keywords":
        wanted = set(reliance.expects)
        if any(isinstance(c, tuple) and wanted <= set(c) for c in code.co_consts):
            return None
        kw = ", ".join(f"{n}=" for n in reliance.expects)
        return f"{reliance.target} makes no call with the keywords {kw}"
    if reliance.kind == "constants":
        consts = {c for c in _string_constants(code) if isinstance(c, str)}
        missing = [n for n in reliance.expects if n not in consts]
        return (f"{reliance.target} no longer holds the constant(s) "
                f"{', '.join(repr(n) for n in missing)}" if missing else None)
    raise ValueError(f"unknown kind of reliance {reliance.kind!r} for {reliance.symbol}")


def _problem(reliance: Reliance, detail: str) -> str:
    return f"{reliance.symbol}: {detail} [stratagem needs it: {reliance.why}]"


def problems_for(feature: str | None = None) -> list[str]:
    """:func:`check_contract` restricted to the reliances of one ``feature``."""
    try:
        importlib.import_module("torchft")
    except ImportError as exc:
        return [f"torchft: not importable ({exc}). Fix: pip install 'stratagem[ft]'"]
    problems = []
    for reliance in RELIANCES:
        if feature is not None and reliance.feature != feature:
            continue
        detail = _check(reliance)
        if detail is not None:
            problems.append(_problem(reliance, detail))
    return problems


def check_contract() -> list[str]:
    """What the installed torchft lacks of :data:`RELIANCES`: one human-readable line per
    broken reliance, starting with the exact symbol (``"<symbol>: <what changed> [...]"``);
    empty when it matches."""
    return problems_for(None)


def _require(feature: str, what: str) -> None:
    """Raise :class:`TorchftContractError` (``what``, the fix, then each broken reliance of
    ``feature`` by its symbol) when the installed torchft lacks what ``feature`` relies on."""
    problems = problems_for(feature)
    if problems:
        raise TorchftContractError(
            f"{what} Fix: install the torchft version stratagem is tested with (pyproject's "
            "[ft] extra). " + "; ".join(problems))


_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(feature: str, problems: list[str], fallback: str) -> None:
    with _warn_lock:
        if feature in _warned:
            return
        _warned.add(feature)
    warnings.warn(f"stratagem: the installed torchft does not match what {feature} relies on; "
                  f"{fallback}. " + "; ".join(problems), TorchftContractWarning, stacklevel=3)


# ---------------------------------------------------------------------- manager server
@dataclass
class ServerInstall:
    """What :func:`manager_server_on` saw: how many manager servers it built."""

    built: int = 0


#: Serialises the construction of managers (the manager-server rebinding replaces a module
#: attribute; tests build several managers at once in threads).
_MANAGER_LOCK = threading.Lock()


@contextlib.contextmanager
def manager_server_on(host: str, replica_id: str | None = None) -> Iterator[ServerInstall]:
    """While open, torchft builds its manager server on ``host`` instead of every interface
    (``[::]``), with ``replica_id`` under that exact id (torchft appends a fresh uuid to the
    one it is given). Holds a lock: one manager is built at a time. Raises
    :class:`TorchftContractError` naming the symbol when the installed torchft lacks what
    this relies on (the server would listen on every interface)."""
    _require(MANAGER_SERVER,
             "cannot bind torchft's manager server to one host with the installed torchft (it "
             "would listen on every interface).")
    import torchft.manager as tm

    with _MANAGER_LOCK:
        original = tm.ManagerServer
        install = ServerInstall()

        def bound(**kwargs: Any) -> Any:
            kwargs["bind"] = f"{bracket_host(host)}:0"
            if replica_id is not None:
                kwargs["replica_id"] = replica_id
            install.built += 1
            return original(**kwargs)

        tm.ManagerServer = bound  # type: ignore[misc, assignment]
        try:
            yield install
        finally:
            tm.ManagerServer = original  # type: ignore[misc]


def build_manager(*, server_host: str | None, server_replica_id: str | None = None,
                  **kwargs: Any) -> Any:
    """``torchft.Manager(**kwargs)``; with ``server_host`` (the process that builds the
    replica group's manager server) inside :func:`manager_server_on` ``(server_host,
    server_replica_id)``, and checked: a manager whose server was built some other way (listening
    on every interface) is shut down and :class:`TorchftContractError` raised."""
    from torchft import Manager

    if server_host is None:
        return Manager(**kwargs)
    with manager_server_on(server_host, server_replica_id) as install:
        manager = Manager(**kwargs)
    if not install.built:
        with contextlib.suppress(Exception):
            manager.shutdown(wait=False)
        raise TorchftContractError(
            "torchft.manager.ManagerServer: torchft.Manager built its manager server without "
            "going through torchft.manager.ManagerServer, so it was not bound to "
            f"{server_host!r} (torchft binds every interface); shut down. Fix: install the "
            "torchft version stratagem is tested with (pyproject's [ft] extra)")
    return manager


# ---------------------------------------------------------------------- commit bookkeeping
@functools.cache
def should_commit_is_elidable() -> bool:
    """Whether an elided transaction may be committed by :func:`commit_bookkeeping`: the
    installed ``Manager.should_commit`` still keeps the step bookkeeping it replicates (its
    bytecode names). False without torchft; False with a :class:`TorchftContractWarning`
    naming the changed symbols when they differ (then every step asks for a quorum)."""
    try:
        importlib.import_module("torchft")
    except ImportError:
        return False
    problems = problems_for(ELISION)
    if problems:
        _warn_once(ELISION, problems, "quorum elision is off (every step asks for a quorum)")
        return False
    return True


def commit_bookkeeping(manager: Any, *, committed: bool, participants: int) -> None:
    """What ``manager.should_commit`` records after its vote, for a vote stratagem took
    itself (a replica group of one process that skipped the quorum): the heal window
    closes; a committed step advances the step count and the batches committed
    (``participants`` replicas each) and resets the failures; a failed one counts a
    failure. Raises :class:`TorchftContractError` where :func:`should_commit_is_elidable`
    is False (the caller must not have skipped the quorum)."""
    if not should_commit_is_elidable():
        raise TorchftContractError(
            "an elided commit needs what torchft.manager.Manager.should_commit records: "
            + "; ".join(problems_for(ELISION) or ["torchft is not importable"]))
    manager._checkpoint_transport.disallow_checkpoint()
    if committed:
        manager._step += 1
        manager._batches_committed += participants
        manager._commit_failures = 0
    else:
        manager._commit_failures += 1


# ---------------------------------------------------------------------- quorum id
@functools.cache
def _quorum_id_readable() -> bool:
    problems = problems_for(QUORUM_ID)
    if problems:
        _warn_once(QUORUM_ID, problems,
                   "the live slots are gathered at every call instead of cached")
        return False
    return True


def quorum_id(manager: Any) -> int | None:
    """The id of ``manager``'s current quorum (torchft changes it whenever membership
    changes), or None when the installed torchft does not keep it where expected (then
    with a :class:`TorchftContractWarning` naming the symbol): cache nothing on it."""
    if not _quorum_id_readable():
        return None
    value = getattr(manager, "_quorum_id", None)
    if value is None:
        _warn_once(QUORUM_ID, ["torchft.manager.Manager._quorum_id: attribute missing from "
                               "the manager"],
                   "the live slots are gathered at every call instead of cached")
        return None
    return int(value)


# ---------------------------------------------------------------------- gloo group
#: What NCCL's watchdog is told in a fault-tolerant process (unless the user set them): on an
#: error, abort the communicator and fail its work without ending the process (torch's
#: default, 3, ends it); no flight-recorder dump on an error or timeout (its signal is
#: process-wide: the first NCCL group's monitor, seeing it, ends the process ~8 minutes
#: later); and a short wait before the abort (4 x this; torch's default waits 60 s, during
#: which the failed group cannot be dropped).
NCCL_ENV_DEFAULTS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
                     "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "100"}


def nccl_env_defaults(*, error_handling: bool = True) -> None:
    """Set :data:`NCCL_ENV_DEFAULTS` where the user did not. NCCL reads them when a process
    group is built, so call this on the main thread before the NCCL groups it should apply
    to (``FaultTolerantComm`` does, on CUDA, before its first quorum); they apply to every
    NCCL group of the process built after it. ``error_handling=False`` leaves
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` alone: a replica group's own NCCL group (fixed
    membership) keeps torch's default, which ends a process whose group-mate died, so that
    the launcher restarts the whole group instead of the survivors going on with a
    cancelled collective's buffers."""
    import os

    for name, value in NCCL_ENV_DEFAULTS.items():
        if error_handling or name != "TORCH_NCCL_ASYNC_ERROR_HANDLING":
            os.environ.setdefault(name, value)


def nccl_backend(store: Any, rank: int, world_size: int, device: Any,
                 timeout: timedelta) -> Any:  # pragma: no cover - needs CUDA
    """A plain ``torch.distributed`` NCCL backend of ``world_size`` ranks over ``store`` (a
    prefix of the quorum's rendezvous store), connected eagerly on ``device`` (an indexed
    CUDA device) so that a member that cannot reach the others fails in the
    reconfiguration, not in the step's first collective. Its own timeout is twice
    ``timeout``: a stalled collective is first reported by ``FaultTolerantComm``'s wait
    (the step does not commit; the group is aborted and rebuilt at the next quorum), and
    NCCL's watchdog (see :data:`NCCL_ENV_DEFAULTS`) aborts what no wait bounds."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout * 2
    backend = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    backend._set_sequence_number_for_group()
    backend.eager_connect_single_device(device)
    return backend


def _nccl_usable(device: Any) -> Any:
    """``device`` with its index (the current CUDA device where it has none: ``_create_pg``
    runs on torchft's thread, whose current device is not the training thread's) when the
    group can give CUDA tensors an NCCL backend (a CUDA device; the installed torchft
    builds its groups in ``_create_pg``), else None (with a :class:`TorchftContractWarning`
    naming the symbol when torchft is the reason)."""
    if device is None or getattr(device, "type", None) != "cuda":
        return None
    problems = problems_for(NCCL_GROUP)
    if problems:
        _warn_once(NCCL_GROUP, problems, "CUDA tensors of the fault-tolerant group go over "
                   "gloo through host memory")
        return None
    if device.index is None:  # pragma: no cover - needs CUDA
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
    return device


def bound_gloo_group(timeout: timedelta, host: str = "127.0.0.1", key: Any = None,
                     device: Any = None) -> Any:
    """torchft's reconfigurable gloo group (``ProcessGroupGloo``) whose rendezvous store is
    :func:`~stratagem._rendezvous.bound_tcp_store` on ``host``, advertised as ``host``
    (see :func:`stratagem.ft.comm.loopback_gloo_group`). With ``key`` (a
    :class:`~stratagem.ft.membership.MemberKey`), each reconfigure handle carries the claim
    the group's ``claim`` callable returns (set it with ``group.claim = fn`` once the
    manager exists) and its proof. With a CUDA ``device``, each quorum's group also gets an
    NCCL backend for CUDA tensors (:func:`nccl_backend`, on the quorum's rendezvous store
    under the prefix ``nccl``), aborted with the group when the quorum changes or a step
    fails; CPU tensors stay on gloo. Raises :class:`TorchftContractError` naming the symbol
    when the installed torchft lacks what this relies on (its store would listen on every
    interface)."""
    _require(GLOO_STORE,
             "cannot bind the gloo group's rendezvous store to one host with the installed "
             "torchft (it would listen on every interface).")
    from torchft import ProcessGroupGloo

    nccl_device = _nccl_usable(device)

    class _BoundGloo(ProcessGroupGloo):  # type: ignore[misc]
        claim: Any = None
        #: The NCCL backend of the current quorum (None: none, or not on CUDA).
        nccl: Any = None
        #: NCCL backends built so far (one per quorum that reconfigured this group).
        nccl_built = 0

        def close_member_store(self) -> None:
            """Stop the members-only rendezvous store this group hosts (if it does)."""
            store = getattr(self, "_rendezvous_store", None)
            if key is not None and store is not None:
                store.close()

        def get_reconfigure_handle(self) -> str:
            if getattr(self, "_rendezvous_store", None) is None:
                self._rendezvous_store = bound_tcp_store(
                    host, 0, timeout=timedelta(seconds=max(timeout.total_seconds(), 30.0)))
            port = self._rendezvous_store.port
            handle = json.loads(super().get_reconfigure_handle())
            advertised = handle.get("store") if isinstance(handle, dict) else None
            if not isinstance(advertised, str) or not advertised.endswith(f":{port}"):
                raise TorchftContractError(
                    "torchft.process_group.ProcessGroup._rendezvous_store: torchft's "
                    "get_reconfigure_handle did not advertise the rendezvous store stratagem "
                    f"hosts on {host!r} (port {port}; its handle's 'store': {advertised!r}). "
                    "Fix: install the torchft version stratagem is tested with (pyproject's "
                    "[ft] extra)")
            handle["store"] = f"{bracket_host(host)}:{port}"
            if key is None:
                return json.dumps(handle)
            if self.claim is None:
                raise RuntimeError("a member's process group was asked for its handle before "
                                   "its claim was set (FaultTolerantComm sets it)")
            return key.sign(handle, self.claim())

        def reconfigure(self, opts: Any) -> Any:
            if key is None:
                return super().reconfigure(opts)
            with _member_store_clients(key):
                return super().reconfigure(opts)

        def _create_pg(self, store: Any, rank: int, world_size: int) -> Any:
            pg = super()._create_pg(store, rank, world_size)
            if nccl_device is None:
                return pg
            import torch
            import torch.distributed as dist

            # torchft's gloo group registers gloo for CUDA tensors too when CUDA is there;
            # this one goes over NCCL instead (its own keys: a prefix of the same store).
            self.nccl = nccl_backend(dist.PrefixStore("nccl", store), rank, world_size,
                                     nccl_device, self._timeout)
            # NCCL keeps using the store (its monitor, a lazily built communicator): the
            # Python store object must live as long as the backend does.
            self._nccl_store = store
            self.nccl_built += 1
            pg._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL,
                                 self.nccl)
            return pg

        def errored(self) -> Exception | None:
            """An error NCCL reported asynchronously (a collective whose future completed
            at enqueue and failed later on the GPU), else torchft's answer; torchft's
            ``should_commit`` asks this after synchronising the stream."""
            err = None
            with contextlib.suppress(AttributeError, RuntimeError):  # no get_error (gloo)
                err = self.nccl.get_error()  # ProcessGroupNCCL's; no backend: None
            if err is not None and getattr(err, "name", str(err)) != "SUCCESS":
                return RuntimeError(f"the NCCL backend of this quorum's group failed "
                                    f"({err}); the step does not commit")
            return super().errored()  # type: ignore[no-any-return]

        def device_backend(self, device: str) -> Any:
            """The backend the current quorum's group runs ``device`` tensors on ("cpu",
            "cuda"); None before the first quorum or after an abort."""
            import torch

            pg = getattr(self, "_pg", None)
            return None if pg is None else pg._get_backend(torch.device(device))

        def abort(self, errored: bool = True) -> None:
            # torchft's abort calls the process group's, which aborts every backend it holds
            # (ncclCommAbort ends a collective stuck on a lost peer), then drops the group
            # (gloo's sockets close with its last reference).
            try:
                super().abort(errored=errored)
            finally:
                self.nccl = None
                self._nccl_store = None

    if key is None:
        return _BoundGloo(timeout=timeout)
    from .store import MemberStoreServer

    group = _BoundGloo(timeout=timeout)
    # The rendezvous store this member hosts serves members only (stratagem.ft.store).
    group._rendezvous_store = MemberStoreServer(host, store_key(key))  # type: ignore[assignment]
    return group


def store_key(key: Any) -> bytes:
    """The rendezvous stores' key, derived from a :class:`~stratagem.ft.membership.MemberKey`."""
    return bytes.fromhex(key.derive("rendezvous-store"))


_STORE_LOCK = threading.Lock()
_store_local = threading.local()
_store_install: dict[str, Any] = {"count": 0, "original": None}


def _store_client(store_addr: str, timeout: timedelta) -> Any:
    """torchft's ``create_store_client`` while :func:`_member_store_clients` is open: the
    member store for a reconfiguration running on this thread, torchft's own otherwise."""
    key = getattr(_store_local, "key", None)
    if key is None:
        return _store_install["original"](store_addr, timeout)
    from .store import MemberStore

    address, _, prefix = store_addr.partition("/")
    host, _, port = address.rpartition(":")
    return MemberStore(host, int(port), store_key(key),
                       prefix=key.derive("rendezvous|" + prefix), timeout=timeout)


@contextlib.contextmanager
def _member_store_clients(key: Any) -> Iterator[None]:
    """While open, a torchft process group reconfigured on this thread meets on stratagem's
    member store (:class:`~stratagem.ft.store.MemberStore`, keys under a prefix derived from
    the secret and torchft's own prefix) instead of a ``TCPStore``. Several replicas of one
    process (tests) reconfigure at once: the replacement is installed while any is open and
    picks the key of its own thread."""
    _require(GLOO_STORE,
             "cannot give the replicas' process group a members-only rendezvous store with the"
             " installed torchft.")
    import torchft.process_group as tpg

    with _STORE_LOCK:
        if _store_install["count"] == 0:
            _store_install["original"] = tpg.create_store_client
            tpg.create_store_client = _store_client  # type: ignore[assignment]
        _store_install["count"] += 1
    _store_local.key = key
    try:
        yield
    finally:
        _store_local.key = None
        with _STORE_LOCK:
            _store_install["count"] -= 1
            if _store_install["count"] == 0:
                tpg.create_store_client = _store_install["original"]  # type: ignore[assignment]


# ---------------------------------------------------------------------- membership
def manager_identity(store: Any) -> tuple[str, str]:
    """(replica id, manager server address) that torchft published in a replica group's
    ``store`` (a client of the store torchft's Manager was given)."""
    _require(MEMBERSHIP,
             "cannot prove this replica's membership with the installed torchft.")
    import torchft.manager as tm

    return (store.get(tm.REPLICA_ID_KEY).decode("utf-8"),
            store.get(tm.MANAGER_ADDR_KEY).decode("utf-8"))


class _VerifyingClient:
    """A manager's client whose quorums are checked by ``check`` before they are returned,
    and whose commit votes are taken by ``vote`` (not by the manager server)."""

    def __init__(self, client: Any, check: Any, vote: Any) -> None:
        self._inner = client
        self._check = check
        self._vote = vote

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        result = self._inner._quorum(*args, **kwargs)
        self._check(result)
        return result

    def should_commit(self, group_rank: int, step: int, should_commit: bool,
                      timeout: timedelta) -> bool:
        return bool(self._vote(bool(should_commit), timeout))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def verify_quorums(manager: Any, key: Any, vote: Any) -> None:
    """From now on every quorum ``manager`` is given is checked with ``key``
    (:meth:`~stratagem.ft.membership.MemberKey.check_quorum`) before the manager uses any
    address in it (its process group's store, the peer it heals from): a quorum with an
    unverified member raises :class:`~stratagem.ft.membership.UnverifiedMemberError`
    naming it, in the quorum call. ``Manager.should_commit`` keeps all it does (recovery,
    the group's errors, the step's bookkeeping) but its vote across the replica group's
    processes is ``vote(local_ok, timeout) -> bool``, taken over the group's own process
    group: torchft's manager server counts votes from any process that connects."""
    _require(MEMBERSHIP,
             "cannot check the quorums this replica is given with the installed torchft (a "
             "member without the job's secret would go unnoticed).")

    def check(result: Any) -> None:
        key.check_quorum(replica_ids=list(result.replica_ids),
                         handles=list(result.reconfigure_handles),
                         store_address=result.store_address or "",
                         recover_src=result.recover_src_manager_address or "")

    client = manager._client
    if not isinstance(client, _VerifyingClient):
        manager._client = _VerifyingClient(client, check, vote)
