"""``fit``: the high-level training loop, built on exactly the methods a custom loop uses.

The loop is the one in the README — ``scope``/``prepare`` (unless already prepared),
``distribute_dataset``, ``set_epoch``, ``backward``, ``optimizer.step()``, ``zero_grad()``,
``reduce`` — so ``fit`` and a hand-written loop with the same seed take the same steps and end
with the same parameters under every strategy. On top of that it adds what a custom loop
usually re-implements: per-epoch evaluation of ``strategy.eval_model(model)`` (loss and
accuracy reduced across replicas), Keras-style callbacks (:class:`ModelCheckpoint`,
:class:`EarlyStopping`, :class:`LearningRateScheduler`), resumption from a checkpoint
directory, a rich progress bar on the chief, and CSV / TensorBoard metrics.

Every decision that changes control flow (resume or not, stop early) is agreed across replicas
with a collective, so a callback that decides differently on one replica cannot leave another
waiting in a collective that never comes.

The package is split by concept: ``callbacks`` (the context and the built-in callbacks),
``reporting`` (progress display, CSV, TensorBoard), ``evaluation`` and ``loop`` (``fit`` and
its resume).
"""

from __future__ import annotations

from .callbacks import Callback, EarlyStopping, FitContext, LearningRateScheduler, ModelCheckpoint
from .loop import fit

__all__ = [
    "fit",
    "Callback",
    "FitContext",
    "ModelCheckpoint",
    "EarlyStopping",
    "LearningRateScheduler",
]
