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
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

__all__ = ["ENV", "BELL_ENV", "BELL_MAX_BYTES", "HEADER_BYTES", "NONCE_BYTES", "Layout",
           "layout", "enabled", "bell_enabled", "supported", "WorkerRegion", "RegionRefused",
           "open_region", "REGION_REFUSED", "Bell", "BellTimeout", "BellClosed", "open_bell", "FifoId", "bell_wait",
           "bell_receive", "bell_send"]

#: ``0`` turns the shared-memory path off (every call goes over gRPC); anything else, or
#: unset, leaves it on for shards on this machine.
ENV = "STRATAGEM_PS_SHM"
#: The region's header: the nonce, padded to the alignment.
HEADER_BYTES = 64
NONCE_BYTES = 16
#: Every area starts at a multiple of this (a cache line: no false sharing between areas).
_ALIGN = 64


#: ``0`` keeps each step's small message on gRPC (no doorbell pipes; see :class:`Bell`).
BELL_ENV = "STRATAGEM_PS_BELL"
#: The most bytes one doorbell message (a step's request or its reply) may hold; a length
#: prefix above it closes the channel before anything is allocated.
BELL_MAX_BYTES = 1 << 20


def enabled() -> bool:
    """Whether the environment allows the shared-memory path (``STRATAGEM_PS_SHM`` not 0)."""
    return os.environ.get(ENV, "").strip() != "0"


def bell_enabled() -> bool:
    """Whether the environment allows the doorbell pipes (``STRATAGEM_PS_BELL`` not 0)."""
    return os.environ.get(BELL_ENV, "").strip() != "0"


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
        #: The process that made it: a forked child must not use it (it would share the
        #: pipes, and the replies, with its parent).
        self.pid = os.getpid()
        #: The doorbell each step's small message goes through, once the shard opened it.
        self.bell: Bell | None = None
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

    def close_bell(self) -> None:
        """Close the doorbell (caller holds :attr:`lock`, or no call can be running)."""
        bell, self.bell = self.bell, None
        if bell is not None:
            bell.close()

    def release(self) -> None:
        """Drop the mapping (when nothing views it any more) and the descriptor."""
        self.dead = True
        self.close_fd()
        # Never close the doorbell under a call in flight (its descriptors could be reused
        # by then): the call's own end does it (table._ShmCall.after) when this times out.
        if self.lock.acquire(timeout=2.0):
            try:
                self.close_bell()
            finally:
                self.lock.release()
        self.grads, self.values = {}, {}
        self._mm = None  # unmapped by the garbage collector once no tensor views it


class RegionRefused(ValueError):
    """A region or doorbell failed one of the shard's checks. ``str()`` is what the caller
    is told: for a region, one generic sentence (:data:`REGION_REFUSED`) whatever check
    failed, so a refusal never describes a file another process holds open (its type, size,
    owner or mode); :attr:`detail` names the check that failed, for the shard's own log."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail if detail is not None else message


#: What a refused region is answered, whichever check failed (the shard logs which).
REGION_REFUSED = (f"shm_attach: region refused: it must be a memfd that the calling worker "
                  f"holds open, owned by this shard's uid, mode 0600, sealed against "
                  f"shrinking and growing, exactly the size of the declared tensors' layout and "
                  f"holding the declared nonce (the shard's log names the check that failed). "
                  f"Fix: let the worker create the region (stratagem.ps.shm.WorkerRegion), or "
                  f"set {ENV}=0 on the worker to use gRPC only")


def _region_check(f: int, lay: Layout) -> str | None:
    """Why the open file ``f`` is not an acceptable region (None: it is)."""
    import fcntl

    st = os.fstat(f)
    if not stat.S_ISREG(st.st_mode):
        return f"it is not a regular file (mode {stat.filemode(st.st_mode)})"
    if st.st_uid != os.geteuid():
        return f"it is owned by uid {st.st_uid}, not this shard's uid {os.geteuid()}"
    if stat.S_IMODE(st.st_mode) != 0o600:
        return f"its mode is {stat.S_IMODE(st.st_mode):03o}, not exactly 600"
    if st.st_size != lay.size:
        return (f"it holds {st.st_size} bytes, not the {lay.size} bytes the layout of the "
                "declared tensors needs")
    needed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
    try:
        seals = fcntl.fcntl(f, fcntl.F_GET_SEALS)
    except OSError:
        seals = 0
    if seals & needed != needed:
        return ("it is not a memfd sealed against shrinking and growing (a truncation would "
                "crash the shard with SIGBUS)")
    return None


def open_region(pid: int, fd: int, lay: Layout, nonce: bytes) -> mmap.mmap:
    """Map the region the worker ``pid`` holds as descriptor ``fd`` (shard side), after
    checking it as the module docstring says; raises :class:`RegionRefused` otherwise, with
    the same generic message whichever check failed (its ``detail`` says which).

    ``/proc/<pid>/fd/<fd>`` is a kernel "magic link" to an open file of that process, so it
    cannot be opened with ``O_NOFOLLOW``; the path is built here from two integers (never a
    name from the network), and what the link points to is checked before and after opening
    (``O_NONBLOCK``: a FIFO cannot hang the shard)."""
    if not (isinstance(pid, int) and isinstance(fd, int) and 0 < pid < 1 << 31
            and 0 <= fd < 1 << 31):
        raise RegionRefused(f"shm_attach: pid and fd must be integers in range, got pid={pid!r} "
                            f"fd={fd!r}")
    path = f"/proc/{pid}/fd/{fd}"

    def refused(why: str) -> RegionRefused:
        return RegionRefused(REGION_REFUSED, f"region {path}: {why}")

    try:
        before = os.stat(path)
    except OSError as exc:
        raise refused(f"cannot see it: {exc.strerror} (not on this machine, or in another "
                      "pid namespace)") from None
    if not stat.S_ISREG(before.st_mode):
        raise refused(f"not a regular file (mode {stat.filemode(before.st_mode)})")
    try:
        f = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise refused(f"cannot open it: {exc.strerror}") from None
    try:
        why = _region_check(f, lay)
        if why is not None:
            raise refused(why)
        mm = mmap.mmap(f, lay.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(f)
    if not hmac.compare_digest(mm[:NONCE_BYTES], nonce):
        mm.close()
        raise refused("it does not hold the declared nonce: not the caller's region")
    return mm


# -- the doorbell: each step's small message through a pair of pipes ------------------------
#
# Why: with the tensors in the region, what is left of a step's round trip over gRPC is the
# small message and ~8 thread hand-offs (the client's call thread, gRPC's poller, the shard's
# event loop and tensor thread, and back), ~1.6 ms of the shard's CPU per push on a busy
# 2-core machine where the tensor work is ~2.7 ms. A pair of pipes per region takes the same
# bytes (``wire``-encoded, length-prefixed) to one shard thread that serves only that region
# and back: two wake-ups per round trip. gRPC stays the control plane (the authenticated
# ``shm_attach`` sets the pipes up, ``shm_detach`` ends them) and the fallback.
#
# Trust: the pipes are created by the worker and opened by the shard, once, through
# ``/proc/<pid>/fd/<fd>`` in the authenticated ``shm_attach``, after the region itself passed
# :func:`open_region` (so ``pid`` is the caller's process: it holds the sealed memfd with the
# nonce the call declared, which only the process that made it knows), and checked: FIFOs
# owned by the shard's uid, two different pipes, neither one of the shard's doorbells
# already, and the request pipe must begin with the region's nonce, which only the caller
# wrote there. Every message after that is length-checked before
# anything is allocated and decoded by ``wire`` (no pickle), and must be a ``shm_push`` of
# that one region; every read and write has a deadline. Anything else on a request pipe (a
# reply, another op, another region's push, bytes that do not decode) closes that channel
# unanswered: the shard never writes a refusal into a pipe, so two doorbells wired to each
# other cannot answer each other's refusals forever. A pipe the shard already serves as a
# doorbell is refused at attach (compared by st_dev/st_ino) before anything is read from it.
# A worker that misbehaves on its own pipes only loses its own channel (the shard closes it
# and drops the region; the worker falls back to gRPC).


class BellTimeout(OSError):
    """The other side did not read or answer within the deadline."""


class BellClosed(OSError):
    """The other side closed its end (a dead process, a dropped region) or broke the
    protocol (a length above :data:`BELL_MAX_BYTES`)."""


def _wait_fd(fd: int, events: int, due: float,
             alive: Callable[[], bool] | None = None) -> None:
    """Wait until ``fd`` is ready for ``events`` or ``due`` passes (:class:`BellTimeout`);
    with ``alive``, in slices of at most 0.5 s, each ended by asking it (False:
    :class:`BellClosed`, the channel is no longer wanted)."""
    import select
    import time

    poller = select.poll()
    poller.register(fd, events)
    while True:
        left = due - time.monotonic()
        if left <= 0:
            raise BellTimeout("deadline passed")
        if poller.poll(max(1, math.ceil(min(left, 0.5 if alive else left) * 1000))):
            return
        if alive is not None and not alive():
            raise BellClosed("the channel is no longer wanted")


def _read_exact(fd: int, n: int, due: float, alive: Callable[[], bool] | None = None) -> bytes:
    import select

    parts: list[bytes] = []
    while n:
        try:
            chunk = os.read(fd, n)
        except BlockingIOError:
            _wait_fd(fd, select.POLLIN, due, alive)
            continue
        if not chunk:
            raise BellClosed("the other end is closed")
        parts.append(chunk)
        n -= len(chunk)
    return b"".join(parts)


def bell_send(fd: int, data: bytes, due: float,
              alive: Callable[[], bool] | None = None) -> None:
    """Write ``data`` with its 4-byte length to the pipe ``fd`` (non-blocking) by ``due``
    (``time.monotonic()``); :class:`BellTimeout` or :class:`BellClosed` otherwise (also for a
    message above :data:`BELL_MAX_BYTES`, which the other side would refuse)."""
    import select

    if len(data) > BELL_MAX_BYTES:
        raise BellClosed(f"a doorbell message holds at most {BELL_MAX_BYTES} bytes, got "
                         f"{len(data)}")
    view = memoryview(len(data).to_bytes(4, "little") + data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            _wait_fd(fd, select.POLLOUT, due, alive)
        except (BrokenPipeError, ConnectionResetError):
            raise BellClosed("the other end is closed") from None
        except OSError as exc:  # e.g. closed under a call by the owner: the channel is gone
            raise BellClosed(f"the doorbell failed: {exc.strerror}") from None


def bell_wait(fd: int, seconds: float) -> bool:
    """Whether the pipe ``fd`` has something to read (or is closed) within ``seconds``."""
    import select

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(seconds * 1000))))


def bell_receive(fd: int, due: float, alive: Callable[[], bool] | None = None) -> bytes:
    """One length-prefixed message from the pipe ``fd``, whole by ``due``
    (``time.monotonic()``); its length is checked against :data:`BELL_MAX_BYTES` before the
    body is read. ``alive``: see :func:`_wait_fd`."""
    try:
        n = int.from_bytes(_read_exact(fd, 4, due, alive), "little")
        if n > BELL_MAX_BYTES:
            raise BellClosed(f"a message of {n} bytes announced, above {BELL_MAX_BYTES}")
        return _read_exact(fd, n, due, alive)
    except (BellClosed, BellTimeout):
        raise
    except OSError as exc:  # e.g. closed under a call by the owner: the channel is gone
        raise BellClosed(f"the doorbell failed: {exc.strerror}") from None


class Bell:
    """The worker's side of a region's doorbell: it writes requests to one pipe and reads
    the shard's answers from the other. :meth:`declare` names the two descriptors the shard
    opens; :meth:`opened` closes them here once it has (the worker keeps only its own ends).
    One call at a time (the region's lock)."""

    def __init__(self, nonce: bytes) -> None:
        flags = os.O_CLOEXEC | os.O_NONBLOCK
        self._req_r, self._req_w = os.pipe2(flags)
        try:
            self._rep_r, self._rep_w = os.pipe2(flags)
        except BaseException:
            os.close(self._req_r)
            os.close(self._req_w)
            raise
        self._open = [self._req_r, self._req_w, self._rep_r, self._rep_w]
        os.write(self._req_w, nonce)  # the proof the shard reads first (pipes hold 64 KiB)

    def declare(self) -> list[int]:
        """``[request pipe's read end, reply pipe's write end]``: what the shard opens."""
        return [self._req_r, self._rep_w]

    def _close(self, fd: int) -> None:
        if fd in self._open:
            self._open.remove(fd)
            os.close(fd)

    def opened(self) -> None:
        """The shard holds its ends: close ours of them, so a dead shard reads as EOF here
        and a dead worker as EOF there."""
        self._close(self._req_r)
        self._close(self._rep_w)

    def call(self, data: bytes, due: float) -> bytes:
        """Send one request and wait for its answer, by ``due`` (``time.monotonic()``)."""
        bell_send(self._req_w, data, due)
        return bell_receive(self._rep_r, due)

    def close(self) -> None:
        for fd in list(self._open):
            self._close(fd)


#: A pipe as the kernel knows it: ``(st_dev, st_ino)`` of either end.
FifoId = tuple[int, int]


def open_bell(pid: int, fds: object, nonce: bytes,
              held: Collection[FifoId] = ()) -> tuple[int, int, tuple[FifoId, FifoId]]:
    """Open the doorbell pipes the worker ``pid`` declared (``[request read end, reply write
    end]``) as the shard's own non-blocking descriptors; returns ``(request, reply, (request
    pipe's id, reply pipe's id))``, after the checks the section comment above names. A pipe
    in ``held`` (those of the doorbells the shard already serves) is refused before anything
    is read from it: two doorbells sharing a pipe (one's reply pipe the other's request
    pipe) would answer each other forever. Raises :class:`RegionRefused` otherwise."""
    import time

    if not (isinstance(fds, list) and len(fds) == 2 and all(
            isinstance(f, int) and not isinstance(f, bool) and 0 <= f < 1 << 31 for f in fds)):
        raise RegionRefused(f"shm_attach: 'bell' must be two descriptor numbers, got "
                            f"{str(fds)[:60]}")
    if not (isinstance(pid, int) and 0 < pid < 1 << 31):
        raise RegionRefused(f"shm_attach: pid must be an integer in range, got {pid!r}")
    opened: list[int] = []
    try:
        for fd, mode in zip(fds, (os.O_RDONLY, os.O_WRONLY), strict=True):
            path = f"/proc/{pid}/fd/{fd}"
            try:
                if not stat.S_ISFIFO(os.stat(path).st_mode):
                    raise RegionRefused(f"shm_attach: {path} is not a pipe")
                f = os.open(path, mode | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as exc:
                raise RegionRefused(f"shm_attach: cannot open the doorbell pipe {path}: "
                                    f"{exc.strerror}") from None
            opened.append(f)
            st = os.fstat(f)
            if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.geteuid():
                raise RegionRefused(f"shm_attach: doorbell {path} is not a pipe owned by uid "
                                    f"{os.geteuid()}")
        a, b = (os.fstat(f) for f in opened)
        ids = ((a.st_dev, a.st_ino), (b.st_dev, b.st_ino))
        if ids[0] == ids[1]:
            raise RegionRefused("shm_attach: the doorbell's two descriptors are one pipe")
        if ids[0] in held or ids[1] in held:
            raise RegionRefused("shm_attach: a doorbell pipe is already one of this shard's "
                                "doorbells (each region needs two pipes of its own)")
        try:  # written before the call (atomically: below PIPE_BUF), so it is there now
            proof = _read_exact(opened[0], len(nonce), time.monotonic())
        except (BellTimeout, BellClosed):
            proof = b""
        if not hmac.compare_digest(proof, nonce):
            raise RegionRefused("shm_attach: the doorbell's request pipe does not begin with "
                                "the region's nonce: it is not the caller's")
    except BaseException:
        for f in opened:
            os.close(f)
        raise
    return opened[0], opened[1], ids
