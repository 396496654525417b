"""``tests/gpu``: checks that need a CUDA device, run by ``make test-gpu``
(``PYTHONPATH=src python3 -m pytest tests/gpu`` with a CUDA build of torch already installed:
no install step).

Without CUDA every test here is collected and skipped (``pytest tests/gpu`` exits 0), so the
normal suite pays only the import of one module. The skip is a collection hook rather than
``collect_ignore``: a directory with nothing collected makes pytest exit 5.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False); "
                                   "run `make test-gpu` on a machine with one")
    for item in items:
        if _HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(skip)
