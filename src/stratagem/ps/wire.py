"""The parameter-server wire format: a fixed binary frame, a strict JSON header, raw tensor bytes.

The parameter-server service (TensorFlow's ``ps``/``worker`` jobs; Downpour SGD, Dean et al.
2012) moves parameters and gradients between workers and shards over gRPC. Every request and
reply is one gRPC message of raw ``bytes`` (identity serializers, no protoc codegen) laid out
as::

    offset 0   4 bytes   magic b"SGPS"
    offset 4   u16 LE    format version (1)
    offset 6   u16 LE    flags (must be 0)
    offset 8   u32 LE    header length H
    offset 12  H bytes   UTF-8 JSON header
    ...        padding   zeros up to the next multiple of 8 (the payload start)
    payload    tensor bytes, each at an 8-aligned offset relative to the payload start

The header is ``{"op": str, "fields": {...}, "tensors": [entry, ...]}`` and each entry is
``{"name", "dtype", "shape", "offset", "nbytes"}`` plus an optional integer ``"version"``.

Nothing is ever unpickled: a message is validated completely (sizes, header length, JSON
schema, dtype allow-list, ``prod(shape) * itemsize == nbytes``, bounds, counts) before a single
tensor is materialised, and tensors are zero-copy views (``torch.frombuffer``) of the received
``bytes``. A malformed message raises :class:`WireError` carrying the gRPC status the server
answers with (``INVALID_ARGUMENT`` or ``RESOURCE_EXHAUSTED``).

A request longer than :data:`REQUEST_CHUNK_BYTES` travels as a client stream of chunks of at
most that size (the same bytes, cut), with its total length declared in the call's metadata
(:data:`SIZE_METADATA_KEY`); a shorter one is one gRPC message, as before. The shard caps one
gRPC message at :data:`REQUEST_CHUNK_BYTES`, so it can admit a big request by its declared size
before a byte of it is received (see :class:`stratagem.ps.server.ShardServer`). Replies stay
one message.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from stratagem.errors import StratagemError
from stratagem.ps import flags

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "METHOD",
    "TOKEN_METADATA_KEY",
    "SIZE_METADATA_KEY",
    "REQUEST_CHUNK_BYTES",
    "request_chunks",
    "frame_length",
    "decode_header",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DTYPES",
    "DTYPE_NAMES",
    "Limits",
    "Entry",
    "Message",
    "WireError",
    "encode",
    "decode",
    "channel_options",
    "tune_malloc",
    "trim_malloc",
]

MAGIC = b"SGPS"
FORMAT_VERSION = 1
#: The single gRPC method every operation goes through (the op is named in the header).
METHOD = "/stratagem.ps.v1.Shard/Call"
TOKEN_METADATA_KEY = "x-stratagem-token"
#: The metadata key that declares a chunked request's total length (decimal bytes).
SIZE_METADATA_KEY = "x-stratagem-request-bytes"
#: The largest gRPC message a shard receives: longer requests are sent as chunks of this size.
#: Why chunks: grpcio (1.85) turns a received message into ``bytes`` through two more copies
#: (its slices, then per-slice ``bytes``, then their join), so one 12 MiB message peaks at
#: +36 MiB in the receiving process, and the shard cannot see a message's size before gRPC has
#: received all of it. Chunks cost one chunk's copies at a time, are written into a buffer of
#: the declared size, and let the shard bound what it receives before receiving it.
#: Why 1 MiB: every chunk costs CPU on both ends (a read through the shard's event loop; on
#: the client, gRPC's feeding thread), so fewer is faster: a loopback 8 MB push+fetch as one
#: request lost 20-30% of its throughput with 1 MiB chunks and more with 256 KiB ones
#: (docs/reliability.md). But a shard holds gRPC buffers of several chunks while it receives
#: (about 8 MiB with 1 MiB chunks, 2.5 MiB with 256 KiB), and with 2 MiB chunks the peak of the
#: concurrent-register probe reached 1.25x the quota. Requests of at most 1 MiB (buckets of
#: ``bucket_cap_mb`` <= 1, the default towards a shard on another machine) are one message and
#: pay nothing; with every shard on this machine the default is one call per shard, which
#: chunks once a shard's slice passes 1 MiB (the demo's 1.08 MB step: PS ~20 % slower).
REQUEST_CHUNK_BYTES = 1 << 20
#: gRPC caps a message at 2 GiB - 1; 1 GiB leaves room and is far above a typical shard slice.
DEFAULT_MAX_MESSAGE_BYTES = flags.DEFAULT_MAX_MESSAGE_BYTES

_PREFIX = struct.Struct("<4sHHI")
_ALIGN = 8

#: The dtypes allowed on the wire (name on the wire -> torch dtype).
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ENTRY_KEYS = frozenset({"name", "dtype", "shape", "offset", "nbytes", "version"})
_ENTRY_REQUIRED = _ENTRY_KEYS - {"version"}
_HEADER_KEYS = frozenset({"op", "fields", "tensors"})

# torch warns (once per process) that a tensor over a read-only ``bytes`` buffer could write
# into it. We own every received buffer exclusively (gRPC hands us a fresh object of more than
# one byte, never a cached one), so writing is harmless; consume the one-time warning here so
# it never reaches users in the middle of training.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0" * 8, dtype=torch.uint8)


class WireError(StratagemError):
    """A message broke the wire format or its limits; ``status`` is the gRPC status name."""

    def __init__(self, message: str, *, status: str = "INVALID_ARGUMENT") -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Bounds checked on every message before anything is allocated."""

    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_header_bytes: int = 16 << 20
    #: Tensor entries per message. Each costs ~10 us to check and build, so this bounds a
    #: message's decode (and a reply's size in entries) to tens of milliseconds; a shard
    #: holding more tensors is asked for them by name, in several calls.
    max_tensors: int = 4096
    max_name_chars: int = 1024
    max_ndim: int = 8
    max_json_depth: int = 8

    def __post_init__(self) -> None:
        if not 1024 <= self.max_message_bytes <= (1 << 31) - 1:
            raise ValueError(
                f"max_message_bytes must be in [1024, 2**31 - 1] (gRPC's limit), got "
                f"{self.max_message_bytes}; pass a value in that range")


@dataclass(frozen=True)
class Entry:
    """One tensor in a message: a name, the tensor, and an optional version number."""

    name: str
    tensor: torch.Tensor
    version: int | None = None


@dataclass
class Message:
    """A decoded message. Tensors share memory with the received bytes (no copy)."""

    op: str
    fields: dict[str, Any] = field(default_factory=dict)
    entries: list[Entry] = field(default_factory=list)
    #: Size of the received message in bytes (0 for one built locally): the buffer every
    #: tensor of ``entries`` is a view of.
    nbytes: int = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {e.name: e.tensor for e in self.entries}

    def versions(self) -> dict[str, int]:
        return {e.name: e.version for e in self.entries if e.version is not None}


def request_chunks(data: bytes) -> Iterator[bytes]:
    """``data`` cut into the chunks of a chunked request (see :data:`REQUEST_CHUNK_BYTES`)."""
    view = memoryview(data)
    for start in range(0, len(data), REQUEST_CHUNK_BYTES):
        yield bytes(view[start:start + REQUEST_CHUNK_BYTES])


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    """gRPC options for both ends: explicit message caps (gRPC's default receive cap is 4 MB)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]


def tune_malloc() -> bool:
    """Make glibc keep freed message-sized blocks instead of returning them to the kernel.

    Every message is a fresh multi-megabyte ``bytes``; by default glibc hands such blocks back
    to the kernel on free (``mmap``/trim), so the next message pays a page fault per 4 KiB
    page, which measured here as half the cost of a push. Raising the mmap and trim thresholds
    lets those blocks be reused. It is process-wide, so the shard process (:func:`serve`) does
    it and workers may opt in. Returns False where it does not apply (not glibc).
    """
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        m_trim_threshold, m_mmap_threshold = -1, -3
        # 32 MiB is glibc's largest mmap threshold on 64-bit; bigger blocks are mmapped anyway.
        ok = libc.mallopt(m_mmap_threshold, 32 << 20)
        ok &= libc.mallopt(m_trim_threshold, 256 << 20)
        return bool(ok)
    except (OSError, AttributeError):
        return False


def trim_malloc() -> bool:
    """Hand freed heap memory back to the kernel (glibc ``malloc_trim(0)``); False where it
    does not apply."""
    try:
        import ctypes

        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _raw_bytes(t: torch.Tensor) -> memoryview:
    """A flat byte view of ``t`` (copies only if ``t`` is not a contiguous CPU tensor)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    arr: Any = t.reshape(-1).contiguous().view(torch.uint8).numpy()
    return memoryview(arr)


def encode(op: str, fields: Mapping[str, Any] | None = None,
           entries: Sequence[Entry] = ()) -> bytes:
    """Frame ``op``, JSON ``fields`` and tensors into one ``bytes`` (one copy of each tensor)."""
    metas: list[dict[str, Any]] = []
    chunks: list[Any] = []
    pos = 0
    for e in entries:
        dtype_name = DTYPE_NAMES.get(e.tensor.dtype)
        if dtype_name is None:
            raise TypeError(
                f"tensor {e.name!r} has dtype {e.tensor.dtype}, which the parameter-server wire "
                f"does not carry; allowed: {sorted(DTYPES)}. Cast it first.")
        raw = _raw_bytes(e.tensor)
        start = _align(pos)
        if start > pos:
            chunks.append(bytes(start - pos))
        meta: dict[str, Any] = {"name": e.name, "dtype": dtype_name,
                                "shape": list(e.tensor.shape), "offset": start,
                                "nbytes": raw.nbytes}
        if e.version is not None:
            meta["version"] = int(e.version)
        metas.append(meta)
        chunks.append(raw)
        pos = start + raw.nbytes
    header = json.dumps({"op": op, "fields": dict(fields or {}), "tensors": metas},
                        separators=(",", ":"), allow_nan=False).encode()
    head_end = _PREFIX.size + len(header)
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(header))
    return b"".join([prefix, header, bytes(_align(head_end) - head_end), *chunks])


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-finite JSON constant {name}")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses as inf: a number must stay a number
        raise ValueError(f"number {text[:40]} overflows to {value}")
    return value


def _depth(obj: Any, limit: int, level: int = 0) -> None:
    if level > limit:
        raise WireError(f"header JSON nested deeper than {limit} levels")
    if isinstance(obj, dict):
        for v in obj.values():
            _depth(v, limit, level + 1)
    elif isinstance(obj, list):
        for v in obj:
            _depth(v, limit, level + 1)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def frame_length(first: bytes | bytearray | memoryview) -> int | None:
    """The length of a message's frame prefix plus JSON header, read from its first bytes
    (None while fewer than the prefix's 12 bytes are there). Nothing is checked here:
    :func:`decode_header` checks the prefix and the header."""
    if len(first) < _PREFIX.size:
        return None
    return _PREFIX.size + int.from_bytes(first[8:12], "little")


def decode_header(data: bytes | bytearray, limits: Limits | None = None
                  ) -> tuple[str, dict[str, Any], list[Any]]:
    """The op, fields and (unchecked) tensor entries of a message's header, read from its
    first :func:`frame_length` bytes or more: what a receiver can refuse a message by before
    the rest of it (the tensors' bytes) has arrived. Checks the prefix and the header as
    :func:`decode` does (raises :class:`WireError`); the entries are checked by :func:`decode`
    only, so a caller may use them as claims, not facts."""
    op, fields, metas, _ = _header(data, limits or Limits())
    return op, fields, metas


def _header(data: bytes | bytearray | mmap.mmap, lim: Limits
            ) -> tuple[str, dict[str, Any], list[Any], int]:
    size = len(data)
    if size < _PREFIX.size:
        raise WireError(f"message of {size} bytes is shorter than the {_PREFIX.size}-byte frame "
                        "prefix; not a stratagem parameter-server message")
    magic, version, flags, header_len = _PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} (expected {MAGIC!r}); not a stratagem "
                        "parameter-server message (pickle and other formats are refused)")
    if version != FORMAT_VERSION or flags != 0:
        raise WireError(f"unsupported wire format version {version} flags {flags} (this side "
                        f"speaks version {FORMAT_VERSION}); run the same stratagem everywhere")
    if header_len > lim.max_header_bytes:
        raise WireError(f"header length {header_len} exceeds max_header_bytes="
                        f"{lim.max_header_bytes}", status="RESOURCE_EXHAUSTED")
    head_end = _PREFIX.size + header_len
    if head_end > size:
        raise WireError(f"header length {header_len} runs past the end of a {size}-byte message")
    raw_header = bytes(memoryview(data)[_PREFIX.size:head_end])
    # Every JSON object is spelled with a "{", so this bounds the objects (tensor entries
    # among them) before the parse, the costly part: a header of 13 000 empty tensors is
    # refused in a fraction of a millisecond instead of being parsed first.
    objects = raw_header.count(b"{")
    if objects > 2 * lim.max_tensors + 64:
        raise WireError(f"header holds up to {objects} JSON objects, more than the "
                        f"{lim.max_tensors} tensors (max_tensors) a message may carry",
                        status="RESOURCE_EXHAUSTED")
    try:
        header = json.loads(raw_header.decode("utf-8"),
                            parse_constant=_reject_constant,
                            parse_float=_finite_float)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise WireError(f"header is not valid UTF-8 JSON: {exc}") from None
    if not isinstance(header, dict) or set(header) != _HEADER_KEYS:
        raise WireError(f"header must be an object with exactly the keys {sorted(_HEADER_KEYS)}")
    op, fields, metas = header["op"], header["fields"], header["tensors"]
    if not isinstance(op, str) or not 0 < len(op) <= 64:
        raise WireError("header 'op' must be a non-empty string of at most 64 characters")
    if not isinstance(fields, dict):
        raise WireError("header 'fields' must be an object")
    _depth(fields, lim.max_json_depth)
    if not isinstance(metas, list):
        raise WireError("header 'tensors' must be a list")
    if len(metas) > lim.max_tensors:
        raise WireError(f"{len(metas)} tensors exceed max_tensors={lim.max_tensors}",
                        status="RESOURCE_EXHAUSTED")
    return op, fields, metas, head_end


def decode(data: bytes | bytearray | mmap.mmap, limits: Limits | None = None) -> Message:
    """Validate and decode one message; raises :class:`WireError` on anything malformed."""
    lim = limits or Limits()
    size = len(data)
    if size > lim.max_message_bytes:
        raise WireError(f"message of {size} bytes exceeds max_message_bytes="
                        f"{lim.max_message_bytes}", status="RESOURCE_EXHAUSTED")
    op, fields, metas, head_end = _header(data, lim)
    payload_start = _align(head_end)
    payload_len = size - payload_start
    checked: list[tuple[str, torch.dtype, list[int], int, int, int | None]] = []
    end_prev = 0
    for i, m in enumerate(metas):
        if not isinstance(m, dict) or not _ENTRY_REQUIRED <= set(m) <= _ENTRY_KEYS:
            raise WireError(f"tensor entry {i} must have keys {sorted(_ENTRY_REQUIRED)} "
                            "(and optionally 'version') and nothing else")
        name, dtype_name, shape = m["name"], m["dtype"], m["shape"]
        offset, nbytes, ver = m["offset"], m["nbytes"], m.get("version")
        if not isinstance(name, str) or len(name) > lim.max_name_chars:
            raise WireError(f"tensor entry {i}: name must be a string of at most "
                            f"{lim.max_name_chars} characters")
        if dtype_name not in DTYPES:
            raise WireError(f"tensor {name!r}: dtype {dtype_name!r} is not allowed; allowed: "
                            f"{sorted(DTYPES)}")
        if (not isinstance(shape, list) or len(shape) > lim.max_ndim
                or not all(_is_int(d) and d >= 0 for d in shape)):
            raise WireError(f"tensor {name!r}: shape must be a list of at most {lim.max_ndim} "
                            f"non-negative integers, got {shape!r}")
        if not (_is_int(offset) and _is_int(nbytes) and offset >= end_prev and nbytes >= 0
                and offset % _ALIGN == 0 and offset + nbytes <= payload_len):
            raise WireError(f"tensor {name!r}: offset {offset!r} / nbytes {nbytes!r} out of "
                            f"order, unaligned or past the {payload_len}-byte payload")
        dtype = DTYPES[dtype_name]
        expected = math.prod(shape) * dtype.itemsize
        if expected != nbytes:
            raise WireError(f"tensor {name!r}: shape {shape} x {dtype_name} needs {expected} "
                            f"bytes but the entry says {nbytes}")
        if ver is not None and not _is_int(ver):
            raise WireError(f"tensor {name!r}: version must be an integer, got {ver!r}")
        checked.append((name, dtype, shape, offset, nbytes, ver))
        end_prev = offset + nbytes
    entries = []
    for name, dtype, shape, offset, nbytes, ver in checked:
        if nbytes == 0:
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(data, dtype=dtype, count=nbytes // dtype.itemsize,
                                 offset=payload_start + offset).view(shape)
        entries.append(Entry(name, t, ver))
    return Message(op, fields, entries, size)
