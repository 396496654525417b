"""``python -m stratagem._torchrun ARGS``: torchrun whose static-rendezvous store listens on
``--master-addr`` only — loopback for single-node jobs (issue 10), node 0's address on the
private network for multi-node jobs (issue 12); how and why in :mod:`stratagem._rendezvous`.
``stratagem run`` starts every static-rendezvous job with it.

A module of its own, never imported by the package, so ``python -m`` runs it fresh.
"""

from __future__ import annotations

import sys

from stratagem._rendezvous import torchrun_main

if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    torchrun_main()
