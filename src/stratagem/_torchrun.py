"""``python -m stratagem._torchrun ARGS``: torchrun whose static-rendezvous store listens on
loopback only when ``--master-addr`` is a loopback address (issue 10; how and why in
:mod:`stratagem._rendezvous`). ``stratagem run`` starts single-node jobs with it.

A module of its own, never imported by the package, so ``python -m`` runs it fresh.
"""

from __future__ import annotations

import sys

from stratagem._rendezvous import torchrun_main

if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    torchrun_main()
