"""The shard's command-line flags, shared by ``stratagem ps`` and ``python -m
stratagem.ps.server``. Kept free of grpc and torch imports so that building the ``stratagem``
parser (``stratagem --help``) stays fast."""

from __future__ import annotations

import argparse

from ..validation import int_argument

__all__ = ["DEFAULT_MAX_BYTES", "DEFAULT_MAX_MESSAGE_BYTES", "add_shard_arguments",
           "nonneg_int"]

#: Default quota on registered tensors plus their optimizer state, per shard.
DEFAULT_MAX_BYTES = 8 << 30
#: Default cap on one request or reply.
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


#: argparse type: an integer >= 0 (``stratagem.validation.int_argument``).
nonneg_int = int_argument(minimum=0)


def add_shard_arguments(p: argparse.ArgumentParser, *, port_required: bool = True) -> None:
    """Address, security and limit flags of one shard (``--port`` defaults to 0, a free
    port, when not required)."""
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (0.0.0.0 or :: to accept other machines: then use "
                        "a token and TLS)")
    p.add_argument("--port", type=nonneg_int, required=port_required, default=0,
                   help="port (0: pick a free one)")
    p.add_argument("--port-file", default=None, help="write the bound port here once listening")
    p.add_argument("--token-file", default=None,
                   help="file holding the shared token (default: the file in env "
                        "STRATAGEM_PS_TOKEN_FILE, then env STRATAGEM_PS_TOKEN); an empty "
                        "token is an error")
    p.add_argument("--tls-cert", default=None, help="PEM certificate (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key (with --tls-cert)")
    p.add_argument("--max-bytes", type=nonneg_int, default=DEFAULT_MAX_BYTES,
                   help="quota on registered tensors plus optimizer state, in bytes "
                        "(default %(default)s = 8 GiB)")
    p.add_argument("--max-message-bytes", type=nonneg_int, default=DEFAULT_MAX_MESSAGE_BYTES,
                   help="largest request or reply in bytes (default %(default)s)")
    p.add_argument("--max-inflight-bytes", type=int_argument(minimum=1024), default=None,
                   help="bound on the request bytes held at once; a request past it is "
                        "refused (default: twice --max-message-bytes)")
    p.add_argument("--max-concurrent-streams", type=nonneg_int, default=32,
                   help="calls one connection may have in flight (default %(default)s)")
    p.add_argument("--max-connection-age", type=float, default=3600.0,
                   help="seconds before a connection is recycled (default %(default)s)")
    p.add_argument("--body-timeout", type=float, default=120.0,
                   help="seconds a request body may take to arrive (default %(default)s)")
    p.add_argument("--threads", type=nonneg_int, default=4,
                   help="threads for tensor work (optimizer steps, encoding; default "
                        "%(default)s)")
    p.add_argument("--intra-op-threads", type=nonneg_int, default=1,
                   help="torch intra-op threads per optimizer step (default 1: the shard "
                        "parallelises across requests; 0 keeps torch's default)")
