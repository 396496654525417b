"""The package's import structure, read from the source with ``ast`` (nothing is imported).

(a) No import cycle among ``src/stratagem`` modules, counting module-level *and*
    function-level imports (an import inside a function is still a dependency: it only
    hides the cycle until the function runs). Imports under ``if TYPE_CHECKING:`` are not
    counted: they never run, and exist only for annotations.
(b) No module uses another stratagem module's ``_private`` name: neither ``from .x import
    _y`` nor ``x._y`` where ``x`` was imported from stratagem (a module, a class, a
    function). Private *modules* (``_rendezvous``) are package-internal and may be imported.

Files owned by other branches (``strategies/``, ``ps/``, ``comm.py``) still break (b) in
known places: they are listed in :data:`KNOWN_PRIVATE_USES`, one entry each with why, and
the list must only shrink. A listed use that disappears fails the test too (remove its
entry), so the list never goes stale.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "stratagem"

#: Where known violations of (b) may live while their owners fix them.
KNOWN_VIOLATION_PLACES = ("stratagem.strategies", "stratagem.ps", "stratagem.comm")

#: (module, what it uses) -> why it is still there. Only shrinks: the lead empties it as
#: strategies/ and ps/ move onto the sync parts and the public state protocol.
KNOWN_PRIVATE_USES: dict[tuple[str, str], str] = {
}


@dataclass(frozen=True)
class Use:
    module: str  # the module doing the import / attribute access
    target: str  # the stratagem module it imports
    line: int
    private: str | None = None  # the _private name used, if any


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (``__init__`` as the package name)."""
    found: dict[str, Path] = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except those under ``if TYPE_CHECKING:`` (its ``else`` branch runs)."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _base(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if node.level == 0:
        return node.module or ""
    is_package = MODULES[module].name == "__init__.py"
    parts = module.split(".")
    keep = len(parts) - node.level + (1 if is_package else 0)
    base = ".".join(parts[:keep])
    return f"{base}.{node.module}" if node.module else base


def _ours(name: str) -> bool:
    return name == PACKAGE or name.startswith(PACKAGE + ".")


def _owner(name: str) -> str:
    """The module that defines ``name`` (the longest known module prefix)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _analyse(module: str) -> tuple[list[Use], list[Use]]:
    """(imports of stratagem modules, uses of their private names) in ``module``."""
    tree = ast.parse(MODULES[module].read_text(), filename=str(MODULES[module]))
    imports: list[Use] = []
    private: list[Use] = []
    bound: dict[str, str] = {}  # local name -> the stratagem module it came from
    nodes = list(_runtime_nodes(tree))
    for node in nodes:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not _ours(alias.name):
                    continue
                target = _owner(alias.name)
                imports.append(Use(module, target, node.lineno))
                # "import stratagem.x" binds "stratagem"; "import stratagem.x as y" binds y.
                local = alias.asname or alias.name.split(".")[0]
                bound[local] = target if alias.asname else PACKAGE
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            if not _ours(base):
                continue
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in MODULES:  # a submodule
                    imports.append(Use(module, full, node.lineno))
                    bound[alias.asname or alias.name] = full
                    continue
                target = _owner(base)
                imports.append(Use(module, target, node.lineno))
                bound[alias.asname or alias.name] = target
                if alias.name.startswith("_") and target != module:
                    private.append(Use(module, target, node.lineno, alias.name))
    for node in nodes:
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and node.attr.startswith("_")
                and not (node.attr.startswith("__") and node.attr.endswith("__"))):
            target = bound[node.value.id]
            if f"{target}.{node.attr}" in MODULES or target == module:
                continue
            private.append(Use(module, target, node.lineno, f"{node.value.id}.{node.attr}"))
    return imports, private


ANALYSIS = {m: _analyse(m) for m in MODULES}


def _graph() -> dict[str, set[str]]:
    return {m: {u.target for u in imports if u.target != m}
            for m, (imports, _) in ANALYSIS.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as one
    cycle through it for the message."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _where(use: Use) -> str:
    return f"{MODULES[use.module].relative_to(SRC.parent)}:{use.line}"


def test_the_analysis_sees_the_package():
    # Guards against a vacuous pass: the walker must find the modules and their imports.
    assert {"stratagem", "stratagem.strategy", "stratagem.context", "stratagem.registry"} <= \
        set(MODULES)
    graph = _graph()
    assert "stratagem.registry" in graph["stratagem"]  # stratagem itself loads torch lazily
    assert "stratagem.comm" in graph["stratagem.strategy"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    graph = _graph()
    cycles = _cycles(graph)
    lines: list[str] = []
    for component in cycles:
        members = set(component)
        for m in component:
            for use in ANALYSIS[m][0]:
                line = f"  {_where(use)}: {m} imports {use.target}"
                if use.target in members and use.target != m and line not in lines:
                    lines.append(line)
    assert not cycles, "import cycles among " + "; ".join(
        " <-> ".join(c) for c in cycles) + ":\n" + "\n".join(lines)


def test_context_is_a_leaf():
    """``context`` holds the scope stack every module reads; it must not depend on them
    (the default strategy is supplied to it by the registry)."""
    imports, _ = ANALYSIS["stratagem.context"]
    assert {u.target for u in imports} <= {"stratagem.errors"}, imports


def test_strategy_does_not_import_its_features():
    """``checkpoint``, ``fit`` and ``preemption`` are built on ``Strategy``'s public
    protocol; ``Strategy.save/restore/fit/on_preemption`` reach them through the feature
    registration, never by import."""
    targets = {u.target for u in ANALYSIS["stratagem.strategy"][0]}
    features = {t for t in targets if t.split(".")[:2] in (
        ["stratagem", "checkpoint"], ["stratagem", "fit"], ["stratagem", "preemption"])}
    assert not features, f"stratagem.strategy imports {sorted(features)}"


def _private_uses() -> dict[tuple[str, str], Use]:
    return {(u.module, u.private): u for _, uses in ANALYSIS.values() for u in uses
            if u.private is not None}


def test_no_private_names_across_modules():
    uses = _private_uses()
    unexpected = {k: u for k, u in uses.items() if k not in KNOWN_PRIVATE_USES}
    stale = sorted(k for k in KNOWN_PRIVATE_USES if k not in uses)
    report = [f"  {_where(u)}: {u.module} uses {u.private} (from {u.target})"
              for _, u in sorted(unexpected.items())]
    assert not unexpected and not stale, (
        (f"{len(unexpected)} use(s) of another module's private name (make the name public, "
         "or use the public API):\n" + "\n".join(report) + "\n" if unexpected else "")
        + (f"KNOWN_PRIVATE_USES entries no longer found (remove them): {stale}" if stale else ""))


def test_known_private_uses_are_only_in_other_branches_files():
    for module, name in KNOWN_PRIVATE_USES:
        assert module.startswith(KNOWN_VIOLATION_PLACES), (module, name)


@pytest.mark.parametrize("source,expected", [
    ("from .context import _enter_scope\n", ["_enter_scope"]),
    ("from . import comm\nx = comm._private\n", ["comm._private"]),
    ("import stratagem as sg\nsg._LAZY\n", ["sg._LAZY"]),
    ("from .strategy import Strategy\nStrategy._step\n", ["Strategy._step"]),
    ("from . import _rendezvous\nfrom .comm import Comm\nComm.__name__\n", []),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .x import _y\n", []),
])
def test_private_use_detection(monkeypatch, tmp_path, source, expected):
    fake = tmp_path / "stratagem" / "fake.py"
    fake.parent.mkdir()
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "stratagem.fake", fake)
    _, private = _analyse("stratagem.fake")
    assert [u.private for u in private] == expected


def _private_members_of_strategy() -> set[str]:
    """The ``_private`` methods and attributes of ``Strategy``, ``StrategyOptimizer``,
    ``Prepared`` and ``StepControl`` (read from strategy.py, prepared.py and step.py: defs and
    ``self._x = ...`` assignments)."""
    names: set[str] = set()
    classes = [cls for module in ("stratagem.strategy", "stratagem.prepared", "stratagem.step")
               for cls in ast.parse(MODULES[module].read_text()).body]
    for cls in classes:
        if not (isinstance(cls, ast.ClassDef)
                and cls.name in ("Strategy", "StrategyOptimizer", "Prepared", "StepControl")):
            continue
        for node in ast.walk(cls):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self" and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def test_features_use_only_the_public_state_protocol():
    """checkpoint, fit and preemption reach a strategy (or its optimizer) only through public
    members: no ``strategy._steps``, ``optimizer._strategy``, ``strategy._find_prepared``."""
    private = _private_members_of_strategy()
    assert {"_step", "_find_prepared", "_strategy", "_unscale"} <= private
    found = []
    for module, path in MODULES.items():
        if not module.startswith(("stratagem.checkpoint", "stratagem.fit",
                                  "stratagem.preemption")):
            continue
        for node in _runtime_nodes(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                    isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"{path.relative_to(SRC.parent)}:{node.lineno}: .{node.attr}")
    assert not found, "private Strategy members used outside it:\n" + "\n".join(found)


# ---------------------------------------------------------------------- one shape
#: What a strategy class body may hold: its name, the argument prefixes it routes to other
#: strategies (``Hierarchical``), its constructor, its parts declaration, a repr.
_STRATEGY_ASSIGNMENTS = {"name", "_argument_prefixes"}
_STRATEGY_DECLARATIONS = {"__init__", "__repr__", "plan", "layer_plan"}
#: The boolean class flags strategies used to steer the base with, and the capability names:
#: a strategy gets these from its parts, never sets them.
_CAPABILITY_FLAGS = {"_synchronous_step", "_fault_tolerance", "_keeps_global_batch",
                     "_local_optimizer_state", "_replica_groups", "_hierarchy_roles",
                     "_replicates_model", "_materializes_meta", "synchronous_step",
                     "optimizer_state_is_local", "fault_tolerant_capable",
                     "synchronous", "local_optimizer_state", "transactions",
                     "keeps_global_batch", "shards_model", "materializes_meta", "starts_alone",
                     "replica_groups", "roles"}


def _base_public_methods() -> set[str]:
    tree = ast.parse(MODULES["stratagem.strategy"].read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    return {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def strategy_file_violations(source: str, where: str = "<source>") -> list[str]:
    """What a strategy file holds beyond its arguments and its parts declaration: a private
    method (a hook override), an override of the base's methods other than the declaration,
    a class-level assignment other than ``name``, or a capability flag set anywhere."""
    base = _base_public_methods()
    found = []
    for cls in ast.parse(source).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in cls.bases}
        if not bases & {"Strategy"} and not any(b.endswith("Strategy") for b in bases):
            continue
        for node in cls.body:
            line = f"{where}:{node.lineno}: {cls.name}"
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.name in _STRATEGY_DECLARATIONS:
                    continue
                if node.name.startswith("_"):
                    found.append(f"{line}.{node.name}: overrides a private method")
                elif node.name in base:
                    found.append(f"{line}.{node.name}: overrides the base's {node.name}")
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    if not (isinstance(t, ast.Name) and t.id in _STRATEGY_ASSIGNMENTS):
                        found.append(f"{line}: class-level assignment {ast.unparse(t)}")
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and node.attr in _CAPABILITY_FLAGS:
                found.append(f"{where}:{node.lineno}: {cls.name} sets capability flag "
                             f"{node.attr}")
    return found


def test_strategy_files_hold_arguments_and_parts_only():
    found = []
    for module, path in MODULES.items():
        if module.startswith("stratagem.strategies."):
            found += strategy_file_violations(path.read_text(), str(path.relative_to(SRC)))
    assert not found, "\n".join(found)


@pytest.mark.parametrize("body, expected", [
    ("    def _setup(self, prepared): pass", "overrides a private method"),
    ("    def eval_model(self, model): return model", "overrides the base's eval_model"),
    ("    _synchronous_step = True", "class-level assignment _synchronous_step"),
    ("    def __init__(self):\n        self._fault_tolerance = True", "capability flag"),
    ("    def plan(self):\n        return Plan()", None),
])
def test_the_strategy_file_check_catches_each_violation(body, expected):
    source = f"class Bad(Strategy):\n    name = 'bad'\n{body}\n"
    found = strategy_file_violations(source)
    if expected is None:
        assert found == []
    else:
        assert len(found) == 1 and expected in found[0], found


def test_the_strategy_base_is_small():
    """strategy.py, and its Strategy class, at most 500 lines: step control, replica
    operations, inputs, the parts' hook order and fault tolerance are objects of their own."""
    text = MODULES["stratagem.strategy"].read_text()
    assert len(text.splitlines()) <= 500
    cls = next(n for n in ast.parse(text).body
               if isinstance(n, ast.ClassDef) and n.name == "Strategy")
    assert cls.end_lineno is not None and cls.end_lineno - cls.lineno + 1 <= 500
    assert "fault_tolerant" not in "".join(
        line for line in text.splitlines() if line.lstrip().startswith(("if ", "elif ")))


def test_the_tier_lists_name_existing_test_files():
    """tests/conftest.py lists the integration and chaos files by name: a renamed or deleted
    file must leave the lists, or its tests would silently fall into the unit tier (where a
    launched process then fails them)."""
    import importlib.util

    here = Path(__file__).resolve().parent
    # By path: "import conftest" may find tests/ps's or tests/gpu's under xdist.
    spec = importlib.util.spec_from_file_location("_tiers_conftest", here / "conftest.py")
    assert spec is not None and spec.loader is not None
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    existing = {p.name for p in here.rglob("test_*.py")}
    listed = conftest._CHAOS_FILES | conftest._INTEGRATION_FILES
    assert listed <= existing, sorted(listed - existing)
    assert not conftest._CHAOS_FILES & conftest._INTEGRATION_FILES


# ------------------------------------------------------------------ the benchmark ledger

_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
#: A suffix that names a run rather than what was measured: _s8c, _rerun, _loaded, _h100host,
#: _full, _spare2, _t15, _v2, a date. Superseded runs live in git history, not in results/.
_RUN_TAG = re.compile(r"_(s\d+[a-z]?|rerun\d*|run\d+|loaded|quiet|[a-z0-9]*host|full|spare\d+|"
                      r"t\d+|v\d+|old|new|tmp|\d{6,8}|\d{4}-\d\d-\d\d)(?=_|$)")


def _benchmark_scripts() -> list[Path]:
    return sorted(p for p in _BENCHMARKS.glob("*.py") if not p.name.startswith("_"))


def test_every_benchmark_takes_smoke():
    """``--smoke`` comes from ``_common.add_ledger_args`` (directly or through
    ``matrix_parser``), so every script has it with the same meaning; tests/test_bench_smoke.py
    runs each."""
    scripts = _benchmark_scripts()
    assert scripts
    missing = [p.name for p in scripts
               if "add_ledger_args(" not in p.read_text() and "matrix_parser(" not in p.read_text()]
    assert not missing, f"benchmarks without --smoke (add_ledger_args): {missing}"


@pytest.mark.parametrize("name, tagged", [
    ("ft_grid_s8c", True), ("convergence_ps_100mbit_rerun", True), ("ft_grid_s6_t15", True),
    ("diloco_compression_p16_h100host", True), ("ft_kills_gpt_spare2", True),
    ("convergence_ps_s7_loaded", True), ("ft_grid", False), ("diloco_compression_p16", False),
    ("ft_kills_gpt", False), ("ft_kills_hierarchical", False), ("sharded_memory", False)])
def test_the_run_tag_pattern(name, tagged):
    assert bool(_RUN_TAG.search(name)) is tagged


def test_results_are_one_ledger_entry_per_name():
    """``benchmarks/results/`` holds NAME.md + NAME.json (+ an optional NAME.png) per result,
    no file named after a run, and every JSON in the ledger shape with its commit."""
    import json

    results = _BENCHMARKS / "results"
    files = sorted(p for p in results.iterdir() if p.is_file())
    tagged = [p.name for p in files if _RUN_TAG.search(p.stem)]
    assert not tagged, f"result files named after a run (keep one per name; git has the rest): " \
                       f"{tagged}"
    stems = {p.stem for p in files}
    for stem in stems:
        assert (results / f"{stem}.json").is_file() and (results / f"{stem}.md").is_file(), stem
    odd = [p.name for p in files if p.suffix not in (".json", ".md", ".png")]
    assert not odd, odd
    for path in (results / f"{stem}.json" for stem in sorted(stems)):
        data = json.loads(path.read_text())
        assert isinstance(data, dict) and "commit" in data, f"{path.name} records no commit"
        assert data["name"] == path.stem, path.name
        assert data["commit"] is not None or data.get("commit_note"), path.name
        for key in ("date", "command", "versions", "host", "duration_s", "results"):
            assert key in data, f"{path.name} has no {key!r}"
        assert set(data["versions"]) >= {"python", "torch", "torchft", "grpcio"}, path.name
        assert set(data["host"]) >= {"cores", "cpu", "gpu"}, path.name
