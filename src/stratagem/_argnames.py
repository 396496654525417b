"""A strategy's keyword arguments by name: which ones a class accepts, and a one-line
``TypeError`` for one it does not, with the nearest valid name (``sg.from_name``
runs :func:`check_names`, and so does ``stratagem run`` before starting any worker, through
:mod:`stratagem._argcheck`). Reads signatures only: nothing is built.

:func:`source_arguments` reads the same names from a class's source (``ast``) without
importing its module: ``stratagem run`` checks the names that way before importing torch
(~2 s of a ~2.5 s start-up), so a misspelt ``--strategy-arg`` fails at once; anything it
cannot read plainly (a base class it cannot find, a non-literal default) makes it answer
None and the caller imports the class instead."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["accepted_arguments", "check_names", "Arguments", "class_arguments",
           "source_arguments", "check_argument_names", "one_line", "cli_line"]


def accepted_arguments(cls: type[Any]) -> list[str]:
    """The keyword arguments ``cls(...)`` accepts, its own first: the parameters of each
    ``__init__`` up the class hierarchy while the one below passes ``**kwargs`` on."""
    names: list[str] = []
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        params = list(inspect.signature(init).parameters.values())[1:]  # without self
        for p in params:
            if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in names:
                names.append(p.name)
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names


def _default_of(cls: type[Any], name: str) -> Any:
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is not None and name in inspect.signature(init).parameters:
            return inspect.signature(init).parameters[name].default
    return None


@dataclass(frozen=True)
class Arguments:
    """What :func:`check_argument_names` needs of a strategy class: its name, the keyword
    arguments it accepts (:func:`accepted_arguments`' order), the key prefixes it routes to
    strategies it builds by name, and the literal defaults of those roles."""

    cls_name: str
    names: list[str]
    prefixes: tuple[str, ...] = ()
    role_defaults: dict[str, Any] = field(default_factory=dict)


def class_arguments(cls: type[Any]) -> Arguments:
    """:class:`Arguments` of an imported class (``inspect``)."""
    prefixes: tuple[str, ...] = tuple(getattr(cls, "_argument_prefixes", ()))
    return Arguments(cls.__name__, accepted_arguments(cls), prefixes,
                     {p[:-1]: _default_of(cls, p[:-1]) for p in prefixes})


# ------------------------------------------------------------------ from source, no import
def _module_source(module: str) -> tuple[ast.Module, str] | None:
    """The parsed source of ``module`` and its package, found without executing it (its
    parent packages are imported: ``stratagem`` and ``stratagem.strategies`` are light)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        with open(spec.origin, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=spec.origin)
    except (OSError, SyntaxError, ValueError):
        return None
    package = module if spec.submodule_search_locations is not None else module.rpartition(".")[0]
    return tree, package


def _where(tree: ast.Module, package: str, module: str, name: str) -> tuple[str, str] | None:
    """(module, class name) that ``name`` means at the top level of ``module``."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return module, name
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) != name:
                    continue
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                return source, alias.name
    return None


def _literal(tree: ast.Module, node: ast.expr) -> Any:
    """``node``'s value when it is a literal or the name of a module-level literal."""
    if isinstance(node, ast.Name):
        for stmt in tree.body:
            if isinstance(stmt, ast.Assign):
                targets, value = stmt.targets, stmt.value
            elif isinstance(stmt, ast.AnnAssign) and stmt.value is not None:
                targets, value = [stmt.target], stmt.value
            else:
                continue
            if any(isinstance(t, ast.Name) and t.id == node.id for t in targets):
                return ast.literal_eval(value)
        raise ValueError(node.id)
    return ast.literal_eval(node)


def source_arguments(module: str, cls_name: str) -> Arguments | None:
    """:class:`Arguments` of ``module.cls_name`` read from source, without importing
    ``module`` (nor torch); None when something is not plain enough to read (then import the
    class and use :func:`class_arguments`)."""
    names: list[str] = []
    prefixes: tuple[str, ...] | None = None
    defaults: dict[str, Any] = {}
    where: tuple[str, str] | None = (module, cls_name)
    for _ in range(16):  # class hierarchy depth
        if where is None:
            return None
        found = _module_source(where[0])
        if found is None:
            return None
        tree, package = found
        klass = next((n for n in tree.body
                      if isinstance(n, ast.ClassDef) and n.name == where[1]), None)
        if klass is None:
            return None
        init: ast.FunctionDef | None = None
        for stmt in klass.body:
            if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__":
                init = stmt
            elif (prefixes is None and isinstance(stmt, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "_argument_prefixes"
                          for t in stmt.targets)):
                try:
                    prefixes = tuple(_literal(tree, stmt.value))
                except (ValueError, TypeError, SyntaxError):
                    return None
        if init is not None:
            a = init.args
            positional = [*a.posonlyargs, *a.args][1:]  # without self
            pos_defaults = dict(zip([p.arg for p in positional][len(positional) - len(a.defaults):],
                                    a.defaults, strict=True))
            kw_defaults = {p.arg: d for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
                           if d is not None}
            for p in [*a.args[1:], *a.kwonlyargs]:
                if p.arg not in names:
                    names.append(p.arg)
                    default = pos_defaults.get(p.arg, kw_defaults.get(p.arg))
                    if default is not None:
                        try:
                            defaults.setdefault(p.arg, _literal(tree, default))
                        except (ValueError, TypeError, SyntaxError):
                            pass
            if a.kwarg is None:
                break
        if not klass.bases or (isinstance(klass.bases[0], ast.Name)
                               and klass.bases[0].id == "object"):
            break
        if len(klass.bases) != 1 or not isinstance(klass.bases[0], ast.Name):
            return None
        where = _where(tree, package, where[0], klass.bases[0].id)
    else:
        return None
    prefixes = prefixes or ()
    roles = {p[:-1] for p in prefixes}
    if not roles <= set(defaults):
        return None
    return Arguments(cls_name, names, prefixes, {r: defaults[r] for r in roles})


def one_line(exc: BaseException) -> str:
    """``exc``'s message on one line (``Type: message``; whitespace runs collapsed)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def cli_line(kwargs: Mapping[str, Any], exc: BaseException) -> str:
    """How ``stratagem run`` states a problem with ``--strategy`` / ``--strategy-arg``."""
    where = "--strategy" if not kwargs else "--strategy/--strategy-arg"
    return f"{where}: {one_line(exc)}"


def _unknown(label: str, key: str, valid: list[str]) -> TypeError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else "."
    return TypeError(f"{label} has no argument {key!r}{hint} Valid arguments: "
                     f"{', '.join(valid)}")


def check_names(name: str, cls: type[Any], kwargs: Mapping[str, Any], *,
                resolve: Callable[[str], tuple[str, type[Any]]]) -> None:
    """``TypeError`` (one line) for the first key of ``kwargs`` that ``cls`` does not accept,
    naming it, the nearest valid name and every valid one. A class that routes prefixed keys
    to strategies it builds by name (``Hierarchical``'s ``outer_period=``) declares the
    prefixes in ``_argument_prefixes``; those keys are checked against that strategy, found
    with ``resolve(name) -> (registry name, class)``."""
    def resolve_arguments(spec: str) -> tuple[str, Arguments]:
        sub_name, sub = resolve(spec)
        return sub_name, class_arguments(sub)

    check_argument_names(name, class_arguments(cls), kwargs, resolve=resolve_arguments)


def check_argument_names(name: str, arguments: Arguments, kwargs: Mapping[str, Any], *,
                         resolve: Callable[[str], tuple[str, Arguments]]) -> None:
    """:func:`check_names` on :class:`Arguments` (from :func:`class_arguments` or
    :func:`source_arguments`); ``resolve(name) -> (registry name, Arguments)``."""
    cls_name = arguments.cls_name
    label = f"{cls_name} ({name})" if name != cls_name else cls_name
    valid = arguments.names
    for key in kwargs:
        if key in valid:
            continue
        prefix = next((p for p in arguments.prefixes if key.startswith(p)), None)
        if prefix is None:
            raise _unknown(label, key, valid)
        role = prefix[:-1]
        spec = kwargs.get(role, arguments.role_defaults.get(role))
        if not isinstance(spec, str):
            continue  # an instance: the class refuses prefixed arguments itself
        sub_name, sub = resolve(spec)
        if key[len(prefix):] not in sub.names:
            routed = [prefix + k for k in sub.names]
            raise _unknown(f"{label} with {role}={sub_name!r}", key, routed)
