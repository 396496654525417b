"""``PSLink``: one worker's connection to the parameter-server shards, as a strategy holds it.

Both strategies that keep state on shards (``ParameterServer``: Downpour SGD and synchronous
replicas; ``ElasticAveraging(mode="async")``: the EASGD center) need the same plumbing around
the transport: where the shards are (``ps_addresses`` or ``STRATAGEM_PS_ADDRS``), connecting
with the job's token once the first model is prepared (the shards may start after the
workers), tables of tensors on them, the shard traffic counted in the worker's ``Comm``
(``bytes_sent`` and co. cover every byte a worker moves, collective or RPC), the
``ps_bytes_*`` metrics and closing. This is that plumbing, once.

grpc is imported on :meth:`PSLink.connect`, not with this module: strategies import it at
start-up, and a job without shards must not pay for (or need) grpc.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from stratagem.comm import Comm
from stratagem.validation import check_timeout

if TYPE_CHECKING:
    from stratagem.ps.table import ShardedParameters
    from stratagem.ps.transport import PSClient

__all__ = ["PSLink"]


class PSLink:
    """The shards at ``addresses`` (as :func:`stratagem.ps.addresses.shard_addresses` returns
    them; empty for a strategy in a mode that uses no shards), connected on first use with
    ``timeout`` as every call's deadline and ``token`` (default: ``STRATAGEM_PS_TOKEN`` /
    ``STRATAGEM_PS_TOKEN_FILE``, see :func:`stratagem.ps.auth.resolve_token`). Shard traffic
    is counted in ``comm``.

    On failure: :meth:`connect` raises ``ParameterServerUnavailable`` naming the shard that
    did not answer within ``timeout``; calls through the tables raise as
    :class:`~stratagem.ps.transport.PSClient` does.
    """

    def __init__(self, addresses: Sequence[str], *, comm: Comm, timeout: float,
                 token: str | None = None) -> None:
        check_timeout("timeout", timeout)
        self.addresses = list(addresses)
        self.comm = comm
        self.timeout = float(timeout)
        self._token = token
        self._client: PSClient | None = None

    @property
    def connected(self) -> bool:
        return self._client is not None

    def connect(self) -> PSClient:
        """The client, connecting first (and waiting up to ``timeout`` for every shard to
        answer: shards may start after the workers)."""
        if self._client is None:
            if not self.addresses:
                raise ValueError("this PSLink has no shard addresses (its strategy runs in a "
                                 "mode without parameter servers); pass ps_addresses")
            from stratagem.ps.transport import PSClient

            client = PSClient(self.addresses, token=self._token, timeout=self.timeout)
            try:
                client.wait_ready(timeout=self.timeout)
            except BaseException:
                client.close()
                raise
            self._client = client
        return self._client

    def table(self, params: Mapping[str, torch.Tensor], **options: Any) -> ShardedParameters:
        """A :class:`~stratagem.ps.table.ShardedParameters` of ``params`` on these shards
        (``options`` are its keyword arguments: mode, optimizer specs, placement...)."""
        from stratagem.ps.table import ShardedParameters

        return ShardedParameters(self.connect(), params, **options)

    def fold_bytes(self) -> None:
        """Count the shard traffic since the last call in ``comm`` (bytes both ways, seconds),
        so a strategy's ``bytes_sent`` covers its RPCs as well as its collectives."""
        if self._client is not None:
            self.comm.account(*self._client.stats_delta())

    def metrics(self) -> dict[str, Any]:
        """``ps_bytes_sent`` / ``ps_bytes_received`` since connecting (empty before)."""
        if self._client is None:
            return {}
        s = self._client.stats()
        return {"ps_bytes_sent": s["bytes_sent"], "ps_bytes_received": s["bytes_received"]}

    def close(self) -> None:
        """Close the channels (idempotent); the link connects again if used afterwards."""
        client, self._client = self._client, None
        if client is not None:
            client.close()
