"""Same-host shared memory for the parameter-server data path: a sealed ``memfd`` per shard.

Why: on one machine a Downpour step's push+fetch of ~1 MB costs a shard 8-11 ms of CPU over
gRPC, of which the tensor work (the optimizer step and the finiteness guard) is ~2 ms; the
rest is receiving and sending megabyte bodies (chunks, copies, thread wake-ups). When a shard
runs on this machine (:func:`stratagem.ps.addresses.is_on_this_host`) the worker instead
shares a memory region with it, and each step sends only a small gRPC message naming the
tensors and versions; the gradients are read, and the values after the push written, by the
shard directly in the region. gRPC stays the control plane (authentication, deadlines,
refusals) and the only path to shards on other machines; any failure to set a region up
falls back to the gRPC path, unchanged.

The region (one per worker, table and shard) is an anonymous ``memfd`` created by the worker,
mode 0600, sized exactly for its layout (:func:`layout`: a 64-byte header holding a random
nonce, then per tensor part a gradient area and a value area, 64-byte aligned) and *sealed*
against shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``). It never has
a name in any directory: nothing can be left behind in ``/dev/shm`` and nothing needs
deleting (the kernel frees it when the last descriptor and mapping are gone, e.g. when a
worker dies). The shard opens it once through an authenticated ``shm_attach`` call, as
``/proc/<worker pid>/fd/<fd>``; the worker closes its descriptor as soon as the shard
answered, so no other process can open the region afterwards.

Trust (the shard does not trust the worker; :func:`open_region`): the path is built by the
shard from two integers; the target is checked before opening (a regular file) and, opened,
with ``fstat`` (regular file, owned by the shard's own uid, mode exactly 0600, size exactly
what the layout the shard computed from its own tensors needs) and ``F_GET_SEALS`` (shrink
and grow sealed: only a sealed memfd passes), and its header must hold the nonce the call
declared (so it is the caller's region, not another process's memfd of the same size). The
seals are why a worker cannot crash the shard with ``SIGBUS`` by truncating the file under
its mapping: the kernel refuses the truncation (plain ``/dev/shm`` files cannot be sealed;
that is why they are not used). The worker can still write the region at any time, so the
shard copies every gradient out of it before checking and applying it (no check-then-use
race), and what it writes there (the values) is the worker's own copy.
"""

from __future__ import annotations

import hmac
import math
import mmap
import os
import secrets
import stat
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["ENV", "HEADER_BYTES", "NONCE_BYTES", "Layout", "layout", "enabled", "supported",
           "WorkerRegion", "RegionRefused", "open_region"]

#: ``0`` turns the shared-memory path off (every call goes over gRPC); anything else, or
#: unset, leaves it on for shards on this machine.
ENV = "STRATAGEM_PS_SHM"
#: The region's header: the nonce, padded to the alignment.
HEADER_BYTES = 64
NONCE_BYTES = 16
#: Every area starts at a multiple of this (a cache line: no false sharing between areas).
_ALIGN = 64


def enabled() -> bool:
    """Whether the environment allows the shared-memory path (``STRATAGEM_PS_SHM`` not 0)."""
    return os.environ.get(ENV, "").strip() != "0"


def supported() -> bool:
    """Whether this platform has what a region needs (Linux: ``memfd_create`` with sealing,
    ``/proc/<pid>/fd``)."""
    import fcntl

    return (hasattr(os, "memfd_create") and hasattr(os, "MFD_ALLOW_SEALING")
            and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd"))


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class Area:
    """Where one tensor lives in a region."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """The agreed places of every tensor part: ``grads[name]`` (what the worker pushes, in
    the dtype it pushes) and ``values[name]`` (what the shard writes back, in the tensor's
    dtype); ``size`` is the region's exact length. Both sides compute it with :func:`layout`
    from the same list, the shard from its own registered tensors."""

    names: tuple[str, ...]
    grads: dict[str, Area]
    values: dict[str, Area]
    size: int


def layout(entries: Sequence[tuple[str, torch.dtype, torch.dtype, Sequence[int]]]) -> Layout:
    """The layout of ``(name, pushed dtype, value dtype, shape)`` entries, in that order."""
    grads: dict[str, Area] = {}
    values: dict[str, Area] = {}
    pos = HEADER_BYTES
    for name, push_dtype, value_dtype, shape in entries:
        dims = tuple(int(d) for d in shape)
        grads[name] = Area(pos, push_dtype, dims)
        pos = _align(pos + grads[name].nbytes)
        values[name] = Area(pos, value_dtype, dims)
        pos = _align(pos + values[name].nbytes)
    return Layout(tuple(name for name, *_ in entries), grads, values, pos)


def views(buf: mmap.mmap, lay: Layout) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Tensors over ``buf`` (no copy) for every area of ``lay``: (gradients, values)."""
    def view(a: Area) -> torch.Tensor:
        if a.nbytes == 0:
            return torch.empty(a.shape, dtype=a.dtype)
        return torch.frombuffer(buf, dtype=a.dtype, count=a.nbytes // a.dtype.itemsize,
                                offset=a.offset).view(a.shape)
    return ({n: view(a) for n, a in lay.grads.items()},
            {n: view(a) for n, a in lay.values.items()})


class WorkerRegion:
    """The worker's side of one region: the sealed memfd, its mapping and tensor views.

    ``lock`` is held from the moment a call's gradients are written until its fetched
    values are copied out (one call at a time per region; a caller that finds it held uses
    gRPC). ``dead`` is set after any failed call: its reply, and what the shard might still
    do with the region, are unknown, so the region is never used again (gRPC from then on).
    """

    def __init__(self, lay: Layout) -> None:
        import fcntl

        self.layout = lay
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self.region_id: str | None = None
        self.lock = threading.Lock()
        self.dead = False
        fd = os.memfd_create("stratagem-ps", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, lay.size)
            os.fchmod(fd, 0o600)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            self._mm: mmap.mmap | None = mmap.mmap(fd, lay.size)
        except BaseException:
            os.close(fd)
            raise
        self.fd: int | None = fd
        self._mm[:NONCE_BYTES] = self.nonce
        self.grads, self.values = views(self._mm, lay)

    def close_fd(self) -> None:
        """Close the descriptor (the mapping stays): once the shard has opened the region,
        no other process can open it through ``/proc/<pid>/fd``."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def release(self) -> None:
        """Drop the mapping (when nothing views it any more) and the descriptor."""
        self.dead = True
        self.close_fd()
        self.grads, self.values = {}, {}
        self._mm = None  # unmapped by the garbage collector once no tensor views it


class RegionRefused(ValueError):
    """A region failed one of the shard's checks; the message names which and the fix."""


def open_region(pid: int, fd: int, lay: Layout, nonce: bytes) -> mmap.mmap:
    """Map the region the worker ``pid`` holds as descriptor ``fd`` (shard side), after
    checking it as the module docstring says; raises :class:`RegionRefused` otherwise.

    ``/proc/<pid>/fd/<fd>`` is a kernel "magic link" to an open file of that process, so it
    cannot be opened with ``O_NOFOLLOW``; the path is built here from two integers (never a
    name from the network), and what the link points to is checked before and after opening
    (``O_NONBLOCK``: a FIFO cannot hang the shard)."""
    if not (isinstance(pid, int) and isinstance(fd, int) and 0 < pid < 1 << 31
            and 0 <= fd < 1 << 31):
        raise RegionRefused(f"shm_attach: pid and fd must be integers in range, got pid={pid!r} "
                            f"fd={fd!r}")
    path = f"/proc/{pid}/fd/{fd}"
    fix = ("Fix: let the worker create the region (stratagem.ps.shm.WorkerRegion), or set "
           f"{ENV}=0 on the worker to use gRPC only")
    try:
        before = os.stat(path)
    except OSError as exc:
        raise RegionRefused(f"shm_attach: cannot see the region {path}: {exc.strerror}; the "
                            "worker is not on this machine (or in another pid namespace). "
                            + fix) from None
    if not stat.S_ISREG(before.st_mode):
        raise RegionRefused(f"shm_attach: {path} is not a regular file (mode "
                            f"{stat.filemode(before.st_mode)}); refused. " + fix)
    try:
        f = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise RegionRefused(f"shm_attach: cannot open the region {path}: {exc.strerror}. "
                            + fix) from None
    try:
        st = os.fstat(f)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = f"it is not a regular file (mode {stat.filemode(st.st_mode)})"
        elif st.st_uid != os.geteuid():
            why = (f"it is owned by uid {st.st_uid}, not this shard's uid {os.geteuid()}")
        elif stat.S_IMODE(st.st_mode) != 0o600:
            why = f"its mode is {stat.S_IMODE(st.st_mode):03o}, not exactly 600"
        elif st.st_size != lay.size:
            why = (f"it holds {st.st_size} bytes, not the {lay.size} bytes the layout of the "
                   "declared tensors needs")
        else:
            import fcntl

            needed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
            try:
                seals = fcntl.fcntl(f, fcntl.F_GET_SEALS)
            except OSError:
                seals = 0
            if seals & needed != needed:
                why = ("it is not a memfd sealed against shrinking and growing (a truncation "
                       "would crash the shard with SIGBUS)")
        if why is not None:
            raise RegionRefused(f"shm_attach: region {path} refused: {why}. " + fix)
        mm = mmap.mmap(f, lay.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(f)
    if not hmac.compare_digest(mm[:NONCE_BYTES], nonce):
        mm.close()
        raise RegionRefused(f"shm_attach: region {path} does not hold the declared nonce: it is "
                            "not the caller's region. " + fix)
    return mm
