"""A shard's same-host transport: workers' shared-memory regions and their doorbells.

A worker on the shard's machine attaches a region (``shm_attach``, over gRPC): a sealed
memfd the shard maps (:func:`stratagem.ps.shm.open_region` checks it) holding the worker's
gradients and the values it fetches. Each step is then a ``shm_push`` whose tensors are in
the region, sent over gRPC or, when the region has one, over its doorbell (a pair of pipes,
:class:`stratagem.ps.shm.Bell`) served by a thread of its own. A ``shm_push`` is checked and
applied exactly as a gRPC ``push`` (:meth:`stratagem.ps.service.ShardService.check_push`),
so both transports give bitwise the same results and refusals.

Bounds: at most ``MAX_REGIONS`` regions and as many doorbells; a pipe serves one doorbell;
as many doorbell pushes at once as the shard has tensor threads; a request must arrive whole
within ``body_timeout`` of its first byte and its answer be read as fast; a doorbell that
carries anything but its own region's request is closed unanswered; regions of dead workers
are dropped on a timer (:meth:`SameHost.reap`, every few seconds).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from stratagem.ps import shm, wire
from stratagem.ps.rules import is_int as _is_int
from stratagem.ps.rules import refused as _err
from stratagem.ps.service import ShardService, field_int, field_names, first_repeat, locked
from stratagem.ps.wire import Entry, Message

__all__ = ["MAX_REGIONS", "REAP_SECONDS", "SameHost"]

#: Shared-memory regions one shard maps at most (those of dead workers are dropped first):
#: each is bounded by the registered tensors it covers (two copies), so this bounds them all.
MAX_REGIONS = 64
#: How often the shard looks for regions of workers that are gone (see SameHost.reap).
REAP_SECONDS = 2.0
#: How long an idle doorbell thread waits before it looks whether its region is still
#: wanted: each look is a wake-up that takes the GIL, so many idle doorbells waking often
#: cost the calls being served (a request on the pipe, or its closing, wakes it at once).
_BELL_IDLE_SECONDS = 2.0


@dataclass
class _Region:
    """A worker's shared-memory region as the shard maps it (views keep the mapping alive).
    ``started`` is the worker's start time (``/proc/<pid>/stat``), so a pid reused by a new
    process does not keep a dead worker's region; ``fifos`` are its doorbell's pipes."""

    pid: int
    layout: shm.Layout
    grads: dict[str, torch.Tensor]
    values: dict[str, torch.Tensor]
    started: str | None = None
    fifos: tuple[shm.FifoId, ...] = ()


def _process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (field 22 of ``/proc/<pid>/stat``; None: gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    return fields[19] if len(fields) > 19 else None


def _alive(region: _Region) -> bool:
    """Whether the worker that attached ``region`` still runs (same pid, same start time)."""
    started = _process_start(region.pid)
    return started is not None and (region.started is None or started == region.started)


class _NotARequest(Exception):
    """A doorbell carried something that is not a request of its region: the channel is
    closed unanswered (:meth:`SameHost._bell_loop`)."""


class SameHost:
    """The shared-memory transport of one shard: adds ``shm_attach``, ``shm_push`` and
    ``shm_detach`` to ``service`` and serves the regions' doorbells on threads of its own.

    ``max_workers`` doorbell pushes run at once (as many as the shard's tensor threads);
    ``body_timeout`` bounds each doorbell request's arrival and its answer's reading.
    """

    def __init__(self, service: ShardService, *, max_workers: int, body_timeout: float) -> None:
        self.service = service
        self.body_timeout = body_timeout
        self._max_workers = max_workers
        #: Shared-memory regions of workers on this machine, by id (stratagem.ps.shm).
        self.regions: dict[str, _Region] = {}
        self._lock = threading.Lock()
        self.pushes = 0  # served through a region (health: the path is in use)
        self.bells = 0  # doorbell threads serving a region (shm.Bell), under _lock
        #: The pipes those threads hold open (st_dev, st_ino), under _lock: a pipe may serve
        #: one doorbell only (see shm.open_bell).
        self._bell_fifos: set[shm.FifoId] = set()
        #: Pushes served by doorbell threads at once: at most as many as tensor threads.
        self._bell_slots = threading.BoundedSemaphore(max_workers)
        service.add_op("shm_attach", self.attach)
        service.add_op("shm_push", self.push, inline_cost=self._push_cost)
        service.add_op("shm_detach", self.detach)
        service.health_fields.append(lambda: {
            "shm_regions": len(self.regions), "shm_pushes": self.pushes,
            "shm_bells": self.bells})

    @property
    def _where(self) -> str:
        return f"parameter-server shard {self.service.address}"

    def _push_cost(self, msg: Message) -> int:
        """A ``shm_push`` touches at most its region's bytes (copied out and in)."""
        rid = msg.fields.get("region")
        region = self.regions.get(rid) if isinstance(rid, str) else None
        return region.layout.size if region is not None else 0

    # -- regions ----------------------------------------------------------------------------

    def attach(self, msg: Message) -> bytes:
        """Map a worker's region (:func:`stratagem.ps.shm.open_region` checks it); answers its
        id. The layout is computed here from this shard's own tensors and the pushed dtypes
        the worker declares, so the region's size is bounded by what is registered."""
        svc, f = self.service, msg.fields
        declared = f.get("entries")
        nonce_hex = f.get("nonce")
        if (not isinstance(declared, list) or not declared
                or len(declared) > svc.limits.max_tensors
                or not all(isinstance(d, list) and len(d) == 2 and isinstance(d[0], str)
                           and isinstance(d[1], str) for d in declared)):
            raise _err(f"shm_attach needs 'entries': a list of 1 to {svc.limits.max_tensors} "
                       "[name, pushed dtype] pairs")
        if not isinstance(nonce_hex, str) or len(nonce_hex) != 2 * shm.NONCE_BYTES:
            raise _err(f"shm_attach needs 'nonce': {2 * shm.NONCE_BYTES} hex digits")
        try:
            nonce = bytes.fromhex(nonce_hex)
        except ValueError:
            raise _err("shm_attach: 'nonce' is not hex") from None
        names = [d[0] for d in declared]
        if len(set(names)) != len(names):
            raise _err(f"shm_attach: tensor {first_repeat(names)!r} is declared twice")
        entries = []
        for name, dtype_name in declared:
            slot = svc.slot(name)
            dtype = wire.DTYPES.get(dtype_name)
            if dtype is None or not dtype.is_floating_point:
                raise _err(f"shm_attach: pushed dtype {dtype_name!r} of {name!r} is not a "
                           "floating-point wire dtype")
            entries.append((name, dtype, slot.value.dtype, tuple(slot.value.shape)))
        lay = shm.layout(entries)
        size, pid, fd = f.get("size"), f.get("pid"), f.get("fd")
        if not (isinstance(pid, int) and isinstance(fd, int)):
            raise _err(f"shm_attach needs integers 'pid' and 'fd', got pid={str(pid)[:20]} "
                       f"fd={str(fd)[:20]}")
        if size != lay.size:
            raise _err(f"shm_attach: the region declares {size!r} bytes, the layout of its "
                       f"tensors on this shard needs {lay.size}; every worker must build the "
                       "same model (and use the same stratagem)")
        with self._lock:
            self._purge()
            if len(self.regions) >= MAX_REGIONS:
                raise _err(f"shm_attach: shard {svc.address} already maps {MAX_REGIONS} "
                           "shared-memory regions of live workers; this worker uses gRPC",
                           "RESOURCE_EXHAUSTED")
        started = _process_start(pid)
        try:
            mm = shm.open_region(pid, fd, lay, nonce)
        except shm.RegionRefused as exc:
            # The caller is told one generic sentence; what was wrong with the file (which
            # may be another process's) only goes to this shard's log.
            svc.throttle("shm_attach_refused", logging.WARNING,
                         f"{self._where}: refused a shared-memory region: {exc.detail}")
            raise _err(str(exc), "PERMISSION_DENIED") from None
        bell: tuple[int, int, tuple[shm.FifoId, shm.FifoId]] | None = None
        if f.get("bell") is not None and shm.bell_enabled() and self.bells < MAX_REGIONS:
            try:
                bell = shm.open_bell(pid, f.get("bell"), nonce, self._held_fifos())
            except shm.RegionRefused as exc:  # the region stands; its steps go over gRPC
                svc.throttle("shm_bell", logging.INFO,
                             f"{self._where}: no doorbell for a region: {exc}")
        grads, values = shm.views(mm, lay)
        region = _Region(pid, lay, grads, values, started)
        region_id = secrets.token_hex(16)
        with self._lock:
            self.regions[region_id] = region
            # Doorbells are bounded too, and a pipe serves one of them (checked again here:
            # another attach may have taken it since open_bell looked).
            if bell is not None and (self.bells >= MAX_REGIONS
                                     or set(bell[2]) & self._bell_fifos):
                os.close(bell[0])
                os.close(bell[1])
                bell = None
            if bell is not None:
                region.fifos = bell[2]
                self._bell_fifos.update(bell[2])
                self.bells += 1
        if bell is not None:
            try:
                threading.Thread(target=self._bell_loop,
                                 args=(region_id, region, bell[0], bell[1]),
                                 name=f"stratagem-ps-bell-{region_id[:8]}",
                                 daemon=True).start()
            except BaseException:
                os.close(bell[0])
                os.close(bell[1])
                with self._lock:
                    self.bells -= 1
                    self._bell_fifos.difference_update(region.fifos)
                    region.fifos = ()
                bell = None
        return wire.encode("ok", {"region": region_id, "bell": bell is not None})

    def detach(self, msg: Message) -> bytes:
        rid = msg.fields.get("region")
        with self._lock:
            gone = self.regions.pop(rid, None) if isinstance(rid, str) else None
        return wire.encode("ok", {"detached": gone is not None})

    def _held_fifos(self) -> set[shm.FifoId]:
        """The pipes of the doorbells this shard holds open (until their threads end)."""
        with self._lock:
            return set(self._bell_fifos)

    def _purge(self) -> None:
        """Forget the regions of workers that are gone (caller holds ``_lock``): a worker
        that died never detached; its memory is freed once nothing maps it, and its doorbell
        thread (if any) ends when it next looks (within _BELL_IDLE_SECONDS)."""
        for rid, region in list(self.regions.items()):
            if not _alive(region):
                del self.regions[rid]

    def reap(self) -> None:
        """Drop the regions of dead workers, whether or not their doorbells are busy (a
        doorbell only checks its worker when idle, and a new attach only purges when it
        comes): the shard's timer calls this every :data:`REAP_SECONDS`."""
        if self.regions:
            with self._lock:
                self._purge()

    def _region(self, fields: dict[str, Any]) -> _Region:
        rid = fields.get("region")
        region = self.regions.get(rid) if isinstance(rid, str) else None
        if region is None:
            raise _err(f"unknown shared-memory region {str(rid)[:40]!r} on shard "
                       f"{self.service.address} (detached, or the shard restarted); the "
                       "worker falls back to gRPC", "FAILED_PRECONDITION")
        return region

    def push(self, msg: Message) -> bytes:
        """A push (and fetch) whose tensors are in the caller's region: the gradients are
        copied out of it first (the worker may write the region at any time; what is checked
        must be what is applied), then checked and applied exactly as a gRPC push, and the
        values after it written into the region under the tensors' locks."""
        svc = self.service
        region = self._region(msg.fields)
        max_staleness = field_int(msg.fields, "max_staleness")
        pushed = msg.fields.get("push")
        if not isinstance(pushed, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and _is_int(p[1])
                for p in pushed):
            raise _err("shm_push needs 'push': a list of [name, base version] pairs")
        names = [p[0] for p in pushed]
        if len(set(names)) != len(names):
            raise _err(f"shm_push: tensor {first_repeat(names)!r} is pushed twice")
        fetch = field_names(msg.fields, "fetch") or []
        for n in (*names, *fetch):
            if n not in region.grads:
                raise _err(f"shm_push: {n!r} is not in this region's layout",
                           "FAILED_PRECONDITION")
        entries = [Entry(n, region.grads[n].clone(), base) for n, base in pushed]
        checked = svc.check_push(entries)
        wanted = [svc.slot(n) for n in fetch]
        for s in wanted:
            if s.value.shape != region.values[s.name].shape or (
                    s.value.dtype != region.values[s.name].dtype):
                raise _err(f"shm_push: {s.name!r} changed shape or dtype since the region was "
                           "attached", "FAILED_PRECONDITION")
        results = svc.apply_push(checked, max_staleness)
        versions: dict[str, int] = {}
        with locked(wanted):
            for s in wanted:
                region.values[s.name].copy_(s.value)
                versions[s.name] = s.version
        self.pushes += 1
        return wire.encode("pushed", {"results": results, "versions": versions})

    # -- doorbells --------------------------------------------------------------------------

    def _bell_loop(self, rid: str, region: _Region, rfd: int, wfd: int) -> None:
        """Serve one region's doorbell (:class:`stratagem.ps.shm.Bell`) until its worker
        closes it, the region is detached or the shard stops: each request must be a
        ``shm_push`` of this region and is answered as the gRPC call would be (a refusal as
        a ``refused`` message with the gRPC status name). A request must arrive whole within
        ``body_timeout`` of its first byte and its answer be read as fast; a channel that
        breaks either rule, or the protocol, is closed (the worker then uses gRPC). A
        message that is not such a request closes the channel unanswered and detaches the
        region (:meth:`_bell_request`)."""
        svc = self.service

        def wanted() -> bool:
            return not svc.stopped.is_set() and self.regions.get(rid) is region

        def drop() -> None:
            with self._lock:
                if self.regions.get(rid) is region:
                    del self.regions[rid]

        try:
            while wanted():
                if not shm.bell_wait(rfd, _BELL_IDLE_SECONDS):
                    # Nothing to serve for a while: is its worker still there? (A busy
                    # doorbell is checked by the shard's timer, reap.)
                    if not _alive(region):
                        raise shm.BellClosed("the worker is gone")
                    continue
                if not wanted():  # stopped, or detached, while waiting: serve nothing more
                    break
                body = shm.bell_receive(rfd, time.monotonic() + self.body_timeout, wanted)
                msg = self._bell_request(rid, body)  # anything else: closed, unanswered
                del body
                if not self._bell_slots.acquire(timeout=self.body_timeout):
                    reply = wire.encode("refused", {
                        "status": "UNAVAILABLE", "detail": f"shard {svc.address} is busy: "
                        f"{self._max_workers} pushes in progress for {self.body_timeout:g} s"})
                else:
                    try:
                        reply = (self._bell_serve(msg) if wanted() else wire.encode(
                            "refused", {"status": "UNAVAILABLE",
                                        "detail": "the shard is stopping"}))
                    finally:
                        self._bell_slots.release()
                del msg
                shm.bell_send(wfd, reply, time.monotonic() + self.body_timeout, wanted)
        except shm.BellClosed:  # the worker closed its end (detached, or it died)
            drop()
        except _NotARequest as exc:  # not answered: a refusal could feed a crossed pipe
            drop()
            svc.throttle("shm_bell_not_a_request", logging.WARNING,
                         f"{self._where}: closed a region's doorbell and detached the region, "
                         f"unanswered: {exc}")
        except shm.BellTimeout as exc:  # a body or a reply stuck: the channel is closed
            svc.throttle("shm_bell_stuck", logging.WARNING,
                         f"{self._where}: closed a region's doorbell ({exc} within "
                         f"body_timeout={self.body_timeout:g} s); that worker uses gRPC")
        except OSError as exc:  # the pipes failed otherwise: that worker falls back to gRPC
            svc.throttle("shm_bell_error", logging.WARNING,
                         f"{self._where}: closed a region's doorbell: {exc}")
        finally:
            os.close(rfd)
            os.close(wfd)
            with self._lock:
                self.bells -= 1
                self._bell_fifos.difference_update(region.fifos)

    def _bell_request(self, rid: str, body: bytes) -> Message:
        """``body`` decoded, if it is a request a doorbell carries: a ``shm_push`` of region
        ``rid`` with no tensors. Anything else (a reply, another op, another region's push,
        bytes that do not decode) raises :class:`_NotARequest`: answering it with a refusal
        would write into a pipe that may be another doorbell's request pipe."""
        try:
            msg = self.service.decode(body)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is not a request
            raise _NotARequest(f"a message that does not decode ({str(exc)[:120]})") from None
        if msg.op != "shm_push" or msg.fields.get("region") != rid or msg.entries:
            raise _NotARequest(f"a doorbell carries only its own region's shm_push, got "
                               f"{msg.op[:40]!r}")
        return msg

    def _bell_serve(self, msg: Message) -> bytes:
        """One doorbell request (checked by :meth:`_bell_request`), served as the gRPC
        transport serves a call (refusals and failures as ``refused``)."""
        try:
            return self.push(msg)
        except Exception as exc:  # noqa: BLE001 - a shard must survive any single request
            failure = self.service.refusal(exc)
        return wire.encode("refused", {"status": failure.status, "detail": failure.detail})
