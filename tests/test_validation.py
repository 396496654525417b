"""The shared argument checks (stratagem.validation) and the one compression table."""

from __future__ import annotations

import math

import pytest
import torch

from stratagem.compression import (
    COMPRESSIONS,
    KINDS,
    check_compression,
    compression_dtype,
    wire_dtype,
)
from stratagem.validation import (
    check_bool,
    check_choice,
    check_int,
    check_number,
    check_optional_number,
    describe_choices,
)


def test_check_int_accepts_and_returns_ints_in_range():
    assert check_int("period", 3, minimum=1) == 3
    assert check_int("code", 255, minimum=0, maximum=255) == 255
    assert check_int("n", -7) == -7
    assert check_int("n", 0, maximum=0) == 0


@pytest.mark.parametrize("value", [0, -1, True, False, 1.0, "2", None, 2.5])
def test_check_int_refuses_with_constraint_value_and_fix(value):
    with pytest.raises(ValueError) as info:
        check_int("period", value, minimum=1, fix="pass e.g. period=10")
    assert str(info.value) == f"period must be an int >= 1, got {value!r}. Fix: pass e.g. period=10"


def test_check_int_messages_per_bound():
    with pytest.raises(ValueError, match=r"^exit_code must be an int in \[0, 255\], got 256$"):
        check_int("exit_code", 256, minimum=0, maximum=255)
    with pytest.raises(ValueError, match=r"^n must be an int <= 3, got 4$"):
        check_int("n", 4, maximum=3)
    with pytest.raises(ValueError, match=r"^n must be an int, got 'x'$"):
        check_int("n", "x")


def test_check_number_intervals():
    assert check_number("rate", 1, low=0, high=1, low_open=True) == 1.0
    assert isinstance(check_number("rate", 1, low=0), float)
    assert check_number("norm_type", math.inf, low=0, low_open=True) == math.inf
    with pytest.raises(ValueError, match=r"^rate must be a number in \(0, 1\], got 0$"):
        check_number("rate", 0, low=0, high=1, low_open=True)
    with pytest.raises(ValueError, match=r"^m must be a number in \[0, 1\), got 1.0$"):
        check_number("m", 1.0, low=0, high=1, high_open=True)
    with pytest.raises(ValueError, match=r"^rho must be a number >= 0, got -0.5$"):
        check_number("rho", -0.5, low=0)
    with pytest.raises(ValueError, match=r"^x must be a number < 2.5, got 3$"):
        check_number("x", 3, high=2.5, high_open=True)
    with pytest.raises(ValueError, match=r"^max_norm must be a finite number > 0, got inf. Fix: "):
        check_number("max_norm", math.inf, low=0, low_open=True, finite=True, fix="pass 1.0")


@pytest.mark.parametrize("value", [math.nan, True, "1", None, torch.tensor(1.0)])
def test_check_number_refuses_nan_bools_and_non_numbers(value):
    with pytest.raises(ValueError, match="must be a number"):
        check_number("lr", value, low=0)


def test_check_optional_number():
    assert check_optional_number("clip", None, low=0, low_open=True) is None
    assert check_optional_number("clip", 2, low=0, low_open=True) == 2.0
    with pytest.raises(ValueError, match=r"^clip must be None or a finite number > 0, got -1$"):
        check_optional_number("clip", -1, low=0, low_open=True, finite=True)


def test_check_choice_and_bool():
    assert check_choice("mode", "sync", ("sync", "async")) == "sync"
    assert check_choice("kind", None, (None, "fp16")) is None
    with pytest.raises(ValueError, match=r"^mode must be 'sync' or 'async', got 'fast'. Fix: x$"):
        check_choice("mode", "fast", ("sync", "async"), fix="x")
    with pytest.raises(ValueError, match=r"^mode must be 'a', 'b' or 'c', got \['a'\]$"):
        check_choice("mode", ["a"], ["a", "b", "c"])  # unhashable: refused, not a TypeError
    assert describe_choices(["only"]) == "'only'"
    assert check_bool("flag", False) is False
    with pytest.raises(ValueError, match=r"^flag must be True or False, got 'false'$"):
        check_bool("flag", "false")
    with pytest.raises(ValueError, match="True or False, got 1"):
        check_bool("flag", 1)


def test_one_compression_table():
    assert KINDS == {None: None, "fp16": torch.float16, "bf16": torch.bfloat16,
                     "int8": torch.int8, "int4": torch.uint8, "topk": torch.uint8}
    assert COMPRESSIONS == {"fp16": torch.float16, "bf16": torch.bfloat16}
    for kind, dtype in KINDS.items():
        assert check_compression(kind, kinds=tuple(KINDS)) == kind
        assert wire_dtype(kind) is dtype
    assert compression_dtype("bf16") is torch.bfloat16


def test_check_compression_errors_name_keyword_kinds_and_fix():
    with pytest.raises(ValueError, match=r"^compression must be one of None, 'fp16' or 'bf16', "
                                         r"got 'int8'. Fix: pass None, 'fp16' or 'bf16' \(None: "
                                         r"full precision\). 'int8' \(blockwise quantization\) "
                                         r"is for outer synchronisation only"):
        check_compression("int8")
    with pytest.raises(ValueError, match=r"^compression must be one of None or 'bf16', got "
                                         r"'fp16'"):
        check_compression("fp16", kinds=(None, "bf16"))
    with pytest.raises(ValueError, match=r"^pseudo_grad_dtype must be one of"):
        check_compression([], name="pseudo_grad_dtype")
    with pytest.raises(ValueError, match="compression must be one of 'fp16' or 'bf16', got None"):
        compression_dtype(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="keys of compression.KINDS"):
        check_compression(None, kinds=(None, "int2"))


def test_int_argument_for_argparse():
    import argparse

    from stratagem.validation import int_argument

    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int_argument(minimum=1, fix="pass e.g. --nproc 2"))
    assert parser.parse_args(["--nproc", "3"]).nproc == 3
    parse = int_argument(minimum=0, maximum=9)
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be >= 1, got 0. Fix: pass e.g."):
        int_argument(minimum=1, fix="pass e.g. --nproc 2")("0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^must be in \[0, 9\], got 10$"):
        parse("10")
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer, got 'x'"):
        parse("x")
