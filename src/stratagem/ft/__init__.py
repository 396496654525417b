"""Fault-tolerant synchronous training on torchft: jobs that keep training through
lost replicas and heal a returning one live from a peer, with nothing unpickled.

- :mod:`stratagem.ft.comm`: :class:`FaultTolerantComm`, the Comm every part already talks
  to, over torchft's Manager, quorum and reconfigurable process group;
- :mod:`stratagem.ft.transport`: the heal transport (safetensors + strict JSON, token
  authenticated, bounded), in place of torchft's pickling ones;
- :mod:`stratagem.ft.launch`: the quorum service a launcher starts and each worker's Comm.

torchft is an optional dependency (``pip install stratagem[ft]``); importing this package
does not import it.
"""

__all__: list[str] = []
