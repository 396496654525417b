"""The torchft boundary: every use of torchft beyond its public API sits in
``stratagem.ft.upstream`` (``docs/design/torchft-boundary.md``).

- the installed torchft has every private symbol of ``upstream.RELIANCES``;
- each reliance, broken on its own (an attribute deleted, or a method replaced by a copy whose
  bytecode names or constants differ), is reported by ``check_contract()`` under its exact
  symbol, and nothing else is;
- at run time a broken reliance fails loudly (the manager server, the gloo store) or falls
  back with a warning naming the symbol (quorum elision, the quorum-id cache);
- no module of stratagem other than ``ft/upstream.py`` reaches into torchft (private modules
  or attributes, bytecode, module-attribute patching).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import json
import re
import threading
import types
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

from stratagem.ft import upstream  # noqa: E402
from stratagem.ft.upstream import (  # noqa: E402
    RELIANCES,
    Reliance,
    TorchftContractError,
    TorchftContractWarning,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "stratagem"
BOUNDARY = SRC / "ft" / "upstream.py"


@pytest.fixture(autouse=True)
def _fresh_runtime_checks(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The run-time checks are cached per process: recompute them around each test (a test
    breaks torchft on purpose) and let every warning be raised again."""
    monkeypatch.setattr(upstream, "_warned", set())
    upstream.should_commit_is_elidable.cache_clear()
    upstream._quorum_id_readable.cache_clear()
    yield
    upstream.should_commit_is_elidable.cache_clear()
    upstream._quorum_id_readable.cache_clear()


def _symbols(problems: list[str]) -> list[str]:
    """The symbol each problem names (``"<symbol>: <what changed> [...]"``)."""
    return [p.split(": ", 1)[0] for p in problems]


# ---------------------------------------------------------------------- breaking one reliance
def _renamed(value: Any, old: str, new: str) -> Any:
    if value == old:
        return new
    if isinstance(value, tuple):
        return tuple(_renamed(v, old, new) for v in value)
    return value


def _replace_code(monkeypatch: pytest.MonkeyPatch, reliance: Reliance, *,
                  names: bool = False, consts: bool = False) -> None:
    """Replace the function ``reliance`` inspects with a copy whose bytecode names
    (``names``) or constants (``consts``) call ``reliance.expects[0]`` something else."""
    owner_path, _, attr = reliance.obj.rpartition(".")
    owner = upstream._resolve(reliance.module, owner_path)
    fn = inspect.unwrap(getattr(owner, attr))
    old = reliance.expects[0]
    new = f"{old}__renamed_upstream"
    code = fn.__code__
    if names:
        assert old in code.co_names
        code = code.replace(co_names=tuple(_renamed(n, old, new) for n in code.co_names))
    if consts:
        code = code.replace(co_consts=tuple(_renamed(c, old, new) for c in code.co_consts))
        assert code.co_consts != fn.__code__.co_consts
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    monkeypatch.setattr(owner, attr, copy)


def _break(monkeypatch: pytest.MonkeyPatch, reliance: Reliance) -> None:
    if reliance.kind == "attribute":
        target = upstream._resolve(reliance.module, reliance.obj)
        monkeypatch.delattr(target, reliance.expects[0])
    elif reliance.kind == "names":
        _replace_code(monkeypatch, reliance, names=True)
    elif reliance.kind in ("keywords", "constants"):
        _replace_code(monkeypatch, reliance, consts=True)
    else:  # pragma: no cover - a new kind needs a way to break it here
        raise AssertionError(f"no way to break a reliance of kind {reliance.kind!r}")


# ---------------------------------------------------------------------- (a) the contract holds
def test_contract_holds_for_the_installed_torchft() -> None:
    assert upstream.check_contract() == []
    assert upstream.should_commit_is_elidable()


def test_the_table_is_well_formed() -> None:
    symbols = [r.symbol for r in RELIANCES]
    assert len(set(symbols)) == len(symbols), "each reliance names its own symbol"
    features = {upstream.MANAGER_SERVER, upstream.ELISION, upstream.QUORUM_ID,
                upstream.GLOO_STORE, upstream.MEMBERSHIP, upstream.NCCL_GROUP}
    for r in RELIANCES:
        assert r.symbol.startswith("torchft.") and ": " not in r.symbol
        assert r.kind in ("attribute", "names", "keywords", "constants")
        assert r.expects and r.why and r.hook
        assert r.feature in features
    # What upstream.py writes and reads on torchft's objects is all in the table.
    names = {n for r in RELIANCES for n in r.expects}
    for private in ("_step", "_batches_committed", "_commit_failures",
                    "_checkpoint_transport", "_quorum_id", "_rendezvous_store", "ManagerServer",
                    "_create_pg"):
        assert private in names


def test_the_design_record_lists_every_reliance() -> None:
    doc = (SRC.parents[1] / "docs" / "design" / "torchft-boundary.md").read_text()
    for r in RELIANCES:
        assert f"`{r.symbol}`" in doc, r.symbol


# ---------------------------------------------------------------------- (b) each symbol, broken
@pytest.mark.parametrize("reliance", RELIANCES, ids=lambda r: r.symbol)
def test_a_broken_reliance_is_reported_by_its_symbol(monkeypatch: pytest.MonkeyPatch,
                                                     reliance: Reliance) -> None:
    _break(monkeypatch, reliance)
    problems = upstream.check_contract()
    assert _symbols(problems) == [reliance.symbol], problems
    assert upstream.problems_for(reliance.feature) == problems
    others = {r.feature for r in RELIANCES} - {reliance.feature}
    assert all(upstream.problems_for(f) == [] for f in others)
    monkeypatch.undo()
    assert upstream.check_contract() == []


@pytest.mark.parametrize("reliance", [r for r in RELIANCES if r.feature == upstream.ELISION],
                         ids=lambda r: r.symbol)
def test_elision_falls_back_with_a_warning_naming_the_symbol(
        monkeypatch: pytest.MonkeyPatch, reliance: Reliance) -> None:
    _break(monkeypatch, reliance)
    with pytest.warns(TorchftContractWarning, match=re.escape(reliance.symbol)):
        assert upstream.should_commit_is_elidable() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert upstream.should_commit_is_elidable() is False
    manager = _FakeManager()
    with pytest.raises(TorchftContractError, match=re.escape(reliance.symbol)):
        upstream.commit_bookkeeping(manager, committed=True, participants=2)
    assert manager._step == 5  # nothing written


@pytest.mark.parametrize("reliance",
                         [r for r in RELIANCES if r.feature == upstream.MANAGER_SERVER],
                         ids=lambda r: r.symbol)
def test_manager_server_fails_loudly_naming_the_symbol(monkeypatch: pytest.MonkeyPatch,
                                                       reliance: Reliance) -> None:
    _break(monkeypatch, reliance)
    with pytest.raises(TorchftContractError, match=re.escape(reliance.symbol)), \
            upstream.manager_server_on("127.0.0.1", "slot0:abc"):
        pass
    with pytest.raises(TorchftContractError, match=re.escape(reliance.symbol)):
        upstream.build_manager(server_host="127.0.0.1")


@pytest.mark.parametrize("reliance", [r for r in RELIANCES if r.feature == upstream.GLOO_STORE],
                         ids=lambda r: r.symbol)
def test_gloo_group_fails_loudly_naming_the_symbol(monkeypatch: pytest.MonkeyPatch,
                                                   reliance: Reliance) -> None:
    _break(monkeypatch, reliance)
    with pytest.raises(TorchftContractError, match=re.escape(reliance.symbol)):
        upstream.bound_gloo_group(timedelta(seconds=5))


@pytest.mark.parametrize("reliance", [r for r in RELIANCES if r.feature == upstream.MEMBERSHIP],
                         ids=lambda r: r.symbol)
def test_membership_fails_loudly_naming_the_symbol(monkeypatch: pytest.MonkeyPatch,
                                                   reliance: Reliance) -> None:
    """Without what the quorum check relies on, a replica refuses to start (a member without
    the secret would go unnoticed), naming the symbol."""
    _break(monkeypatch, reliance)
    with pytest.raises(TorchftContractError, match=re.escape(reliance.symbol)):
        upstream.verify_quorums(_FakeManager(), None, None)
    with pytest.raises(TorchftContractError, match=re.escape(reliance.symbol)):
        upstream.manager_identity(None)


def test_quorum_id_falls_back_with_a_warning_naming_the_symbol(
        monkeypatch: pytest.MonkeyPatch) -> None:
    manager = _FakeManager()
    assert upstream.quorum_id(manager) == 3
    (reliance,) = [r for r in RELIANCES if r.feature == upstream.QUORUM_ID]
    _break(monkeypatch, reliance)
    upstream._quorum_id_readable.cache_clear()
    with pytest.warns(TorchftContractWarning, match=r"torchft\.manager\.Manager\._quorum_id"):
        assert upstream.quorum_id(manager) is None


def test_a_manager_without_its_quorum_id_caches_nothing() -> None:
    manager = _FakeManager()
    del manager._quorum_id
    with pytest.warns(TorchftContractWarning, match=r"torchft\.manager\.Manager\._quorum_id"):
        assert upstream.quorum_id(manager) is None


# ---------------------------------------------------------------------- the functions
class _Transport:
    def __init__(self) -> None:
        self.disallowed = 0

    def disallow_checkpoint(self) -> None:
        self.disallowed += 1


class _FakeManager:
    """The private state of a torchft Manager that upstream.py touches."""

    def __init__(self) -> None:
        self._step = 5
        self._batches_committed = 10
        self._commit_failures = 2
        self._checkpoint_transport = _Transport()
        self._quorum_id = 3


def test_commit_bookkeeping_does_what_should_commit_does() -> None:
    manager = _FakeManager()
    upstream.commit_bookkeeping(manager, committed=False, participants=2)
    assert (manager._step, manager._batches_committed, manager._commit_failures) == (5, 10, 3)
    upstream.commit_bookkeeping(manager, committed=True, participants=2)
    assert (manager._step, manager._batches_committed, manager._commit_failures) == (6, 12, 0)
    assert manager._checkpoint_transport.disallowed == 2


def test_manager_server_is_rebound_and_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    import torchft.manager as tm

    seen: list[dict[str, Any]] = []

    def server(**kwargs: Any) -> str:
        seen.append(kwargs)
        return "server"

    monkeypatch.setattr(tm, "ManagerServer", server)
    with upstream.manager_server_on("::1", "slot0:abc") as install:
        assert tm.ManagerServer(replica_id="slot0:new", bind="[::]:0", hostname="h") == "server"
    assert install.built == 1
    assert tm.ManagerServer is server
    assert seen == [{"replica_id": "slot0:abc", "bind": "[::1]:0", "hostname": "h"}]
    with upstream.manager_server_on("127.0.0.1"):
        tm.ManagerServer(replica_id="slot1:new", bind="[::]:0")
    assert seen[-1] == {"replica_id": "slot1:new", "bind": "127.0.0.1:0"}


def test_a_manager_built_around_the_rebinding_is_shut_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchft whose Manager builds its server some other way (bound to every interface)
    passes no silent manager back."""
    import torchft

    shut: list[bool] = []

    class Manager:
        def __init__(self, **kwargs: Any) -> None:
            self.kwargs = kwargs

        def shutdown(self, wait: bool = True) -> None:
            shut.append(wait)

    monkeypatch.setattr(torchft, "Manager", Manager)
    with pytest.raises(TorchftContractError, match=r"torchft\.manager\.ManagerServer"):
        upstream.build_manager(server_host="127.0.0.1", server_replica_id="x", rank=0)
    assert shut == [False]
    # Without a server to build (a replica group's other processes), nothing is patched.
    assert upstream.build_manager(server_host=None, rank=1).kwargs == {"rank": 1}


def test_gloo_group_store_is_bound_and_advertised() -> None:
    pg = upstream.bound_gloo_group(timedelta(seconds=5), "127.0.0.1")
    try:
        handle = json.loads(pg.get_reconfigure_handle())
        assert handle["store"] == f"127.0.0.1:{pg._rendezvous_store.port}"
    finally:
        pg.shutdown()


def test_gloo_group_refuses_a_handle_that_is_not_its_store(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from torchft.process_group import ProcessGroup

    pg = upstream.bound_gloo_group(timedelta(seconds=5), "127.0.0.1")
    # A torchft that builds its own store whatever the group holds (checked at run time too).
    monkeypatch.setattr(ProcessGroup, "get_reconfigure_handle",
                        lambda self: json.dumps({"id": "x", "store": "elsewhere:1"}))
    try:
        with pytest.raises(TorchftContractError,
                           match=r"torchft\.process_group\.ProcessGroup\._rendezvous_store"):
            pg.get_reconfigure_handle()
    finally:
        pg.shutdown()


def _stand_in_nccl(built: list[tuple[int, int, str]]) -> Any:
    """What ``upstream.nccl_backend`` returns on CUDA, played by gloo on this CPU machine:
    records (rank, world size, device) of each backend built."""
    import torch.distributed as dist

    lock = threading.Lock()

    def build(store: Any, rank: int, world_size: int, device: Any, timeout: timedelta) -> Any:
        with lock:
            built.append((rank, world_size, str(device)))
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)

    return build


def test_on_cuda_each_quorum_gives_the_group_an_nccl_backend_beside_gloo(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two members reconfigured twice (two quorums): each quorum builds one NCCL backend per
    member (here gloo stands in), registered for CUDA tensors; CPU tensors stay on gloo; an
    abort drops it, and the next quorum builds a new one."""
    import torch
    from torch.distributed import TCPStore
    from torchft.process_group import reconfigure_with_store

    built: list[tuple[int, int, str]] = []
    monkeypatch.setattr(upstream, "nccl_backend", _stand_in_nccl(built))
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=30))
    groups = [upstream.bound_gloo_group(timedelta(seconds=10), "127.0.0.1",
                                        device=torch.device("cuda", 0)) for _ in range(2)]
    seen: list[Any] = [None, None]
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            pg = groups[rank]
            for quorum in (1, 2):
                reconfigure_with_store(pg, f"127.0.0.1:{store.port}/q/{quorum}", rank, 2,
                                       timedelta(seconds=30))
                cuda, cpu = pg.device_backend("cuda"), pg.device_backend("cpu")
                t = torch.full((3,), float(rank + 1))
                pg.allreduce([t], dist_opts()).wait()
                seen[rank] = (cuda is pg.nccl, cpu is not pg.nccl, t.tolist(), pg.nccl_built)
                if quorum == 1:
                    pg.abort(errored=False)
                    assert pg.nccl is None and pg.device_backend("cuda") is None
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=member, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert not errors, errors
        assert seen == [(True, True, [3.0, 3.0, 3.0], 2)] * 2
        assert sorted(built) == [(0, 2, "cuda:0"), (0, 2, "cuda:0"), (1, 2, "cuda:0"),
                                 (1, 2, "cuda:0")]
        assert all(pg.errored() is None for pg in groups)  # gloo plays NCCL: no get_error
    finally:
        for pg in groups:
            pg.abort(errored=False)
            pg.shutdown()


def dist_opts() -> Any:
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    return opts


def test_on_cpu_or_without_the_reliance_the_group_builds_no_nccl_backend(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    assert upstream._nccl_usable(torch.device("cpu")) is None
    assert upstream._nccl_usable(None) is None
    assert upstream._nccl_usable(torch.device("cuda", 0)) == torch.device("cuda", 0)
    (reliance,) = [r for r in RELIANCES if r.feature == upstream.NCCL_GROUP]
    _break(monkeypatch, reliance)
    with pytest.warns(TorchftContractWarning,
                      match=r"gloo through host memory.*"
                            r"torchft\.process_group\.ProcessGroupWrapper\._create_pg"):
        assert upstream._nccl_usable(torch.device("cuda", 0)) is None


def test_nccl_env_defaults_keep_what_the_user_set(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in upstream.NCCL_ENV_DEFAULTS:  # restored at teardown: absent before
        monkeypatch.setenv(name, "x")
        monkeypatch.delenv(name)
    monkeypatch.setenv("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    upstream.nccl_env_defaults(error_handling=False)  # a replica group's own NCCL group
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in os.environ
    upstream.nccl_env_defaults()
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert os.environ["TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC"] == "100"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"  # the user's


# ---------------------------------------------------------------------- (c) the boundary
_PRIVATE_OF_TORCHFT = {n for r in RELIANCES for n in r.expects if n.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _torchft_private_names(module: str, name: str) -> set[str]:
    """The private attribute names torchft's class ``module.name`` (and its torchft bases)
    defines or uses on ``self``."""
    try:
        cls = getattr(importlib.import_module(module), name)
    except Exception:  # noqa: BLE001 - not a class of torchft: nothing to inherit
        return set()
    names: set[str] = set()
    for base in getattr(cls, "__mro__", ()):
        if not str(getattr(base, "__module__", "")).startswith("torchft"):
            continue
        for key, value in vars(base).items():
            if _private(key) and key != "_abc_impl":
                names.add(key)
            code = getattr(inspect.unwrap(value), "__code__", None) if callable(value) else None
            if code is not None:
                names.update(n for n in code.co_names if _private(n))
    return names


def boundary_violations(source: str, where: str) -> list[str]:
    """What ``source`` does with torchft beyond its public API (see the module docstring)."""
    tree = ast.parse(source)
    found: list[str] = []
    modules: set[str] = set()  # local names bound to torchft modules
    classes: dict[str, tuple[str, str]] = {}  # local names of torchft classes
    imports_torchft = False

    def say(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{getattr(node, 'lineno', 0)}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "torchft":
                    continue
                imports_torchft = True
                if any(_private(p) for p in alias.name.split(".")):
                    say(node, f"imports torchft's private module {alias.name}")
                modules.add(alias.asname or "torchft")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "torchft":
            imports_torchft = True
            if any(_private(p) for p in node.module.split(".")):
                say(node, f"imports from torchft's private module {node.module}")
            for alias in node.names:
                if _private(alias.name):
                    say(node, f"imports torchft's private {node.module}.{alias.name}")
                local = alias.asname or alias.name
                if _is_module(f"{node.module}.{alias.name}"):
                    modules.add(local)
                else:
                    classes[local] = (node.module, alias.name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if node.attr in ("co_names", "__code__", "co_consts", "co_code"):
                say(node, f"reads bytecode ({node.attr})")
            if isinstance(node.value, ast.Name) and node.value.id in modules:
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    say(node, f"patches torchft module attribute {node.value.id}.{node.attr}")
                if _private(node.attr):
                    say(node, f"uses torchft's private {node.value.id}.{node.attr}")
            if _private(node.attr):
                base = ast.unparse(node.value)
                if base.split(".")[-1] in ("manager", "_manager"):
                    say(node, f"uses a torchft manager's private {base}.{node.attr}")
                elif imports_torchft and node.attr in _PRIVATE_OF_TORCHFT:
                    say(node, f"uses torchft's private attribute {base}.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("setattr", "delattr", "getattr", "hasattr") and node.args:
            target = node.args[0]
            name = node.args[1] if len(node.args) > 1 else None
            literal = name.value if isinstance(name, ast.Constant) else None
            if node.func.id in ("setattr", "delattr") and isinstance(target, ast.Name) and \
                    target.id in modules:
                say(node, f"patches torchft module {target.id} ({node.func.id})")
            if isinstance(literal, str) and _private(literal) and (
                    ast.unparse(target).split(".")[-1] in ("manager", "_manager")
                    or (isinstance(target, ast.Name) and target.id in modules)
                    or (imports_torchft and literal in _PRIVATE_OF_TORCHFT)):
                say(node, f"uses torchft's private {ast.unparse(target)}.{literal} "
                          f"({node.func.id})")
        elif isinstance(node, ast.ClassDef):
            inherited: set[str] = set()
            for base in node.bases:
                if isinstance(base, ast.Subscript):  # a generic: Base[T]
                    base = base.value
                if isinstance(base, ast.Name) and base.id in classes:
                    inherited |= _torchft_private_names(*classes[base.id])
                elif isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) \
                        and base.value.id in modules:
                    inherited |= _torchft_private_names(
                        _module_name(tree, base.value.id), base.attr)
            for inner in ast.walk(node):
                if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and \
                        inner.value.id == "self" and inner.attr in inherited:
                    say(inner, f"uses the private self.{inner.attr} of a torchft base class")
    return found


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _module_name(tree: ast.Module, local: str) -> str:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == local:
                    return alias.name if alias.asname else alias.name.split(".")[0]
    return local


def _sources() -> list[Path]:
    return sorted(p for p in SRC.rglob("*.py") if p.resolve() != BOUNDARY.resolve())


def test_only_upstream_reaches_into_torchft() -> None:
    found = []
    for path in _sources():
        found += boundary_violations(path.read_text(), str(path.relative_to(SRC)))
    assert found == [], "\n".join(found)


@pytest.mark.parametrize("snippet, what", [
    ("import torchft.manager as tm\ntm.ManagerServer = object\n", "patches"),
    ("import torchft.manager as tm\nsetattr(tm, 'ManagerServer', object)\n", "patches"),
    ("def f(self):\n    self.manager._step += 1\n", "private self.manager._step"),
    ("def f(manager):\n    manager._checkpoint_transport.disallow_checkpoint()\n",
     "private manager._checkpoint_transport"),
    ("def f(self):\n    return getattr(self.manager, '_quorum_id', None)\n", "_quorum_id"),
    ("from torchft import Manager\nnames = Manager.should_commit.__code__.co_names\n",
     "bytecode"),
    ("from torchft._torchft import ManagerServer\n", "private module"),
    ("from torchft.manager import _DummyWork\n", "private torchft.manager._DummyWork"),
    ("from torchft import ProcessGroupGloo\nclass G(ProcessGroupGloo):\n"
     "    def h(self):\n        self._rendezvous_store = None\n", "_rendezvous_store"),
])
def test_the_boundary_check_finds_what_it_looks_for(snippet: str, what: str) -> None:
    found = boundary_violations(snippet, "snippet.py")
    assert found and any(what in f for f in found), found


def test_the_boundary_check_sees_upstream_itself() -> None:
    """upstream.py does all of it: the check, run on it, must say so (it is not vacuous)."""
    found = "\n".join(boundary_violations(BOUNDARY.read_text(), "ft/upstream.py"))
    for what in ("patches torchft module attribute tm.ManagerServer", "manager._step",
                 "manager._checkpoint_transport", "self._rendezvous_store"):
        assert what in found, found
