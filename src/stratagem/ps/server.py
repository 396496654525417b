"""A parameter-server shard: tensors, their optimizers and versions, served over gRPC.

Lineage: TensorFlow's ``ps`` job, ``SyncReplicasOptimizer`` (aggregate ``replicas_to_aggregate``
gradients of the current step, drop late ones), ``DropStaleGradientOptimizer`` (drop gradients
more than ``max_staleness`` versions old), and Downpour SGD (Dean et al. 2012: asynchronous
workers push gradients and fetch parameters, the shard applies each gradient as it arrives).
The elastic exchange is asynchronous EASGD (Zhang, Choromanska, LeCun 2015): for a worker's
``x`` and moving rate ``a`` the shard does ``d = x - center; center += a * d`` and returns ``d``.

Each tensor has its own lock, optimizer and version counter, so pushes to different tensors run
concurrently. Operations (the ``op`` of a :mod:`stratagem.ps.wire` message): ``health``,
``register``, ``pull``, ``pull_rows``, ``push``, ``push_sparse``, ``wait_version``, ``elastic``,
``set_hyperparams``, ``get_state``, ``set_state``, ``shutdown``.

Run one shard as a process with ``python -m stratagem.ps.server --host H --port P
[--port-file PATH]``; it exits 0 on SIGTERM/SIGINT or a ``shutdown`` call.
"""

from __future__ import annotations

import argparse
import functools
import hmac
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch

from stratagem.ps import optim as ps_optim
from stratagem.ps import wire
from stratagem.ps.wire import Entry, Message, WireError

__all__ = ["ShardServer", "serve", "start_local_shards", "main"]

log = logging.getLogger(__name__)

_MODES = ("async", "sync", "elastic")
_ALL_INTERFACES = ("0.0.0.0", "::", "", "[::]")


def _read(data: bytes | str | os.PathLike[str] | None) -> bytes | None:
    if data is None or isinstance(data, bytes):
        return data
    return Path(data).read_bytes()


@dataclass
class _Slot:
    """One tensor on this shard with everything that changes it."""

    name: str
    value: torch.Tensor
    mode: str
    spec: dict[str, Any] | None
    optimizer: torch.optim.Optimizer | None
    replicas_to_aggregate: int = 1
    version: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    acc: torch.Tensor | None = None  # sync mode: sum of this version's gradients
    acc_count: int = 0
    dropped: int = 0
    #: Plain SGD (no momentum, weight decay or maximize): its learning rate, for the fast
    #: path in ``_apply`` (the same single ``add_`` torch's SGD does, minus ~75 us of
    #: optimizer-framework overhead per call, a tenth of a push of 8 MB in 10 tensors).
    sgd_lr: float | None = None

    def bump(self) -> None:
        self.version += 1
        self.acc, self.acc_count = None, 0


def _err(message: str, status: str = "INVALID_ARGUMENT") -> WireError:
    return WireError(message, status=status)


def _int(fields: dict[str, Any], key: str, default: int | None = None, *,
         minimum: int | None = 0) -> int | None:
    v = fields.get(key, default)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or (minimum is not None and v < minimum):
        raise _err(f"field {key!r} must be an integer >= {minimum}, got {v!r}")
    return v


def _float(fields: dict[str, Any], key: str, default: float | None = None) -> float:
    v = fields.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        raise _err(f"field {key!r} must be a finite number, got {v!r}")
    return float(v)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _names(fields: dict[str, Any], key: str = "names") -> list[str] | None:
    v = fields.get(key)
    if v is None:
        return None
    if not isinstance(v, list) or not all(isinstance(n, str) for n in v):
        raise _err(f"field {key!r} must be a list of strings")
    return v


class ShardServer:
    """One parameter-server shard.

    Failure behaviour: a malformed, oversize or non-stratagem message (random bytes, a pickle)
    is refused with ``INVALID_ARGUMENT`` or ``RESOURCE_EXHAUSTED``; a missing or wrong token
    with ``UNAUTHENTICATED``; an unknown tensor with ``NOT_FOUND``; a request that contradicts
    the registration (shape, mode) with ``FAILED_PRECONDITION``. None of these affect other
    clients. An unexpected exception is logged and answered with ``INTERNAL``.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 tls_cert: bytes | str | os.PathLike[str] | None = None,
                 tls_key: bytes | str | os.PathLike[str] | None = None,
                 max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
                 max_workers: int = 32, max_wait_seconds: float = 10.0) -> None:
        if token is None:
            token = os.environ.get("STRATAGEM_PS_TOKEN") or None
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both tls_cert and tls_key (PEM); got only one of them")
        self.host, self.port = host, port
        self._token = token.encode() if token else None
        self._tls = (_read(tls_key), _read(tls_cert)) if tls_cert is not None else None
        self.limits = wire.Limits(max_message_bytes=max_message_bytes)
        self._max_workers = max_workers
        self.max_wait_seconds = max_wait_seconds
        if host in _ALL_INTERFACES:
            msg = (f"parameter-server shard binding {host!r} listens on every network interface"
                   f"{'' if token else ' without a token (set STRATAGEM_PS_TOKEN)'}; bind "
                   "127.0.0.1 or a specific address unless other machines must connect")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            log.warning(msg)
        self._slots: dict[str, _Slot] = {}
        self._registry_lock = threading.Lock()
        self._versions = threading.Condition()
        self._waiters = 0
        self._stopped = threading.Event()
        self._server: grpc.Server | None = None
        self._started = time.monotonic()
        self._ops: dict[str, Callable[[Message], bytes]] = {
            "health": self._health, "register": self._register, "pull": self._pull,
            "pull_rows": self._pull_rows, "push": self._push, "push_sparse": self._push_sparse,
            "wait_version": self._wait_version, "elastic": self._elastic,
            "set_hyperparams": self._set_hyperparams, "get_state": self._get_state,
            "set_state": self._set_state, "shutdown": self._shutdown,
        }

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def address(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"{host}:{self.port}"

    def start(self) -> int:
        """Start serving; returns the bound port (useful with ``port=0``)."""
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                       thread_name_prefix="stratagem-ps"),
            # so_reuseport=0: a second shard on the same fixed port must fail, not share it.
            options=[*wire.channel_options(self.limits.max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        handler = grpc.unary_unary_rpc_method_handler(self._call)
        service, method = wire.METHOD.strip("/").split("/")
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, {method: handler}),))
        target = f"{self.host if ':' not in self.host else f'[{self.host}]'}:{self.port}"
        try:
            if self._tls is not None:
                port = server.add_secure_port(target, grpc.ssl_server_credentials([self._tls]))
            else:
                port = server.add_insecure_port(target)
        except RuntimeError as exc:
            raise OSError(f"parameter-server shard could not bind {target}: {exc}; "
                          "choose another port or port 0") from None
        if not port:
            raise OSError(f"parameter-server shard could not bind {target}; choose another port "
                          "or port 0")
        _warm_up_optimizers()
        server.start()
        self._server, self.port = server, port
        log.info("parameter-server shard listening on %s", self.address)
        return port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; in-flight calls get ``grace`` seconds to finish."""
        if self._server is not None:
            self._server.stop(grace).wait(timeout=(grace or 0) + 5.0)
        self._stopped.set()
        with self._versions:
            self._versions.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the shard stops (``shutdown`` call or :meth:`stop`); False on timeout."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> ShardServer:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(0)

    # -- dispatch -------------------------------------------------------------------------

    def _authorized(self, context: grpc.ServicerContext) -> bool:
        if self._token is None:
            return True
        for key, value in context.invocation_metadata():
            if key == wire.TOKEN_METADATA_KEY:
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, self._token)
        return False

    def _call(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        # Authenticate before parsing: an unauthenticated peer never reaches the decoder.
        if not self._authorized(context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "missing or wrong parameter-server token; set STRATAGEM_PS_TOKEN (or "
                          "token=) on the worker to the shard's token")
        status, detail = "OK", ""
        try:
            msg = wire.decode(request, self.limits)
            op = self._ops.get(msg.op)
            if op is None:
                raise _err(f"unknown op {msg.op!r}; valid: {sorted(self._ops)}")
            return op(msg)
        except WireError as exc:
            status, detail = exc.status, str(exc)
        except (ValueError, TypeError) as exc:
            status, detail = "INVALID_ARGUMENT", str(exc)
        except Exception as exc:  # noqa: BLE001 - a shard must survive any single request
            log.exception("parameter-server shard: unexpected error")
            status, detail = "INTERNAL", f"{type(exc).__name__}: {exc}"
        context.abort(getattr(grpc.StatusCode, status), detail)
        raise AssertionError("unreachable")  # context.abort raises

    # -- helpers --------------------------------------------------------------------------

    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise _err(f"tensor {name!r} is not registered on shard {self.address}; "
                       "register it first", "NOT_FOUND")
        return slot

    def _select(self, names: list[str] | None) -> list[_Slot]:
        if names is None:
            return [self._slots[k] for k in sorted(self._slots)]
        return [self._slot(n) for n in names]

    def _snapshot(self, slots: Sequence[_Slot], op: str = "values",
                  fields: dict[str, Any] | None = None) -> bytes:
        """Encode the values of ``slots`` as one consistent snapshot."""
        # The given slots' own locks (a slot replaced by set_state meanwhile keeps its lock), in
        # a fixed order: no deadlock.
        unique = sorted({id(s): s for s in slots}.values(), key=lambda s: s.name)
        locks = [s.lock for s in unique]
        for lk in locks:
            lk.acquire()
        try:
            return wire.encode(op, fields, [Entry(s.name, s.value, s.version) for s in slots])
        finally:
            for lk in reversed(locks):
                lk.release()

    def _notify(self) -> None:
        with self._versions:
            self._versions.notify_all()

    def _make_slot(self, name: str, value: torch.Tensor, mode: str, spec: Any,
                   replicas: int) -> _Slot:
        if mode not in _MODES:
            raise _err(f"tensor {name!r}: mode must be one of {_MODES}, got {mode!r}")
        param = torch.nn.Parameter(value.detach().clone(), requires_grad=value.is_floating_point())
        optimizer = None
        if mode != "elastic":
            if spec is None:
                raise _err(f"tensor {name!r}: mode {mode!r} needs an optimizer spec")
            if not param.is_floating_point():
                raise _err(f"tensor {name!r} has dtype {value.dtype}; only floating-point "
                           "tensors can be optimized on a shard")
            optimizer = ps_optim.build_optimizer(spec, param)
        if not isinstance(replicas, int) or replicas < 1:
            raise _err(f"replicas_to_aggregate must be a positive integer, got {replicas!r}")
        return _Slot(name, param.data, mode, spec, optimizer, replicas,
                     sgd_lr=_plain_sgd_lr(spec) if optimizer is not None else None)

    def _grad(self, slot: _Slot, g: torch.Tensor) -> torch.Tensor:
        if tuple(g.shape) != tuple(slot.value.shape):
            raise _err(f"gradient for {slot.name!r} has shape {tuple(g.shape)}, the tensor has "
                       f"{tuple(slot.value.shape)}", "FAILED_PRECONDITION")
        if not g.is_floating_point():
            raise _err(f"gradient for {slot.name!r} has non-float dtype {g.dtype}")
        return g.to(slot.value.dtype)  # upcasts fp16/bf16-compressed gradients

    def _apply(self, slot: _Slot, grad: torch.Tensor) -> None:
        """Run the slot's optimizer on ``grad`` (caller holds ``slot.lock``)."""
        assert slot.optimizer is not None
        if slot.sgd_lr is not None:
            with torch.no_grad():
                slot.value.add_(grad, alpha=-slot.sgd_lr)  # exactly torch's SGD step
            return
        param = slot.optimizer.param_groups[0]["params"][0]
        param.grad = grad
        slot.optimizer.step()
        param.grad = None

    def _offer(self, slot: _Slot, base: int | None, max_staleness: int | None,
               grad: Callable[[], torch.Tensor]) -> list[Any]:
        """Apply (async) or accumulate (sync) one gradient; returns [staleness, status, version].

        ``grad`` builds the gradient lazily so a dropped one costs nothing.
        """
        if slot.mode == "elastic":
            raise _err(f"tensor {slot.name!r} is registered for elastic averaging; it takes "
                       "'elastic' exchanges, not gradient pushes", "FAILED_PRECONDITION")
        if base is None:
            raise _err(f"gradient for {slot.name!r} carries no base version")
        with slot.lock:
            staleness = slot.version - base
            if slot.mode == "async":
                if staleness < 0 or (max_staleness is not None and staleness > max_staleness):
                    slot.dropped += 1
                    status = "dropped"
                else:
                    self._apply(slot, grad())
                    slot.version += 1
                    status = "applied"
            elif staleness != 0:  # sync: only gradients of the current version count
                slot.dropped += 1
                status = "dropped"
            else:
                g = grad()
                if slot.acc is None:
                    slot.acc = g.to(torch.float64 if g.dtype == torch.float64 else torch.float32,
                                    copy=True)
                else:
                    slot.acc.add_(g)
                slot.acc_count += 1
                status = "accumulated"
                if slot.acc_count >= slot.replicas_to_aggregate:
                    # In place: the accumulator is discarded by bump() right after.
                    self._apply(slot, slot.acc.div_(slot.acc_count).to(slot.value.dtype))
                    slot.bump()
                    status = "applied"
            version = slot.version
        if status == "applied":
            self._notify()
        return [staleness, status, version]

    # -- operations -----------------------------------------------------------------------

    def _health(self, msg: Message) -> bytes:
        with self._registry_lock:
            slots = list(self._slots.values())
        return wire.encode("health", {
            "ok": True, "pid": os.getpid(), "num_tensors": len(slots),
            "bytes": sum(s.value.nbytes for s in slots), "dropped": sum(s.dropped for s in slots),
            "uptime_seconds": time.monotonic() - self._started,
            "versions": {s.name: s.version for s in slots},
            # As a request handler sees it: the width of each optimizer step (see serve()).
            "intra_op_threads": torch.get_num_threads(),
        })

    def _register(self, msg: Message) -> bytes:
        specs = msg.fields.get("specs", [])
        meta = msg.fields.get("entries")
        if not isinstance(specs, list) or not isinstance(meta, list) or len(meta) != len(
                msg.entries):
            raise _err("register needs fields 'specs' (list) and 'entries' (one per tensor)")
        created: list[str] = []
        with self._registry_lock:  # whole registration is atomic: first registration wins
            for e, m in zip(msg.entries, meta, strict=True):
                if not isinstance(m, dict):
                    raise _err("register: each entry must be an object")
                old = self._slots.get(e.name)
                if old is not None:
                    if old.value.shape != e.tensor.shape or old.value.dtype != e.tensor.dtype:
                        raise _err(
                            f"tensor {e.name!r} is registered with shape "
                            f"{tuple(old.value.shape)} {old.value.dtype}, this worker has "
                            f"{tuple(e.tensor.shape)} {e.tensor.dtype}; every worker must "
                            "build the same model", "FAILED_PRECONDITION")
                    continue
                idx = m.get("spec")
                spec = None
                if idx is not None:
                    if not isinstance(idx, int) or not 0 <= idx < len(specs):
                        raise _err(f"register: bad spec index {idx!r}")
                    spec = specs[idx]
                self._slots[e.name] = self._make_slot(
                    e.name, e.tensor, m.get("mode", "async"), spec,
                    m.get("replicas_to_aggregate", 1))
                created.append(e.name)
            slots = [self._slots[e.name] for e in msg.entries]
        return self._snapshot(slots, "register", {"created": created})

    def _pull(self, msg: Message) -> bytes:
        return self._snapshot(self._select(_names(msg.fields)))

    def _pull_rows(self, msg: Message) -> bytes:
        name = msg.fields.get("name")
        slot = self._slot(name if isinstance(name, str) else "")
        idx = msg.tensors().get("indices")
        if idx is None or idx.dtype != torch.int64 or idx.dim() != 1 or slot.value.dim() < 1:
            raise _err("pull_rows needs a 1-D int64 tensor 'indices' and a tensor with dim >= 1")
        rows = slot.value.shape[0]
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= rows):
            raise _err(f"pull_rows: indices must be in [0, {rows}) for {name!r}")
        with slot.lock:
            out = slot.value.index_select(0, idx)
            version = slot.version
        return wire.encode("rows", None, [Entry(slot.name, out, version)])

    def _push(self, msg: Message) -> bytes:
        max_staleness = _int(msg.fields, "max_staleness")
        fetch = _names(msg.fields, "fetch")
        wanted = [self._slot(n) for n in fetch] if fetch is not None else []
        results = []
        for e in msg.entries:
            slot = self._slot(e.name)
            results.append(self._offer(slot, e.version, max_staleness,
                                       functools.partial(self._grad, slot, e.tensor)))
        if fetch is None:
            return wire.encode("pushed", {"results": results})
        # Push and fetch in one round trip (a Downpour step): the values after this push.
        return self._snapshot(wanted, "pushed", {"results": results})

    def _push_sparse(self, msg: Message) -> bytes:
        name = msg.fields.get("name")
        slot = self._slot(name if isinstance(name, str) else "")
        t = msg.tensors()
        idx, values = t.get("indices"), t.get("values")
        shape = tuple(slot.value.shape)
        if (idx is None or values is None or idx.dtype != torch.int64 or idx.dim() != 1
                or len(shape) < 1 or tuple(values.shape) != (idx.numel(), *shape[1:])):
            raise _err(f"push_sparse for {name!r} needs 1-D int64 'indices' (n,) and 'values' "
                       f"of shape (n, *{shape[1:]})")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= shape[0]):
            raise _err(f"push_sparse: indices must be in [0, {shape[0]}) for {name!r}")
        base = next(e.version for e in msg.entries if e.name == "values")
        sparse = slot.mode == "async" and slot.spec is not None and ps_optim.supports_sparse(
            slot.spec)

        def grad() -> torch.Tensor:
            v = values.to(slot.value.dtype)
            if sparse:
                return torch.sparse_coo_tensor(idx.unsqueeze(0), v, shape,
                                               check_invariants=True).coalesce()
            # Exactly the gradient a dense backward through the embedding would produce.
            return torch.zeros(shape, dtype=slot.value.dtype).index_add_(0, idx, v)

        result = self._offer(slot, base, _int(msg.fields, "max_staleness"), grad)
        return wire.encode("pushed", {"results": [result]})

    def _wait_version(self, msg: Message) -> bytes:
        target = _int(msg.fields, "min_version", 0) or 0
        per_name = msg.fields.get("min_versions")
        if per_name is not None and (not isinstance(per_name, dict) or not all(
                _is_int(v) for v in per_name.values())):
            raise _err("field 'min_versions' must be an object of name -> integer")
        timeout = min(_float(msg.fields, "timeout", 60.0), self.max_wait_seconds)
        slots = self._select(_names(msg.fields))
        fetch = _names(msg.fields, "fetch")
        goals = [(s, max(target, int((per_name or {}).get(s.name, 0)))) for s in slots]

        def reached() -> bool:
            return all(s.version >= goal for s, goal in goals)

        with self._versions:
            # Waiters hold server threads; past half the pool, answer "not yet" quickly so the
            # pushes that would end the wait still find a thread (the client polls again).
            if self._waiters >= self._max_workers // 2:
                timeout = min(timeout, 0.05)
            self._waiters += 1
            try:
                self._versions.wait_for(lambda: self._stopped.is_set() or reached(),
                                        timeout=max(0.0, timeout))
            finally:
                self._waiters -= 1
        # Values only for ``fetch`` (all by default): a caller that reads sparse rows on demand
        # needs the versions of an embedding, not its megabytes.
        wanted = slots if fetch is None else [self._slot(n) for n in fetch]
        return self._snapshot(wanted, "values", {
            "reached": reached(), "versions": {s.name: s.version for s in slots}})

    def _elastic(self, msg: Message) -> bytes:
        a = _float(msg.fields, "moving_rate")
        if not 0.0 < a <= 1.0:
            raise _err(f"moving_rate must be in (0, 1], got {a}")
        out = []
        for e in msg.entries:
            slot = self._slot(e.name)
            if slot.mode != "elastic":
                raise _err(f"tensor {e.name!r} is registered in mode {slot.mode!r}, not "
                           "'elastic'", "FAILED_PRECONDITION")
            x = self._grad(slot, e.tensor)
            with slot.lock:
                d = x - slot.value
                slot.value.add_(d, alpha=a)
                slot.version += 1
                out.append(Entry(e.name, d, slot.version))
        self._notify()
        return wire.encode("elastic", None, out)

    def _set_hyperparams(self, msg: Message) -> bytes:
        hyper = msg.fields.get("hyperparams")
        if not isinstance(hyper, dict):
            raise _err("set_hyperparams needs a 'hyperparams' object")
        changed = 0
        for slot in self._select(_names(msg.fields)):
            if slot.optimizer is None or slot.spec is None:
                continue
            spec = {**slot.spec, **hyper}
            ps_optim.validate_spec(spec)
            with slot.lock:
                slot.spec = spec
                slot.sgd_lr = _plain_sgd_lr(spec)
                group = slot.optimizer.param_groups[0]
                for k, v in hyper.items():
                    group[k] = tuple(v) if isinstance(v, list) else v
            changed += 1
        return wire.encode("ok", {"changed": changed})

    def _get_state(self, msg: Message) -> bytes:
        slots = self._select(_names(msg.fields))
        entries: list[Entry] = []
        metas: list[dict[str, Any]] = []
        for slot in slots:
            with slot.lock:
                meta: dict[str, Any] = {
                    "name": slot.name, "version": slot.version, "mode": slot.mode,
                    "spec": slot.spec, "replicas_to_aggregate": slot.replicas_to_aggregate,
                    "param": len(entries), "opt": {}, "scalars": {}}
                entries.append(Entry(slot.name, slot.value.clone(), slot.version))
                if slot.optimizer is not None:
                    state = slot.optimizer.state_dict()["state"].get(0, {})
                    for k, v in state.items():
                        if isinstance(v, torch.Tensor):
                            meta["opt"][k] = len(entries)
                            entries.append(Entry(f"{slot.name}.{k}", v.clone()))
                        elif isinstance(v, (int, float, bool)):
                            meta["scalars"][k] = v
                metas.append(meta)
        return wire.encode("state", {"slots": metas}, entries)

    def _set_state(self, msg: Message) -> bytes:
        metas = msg.fields.get("slots")
        if not isinstance(metas, list):
            raise _err("set_state needs a 'slots' list")
        n = len(msg.entries)
        new: list[_Slot] = []
        for m in metas:
            if not isinstance(m, dict) or not isinstance(m.get("name"), str):
                raise _err("set_state: each slot must be an object with a 'name'")
            pi = m.get("param")
            if not isinstance(pi, int) or not 0 <= pi < n:
                raise _err(f"set_state: bad param index {pi!r} for {m['name']!r}")
            slot = self._make_slot(m["name"], msg.entries[pi].tensor, m.get("mode", "async"),
                                   m.get("spec"), m.get("replicas_to_aggregate", 1))
            slot.version = _int(m, "version", 0) or 0
            opt, scalars = m.get("opt", {}), m.get("scalars", {})
            if not isinstance(opt, dict) or not isinstance(scalars, dict):
                raise _err("set_state: 'opt' and 'scalars' must be objects")
            if slot.optimizer is not None and (opt or scalars):
                state: dict[str, Any] = dict(scalars)
                for k, i in opt.items():
                    if not isinstance(i, int) or not 0 <= i < n:
                        raise _err(f"set_state: bad optimizer-state index {i!r}")
                    state[k] = msg.entries[i].tensor.clone()
                group = {**slot.optimizer.param_groups[0]}
                group["params"] = [0]
                slot.optimizer.load_state_dict({"state": {0: state}, "param_groups": [group]})
            new.append(slot)
        with self._registry_lock:
            for slot in new:
                self._slots[slot.name] = slot
        self._notify()
        return wire.encode("ok", {"restored": [s.name for s in new]})

    def _shutdown(self, msg: Message) -> bytes:
        # Stop from another thread: stopping inside a handler would wait on this very call.
        threading.Thread(target=self.stop, args=(0.5,), daemon=True).start()
        return wire.encode("ok", {"stopping": True})


def _plain_sgd_lr(spec: dict[str, Any] | None) -> float | None:
    if spec is None or str(spec.get("name", "")).lower() != "sgd":
        return None
    if spec.get("momentum") or spec.get("weight_decay") or spec.get("maximize"):
        return None
    lr = spec.get("lr", 1e-3)
    return float(lr) if isinstance(lr, (int, float)) and not isinstance(lr, bool) else None


def _warm_up_optimizers() -> None:
    """Take one optimizer step now: torch's first one imports lazily for ~1 s, which would
    otherwise land inside a worker's first (deadline-bound) registration."""
    p = torch.nn.Parameter(torch.zeros(1))
    p.grad = torch.zeros(1)
    torch.optim.SGD([p], lr=0.0).step()


def start_local_shards(num_shards: int, **kwargs: Any) -> tuple[list[ShardServer], list[str]]:
    """Start ``num_shards`` in-process shards on 127.0.0.1, free ports; returns (servers, addrs).

    Stop them with ``for s in servers: s.stop(0)``. In-process shards share the caller's
    torch intra-op threads; for throughput run each shard in a process of its own
    (:func:`serve`, ``python -m stratagem.ps.server``).
    """
    servers = [ShardServer("127.0.0.1", 0, **kwargs) for _ in range(num_shards)]
    for s in servers:
        s.start()
    return servers, [s.address for s in servers]


def serve(host: str = "127.0.0.1", port: int = 0, *, port_file: str | os.PathLike[str] | None
          = None, grace: float = 2.0, intra_op_threads: int | None = 1,
          parent_pid: int | None = None, **kwargs: Any) -> int:
    """Run one shard until SIGTERM/SIGINT or a ``shutdown`` call; returns the bound port.

    With ``port_file`` the bound port is written there (atomically) once the shard listens,
    so a launcher can pass ``port=0`` and learn the port. Tunes malloc for big messages
    (:func:`stratagem.ps.wire.tune_malloc`) and sets torch's intra-op threads to
    ``intra_op_threads`` (``None``: leave torch's default): call it in a process of its own.

    Why one intra-op thread: a shard's parallelism is across requests (the gRPC thread pool,
    per-tensor locks), and its tensor work is memory-bound elementwise optimizer steps on a
    few MB. With torch's default (an OpenMP team as wide as the machine) every push was split
    across all cores and the team's threads then spin-waited for the next step, burning the
    cores the gRPC threads, the other shards and the workers need: on 2 cores a 4 MB SGD step
    took 0.3-7 ms and 2 shards with 1 worker reached 0.26-0.45 of raw gRPC throughput (0.7-0.9
    with one thread, or with ``OMP_WAIT_POLICY=passive``). Raise it only for a shard alone on
    a big machine with few huge tensors and heavy optimizers.
    """
    if intra_op_threads is not None and (not _is_int(intra_op_threads) or intra_op_threads < 1):
        raise ValueError(f"intra_op_threads must be None or an integer >= 1, got "
                         f"{intra_op_threads!r}")
    wire.tune_malloc()
    if intra_op_threads is not None:
        torch.set_num_threads(intra_op_threads)
    server = ShardServer(host, port, **kwargs)
    bound = server.start()
    if port_file is not None:
        tmp = Path(f"{port_file}.tmp{os.getpid()}")
        tmp.write_text(f"{bound}\n")
        os.replace(tmp, port_file)
    stop = threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        # Short waits so the main thread gets to run signal handlers promptly. With
        # parent_pid (set by the launcher) the shard also stops when its launcher is gone, e.g.
        # SIGKILLed: a shard must never outlive the job as an orphan.
        while not stop.is_set() and not server.wait(0.2):
            if parent_pid is not None and os.getppid() != parent_pid:
                log.warning("launcher (pid %d) is gone; stopping the shard", parent_pid)
                break
    finally:
        server.stop(grace)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return bound


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m stratagem.ps.server",
                                description="Run one stratagem parameter-server shard.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--max-message-bytes", type=int, default=wire.DEFAULT_MAX_MESSAGE_BYTES)
    p.add_argument("--intra-op-threads", type=int, default=1,
                   help="torch intra-op threads per optimizer step (default 1: the shard "
                        "parallelises across requests; 0 keeps torch's default)")
    p.add_argument("--parent-pid", type=int, default=None,
                   help="stop when this process (the launcher) is no longer our parent")
    args = p.parse_args(argv)
    if args.intra_op_threads < 0:
        p.error(f"--intra-op-threads must be >= 0, got {args.intra_op_threads}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    serve(args.host, args.port, port_file=args.port_file, tls_cert=args.tls_cert,
          tls_key=args.tls_key, max_message_bytes=args.max_message_bytes,
          intra_op_threads=args.intra_op_threads or None, parent_pid=args.parent_pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
