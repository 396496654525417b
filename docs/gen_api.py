"""Generate ``docs/api.md`` from the docstrings: ``python docs/gen_api.py``.

Imports ``stratagem`` and walks the public names of a few modules (their ``__all__``) with
:mod:`inspect`: signatures, docstrings, and for classes the public methods and properties
they define themselves. A name that cannot be imported (a module still being written) is
listed with the import error instead of stopping the whole reference.
"""

from __future__ import annotations

import argparse
import enum
import importlib
import inspect
import sys
import typing
from pathlib import Path
from typing import Any

#: (module, title, names or None for the module's ``__all__``)
SECTIONS: list[tuple[str, str, list[str] | None]] = [
    ("stratagem", "stratagem (import stratagem as sg)", None),
    ("stratagem.fit", "stratagem.fit — the high-level loop and callbacks", None),
    ("stratagem.data", "stratagem.data — input sharding", None),
    ("stratagem.checkpoint", "stratagem.checkpoint — checkpoint files",
     ["read_extras", "load_model_state"]),
    ("stratagem.testing", "stratagem.testing — running ranks as threads, injecting faults",
     None),
    ("stratagem.ps", "stratagem.ps — the parameter-server runtime",
     ["PSClient", "ShardedParameters", "PushOutcome", "PSLink", "ShardServer", "serve",
      "start_local_shards", "optimizer_spec"]),
]


def _doc(obj: Any) -> str:
    if inspect.isclass(obj) and not obj.__dict__.get("__doc__"):
        return "*(no docstring)*"  # not the docstring inherited from a base such as str
    doc = inspect.getdoc(obj)
    return doc.strip() if doc else "*(no docstring)*"


class _Annotation:
    """An annotation printed as written (``from __future__ import annotations`` leaves
    strings, which ``inspect`` would print quoted)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _plain(annotation: Any) -> Any:
    if isinstance(annotation, str):
        return _Annotation(annotation)
    if isinstance(annotation, typing.ForwardRef):
        return _Annotation(annotation.__forward_arg__)
    return annotation


def _signature(obj: Any) -> str:
    if inspect.isclass(obj) and issubclass(obj, enum.Enum):
        return ""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = [p.replace(annotation=_plain(p.annotation)) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=_plain(sig.return_annotation)))


def _members(cls: type) -> list[tuple[str, Any]]:
    out = []
    for name, value in cls.__dict__.items():
        if name.startswith("_"):
            continue
        if isinstance(value, property) or inspect.isfunction(value) or isinstance(
                value, (classmethod, staticmethod)):
            out.append((name, value))
    return out


def _render_class(name: str, cls: type, lines: list[str]) -> None:
    bases = [b.__name__ for b in cls.__bases__ if b is not object]
    suffix = f" ({', '.join(bases)})" if bases else ""
    lines += [f"### class `{name}{_signature(cls)}`{suffix}", "", _doc(cls), ""]
    if issubclass(cls, enum.Enum):
        lines += ["Members: " + ", ".join(f"`{m.name}` = `{m.value!r}`" for m in cls), ""]
        return
    for member, value in _members(cls):
        if isinstance(value, property):
            lines += [f"- **`{member}`** (property): {_doc(value).splitlines()[0]}"
                      if value.__doc__ else f"- **`{member}`** (property)"]
            continue
        func = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
        kind = "classmethod " if isinstance(value, classmethod) else ""
        lines += [f"- **`{kind}{member}{_signature(func)}`**"]
        if func.__doc__:
            lines += ["", "  " + _doc(func).replace("\n", "\n  "), ""]
    lines.append("")


def _render(obj_name: str, obj: Any, lines: list[str]) -> None:
    if inspect.isclass(obj):
        _render_class(obj_name, obj, lines)
    elif callable(obj):
        lines += [f"### `{obj_name}{_signature(obj)}`", "", _doc(obj), ""]
    else:
        lines += [f"### `{obj_name}`", "", f"`{obj!r}`", ""]


def generate() -> str:
    lines = ["# API reference", "",
             "Generated from the docstrings by `python docs/gen_api.py`; do not edit by hand.",
             "The contract these names fulfil is described in `docs/guide.md` and the README.",
             ""]
    for module_name, title, names in SECTIONS:
        lines += [f"## {title}", ""]
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:  # noqa: BLE001 - report and go on
            lines += [f"*Not importable here: {type(exc).__name__}: {exc}*", ""]
            continue
        if module.__doc__:
            lines += [_doc(module), ""]
        for name in names if names is not None else list(getattr(module, "__all__", [])):
            try:
                obj = getattr(module, name)
            except Exception as exc:  # noqa: BLE001 - e.g. a lazily imported module in progress
                lines += [f"### `{name}`", "",
                          f"*Not importable yet: {type(exc).__name__}: {exc}*", ""]
                continue
            _render(name, obj, lines)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", default=str(Path(__file__).with_name("api.md")))
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the file on disk differs from the generated text")
    args = parser.parse_args(argv)
    text = generate()
    out = Path(args.output)
    if args.check:
        current = out.read_text() if out.is_file() else ""
        if current != text:
            print(f"{out} is out of date: run python docs/gen_api.py", file=sys.stderr)
            return 1
        return 0
    out.write_text(text)
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
