from __future__ import annotations

import json
import pickle
import struct

import pytest
import torch

from stratagem.ps import wire
from stratagem.ps.wire import Entry, Limits, WireError, decode, encode

pytestmark = pytest.mark.timeout(30)


def test_round_trip_all_dtypes_and_shapes() -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(3, 5, generator=g),
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "f16": torch.randn(2, 3, generator=g).half(),
        "bf16": torch.randn(4, 1, generator=g).bfloat16(),
        "i64": torch.arange(5),
        "i8": torch.tensor([-1, 2, 3], dtype=torch.int8),
        "u8": torch.tensor([1, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6, generator=g).t(),  # non-contiguous input
    }
    data = encode("push", {"max_staleness": 3, "x": [1, "a", None]},
                  [Entry(k, v, version=i) for i, (k, v) in enumerate(tensors.items())])
    msg = decode(data)
    assert msg.op == "push" and msg.fields == {"max_staleness": 3, "x": [1, "a", None]}
    out = msg.tensors()
    assert list(out) == list(tensors)
    for k, v in tensors.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape
        torch.testing.assert_close(out[k], v, rtol=0, atol=0)
    assert msg.versions() == {k: i for i, k in enumerate(tensors)}
    # Zero-copy views are 8-byte aligned inside the received buffer.
    assert all(t.data_ptr() % 8 == 0 for t in out.values() if t.numel())


def _frame(header: dict | bytes, payload: bytes = b"") -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    head = struct.pack("<4sHHI", wire.MAGIC, wire.FORMAT_VERSION, 0, len(raw)) + raw
    return head + bytes(-len(head) % 8) + payload


@pytest.mark.parametrize("data, status, needle", [
    (pickle.dumps(object()), "INVALID_ARGUMENT", "bad magic"),
    (b"\x00" * 5, "INVALID_ARGUMENT", "shorter"),
    (struct.pack("<4sHHI", wire.MAGIC, 1, 0, 0xFFFFFFFF), "RESOURCE_EXHAUSTED", "header length"),
    (struct.pack("<4sHHI", wire.MAGIC, 1, 0, 100) + b"{}", "INVALID_ARGUMENT", "runs past"),
    (struct.pack("<4sHHI", wire.MAGIC, 9, 0, 0), "INVALID_ARGUMENT", "version"),
    (_frame(b"{not json"), "INVALID_ARGUMENT", "JSON"),
    (_frame(b'{"op":"x","fields":{"a":NaN},"tensors":[]}'), "INVALID_ARGUMENT", "JSON"),
    (_frame({"op": "x", "fields": {}, "tensors": [], "extra": 1}), "INVALID_ARGUMENT", "keys"),
    (_frame({"op": "x", "fields": {}, "tensors": [
        {"name": "a", "dtype": "object", "shape": [1], "offset": 0, "nbytes": 8}]}, bytes(8)),
     "INVALID_ARGUMENT", "not allowed"),
    (_frame({"op": "x", "fields": {}, "tensors": [
        {"name": "a", "dtype": "float32", "shape": [3], "offset": 0, "nbytes": 8}]}, bytes(8)),
     "INVALID_ARGUMENT", "needs 12 bytes"),
    (_frame({"op": "x", "fields": {}, "tensors": [
        {"name": "a", "dtype": "float32", "shape": [1 << 40], "offset": 0,
         "nbytes": 4 << 40}]}, bytes(8)), "INVALID_ARGUMENT", "past"),
    (_frame({"op": "x", "fields": {}, "tensors": [
        {"name": "a", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8},
        {"name": "b", "dtype": "float32", "shape": [2], "offset": 0, "nbytes": 8}]}, bytes(16)),
     "INVALID_ARGUMENT", "out of order"),
    (_frame({"op": "x", "fields": {}, "tensors": [
        {"name": 7, "dtype": "float32", "shape": [0], "offset": 0, "nbytes": 0}]}),
     "INVALID_ARGUMENT", "name"),
    (_frame({"op": "x", "fields": {"a": [[[[[[[[[[1]]]]]]]]]]}, "tensors": []}),
     "INVALID_ARGUMENT", "deeper"),
])
def test_decode_refuses_malformed(data: bytes, status: str, needle: str) -> None:
    with pytest.raises(WireError, match=needle) as info:
        decode(data)
    assert info.value.status == status


def test_limits_are_enforced() -> None:
    data = encode("x", None, [Entry("a", torch.zeros(1024))])
    with pytest.raises(WireError) as info:
        decode(data, Limits(max_message_bytes=2048))
    assert info.value.status == "RESOURCE_EXHAUSTED"
    many = encode("x", None, [Entry(str(i), torch.zeros(1)) for i in range(5)])
    with pytest.raises(WireError, match="max_tensors"):
        decode(many, Limits(max_tensors=4))
    with pytest.raises(WireError, match="at most 3 characters"):
        decode(encode("x", None, [Entry("long", torch.zeros(1))]), Limits(max_name_chars=3))
    with pytest.raises(ValueError, match="max_message_bytes"):
        Limits(max_message_bytes=1 << 31)


def test_a_header_is_read_from_the_first_bytes_of_a_message() -> None:
    # What a shard refuses a chunked request by before the tensors' bytes have arrived.
    data = encode("register", {"specs": []}, [Entry("w", torch.zeros(1 << 16))])
    end = wire.frame_length(data[:12])
    assert end is not None and end < 1024 and wire.frame_length(data[:11]) is None
    op, fields, metas = wire.decode_header(data[:end])
    assert (op, fields) == ("register", {"specs": []})
    assert [(m["name"], m["nbytes"]) for m in metas] == [("w", 4 << 16)]
    with pytest.raises(WireError, match="runs past the end"):
        wire.decode_header(data[:end - 1])
    with pytest.raises(WireError, match="bad magic"):
        wire.decode_header(b"\x80\x04" + bytes(64))  # a pickle's first bytes
    long = _frame({"op": "x", "fields": {}, "tensors": []})
    with pytest.raises(WireError, match="max_header_bytes"):
        wire.decode_header(long, Limits(max_header_bytes=8))


def test_encode_refuses_unknown_dtype() -> None:
    with pytest.raises(TypeError, match="complex64"):
        encode("x", None, [Entry("c", torch.zeros(2, dtype=torch.complex64))])


def _reference_encode(op: str, fields: dict[str, object] | None, entries: list[Entry]) -> bytes:
    """The frame built the plain way (a join of the parts), to compare encode() against."""
    metas, chunks, pos = [], [], 0
    for e in entries:
        t = e.tensor.detach().reshape(-1).contiguous()
        raw = t.view(torch.uint8).numpy().tobytes()
        start = (pos + 7) // 8 * 8
        chunks.append(b"\0" * (start - pos))
        meta = {"name": e.name, "dtype": str(e.tensor.dtype).removeprefix("torch."),
                "shape": list(e.tensor.shape), "offset": start, "nbytes": len(raw)}
        if e.version is not None:
            meta["version"] = e.version
        metas.append(meta)
        chunks.append(raw)
        pos = start + len(raw)
    header = json.dumps({"op": op, "fields": fields or {}, "tensors": metas},
                        separators=(",", ":")).encode()
    head_end = 12 + len(header)
    pad = (head_end + 7) // 8 * 8 - head_end
    return b"".join([struct.pack("<4sHHI", b"SGPS", 1, 0, len(header)), header, b"\0" * pad,
                     *chunks])


def test_encode_defines_every_byte_of_the_frame() -> None:
    """Every byte of a frame is defined (padding zeroed): a freed buffer of another message
    (here 0xAB garbage of the same size, which malloc may hand back) never leaks into a new
    one, and the frame is byte-identical to a plain join of its parts."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    entries = [
        Entry("odd", torch.tensor([1, 2, 3], dtype=torch.int8)),  # 3 bytes: padding follows
        Entry("strided", base.t(), 5),  # non-contiguous
        Entry("bf16", torch.randn(5).to(torch.bfloat16)),
        Entry("scalar", torch.tensor(2.5, dtype=torch.float64), 7),
        Entry("empty", torch.empty(0, 3)),
        Entry("flags", torch.tensor([True, False, True])),
        Entry("big", torch.randn(70_001)),
    ]
    fields = {"results": [[0, "applied", 3]], "n": 1}
    expected = _reference_encode("op", fields, entries)
    for _ in range(20):
        garbage = b"\xab" * len(expected)
        del garbage
        got = encode("op", fields, entries)
        assert got == expected
    msg = decode(got)
    for e, d in zip(entries, msg.entries, strict=True):
        assert d.name == e.name and d.version == e.version
        assert torch.equal(d.tensor, e.tensor)


def test_encode_is_thread_safe() -> None:
    """Concurrent encodes (the shard's tensor threads, a worker's threads) never mix data."""
    import concurrent.futures

    def one(i: int) -> bool:
        t = torch.full((50_000 + i,), float(i))
        data = encode("op", {"i": i}, [Entry(f"t{i}", t, i)])
        m = decode(data)
        return m.fields == {"i": i} and torch.equal(m.entries[0].tensor, t)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(64)))
