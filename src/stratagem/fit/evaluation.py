"""``fit``'s evaluation: each replica scores its own stride of the evaluation set, and the
sums are reduced, so every replica gets the same ``val_loss`` / ``val_accuracy``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..data import move_to_device
from ..strategy import Strategy

if TYPE_CHECKING:
    pass

# ---------------------------------------------------------------------- batches & evaluation
def split_batch(batch: Any) -> tuple[tuple[Any, ...], Any]:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return tuple(batch[:-1]), batch[-1]
    raise TypeError(f"fit expects batches of (inputs..., target), got {type(batch).__name__}"
                    f"{f' of length {len(batch)}' if isinstance(batch, (tuple, list)) else ''}; "
                    "use a tuple of tensors (X, y) or a Dataset whose items are (input, target), "
                    "or write a custom loop")


def num_samples(target: Any) -> int:
    if isinstance(target, torch.Tensor):
        return int(target.shape[0]) if target.dim() > 0 else 1
    return len(target)


def _eval_shard(dataset: Any, replica: int, replicas: int) -> tuple[Any, int]:
    """This replica's stride of the evaluation set (every sample scored exactly once)."""
    if isinstance(dataset, (tuple, list)) and dataset and all(isinstance(t, torch.Tensor)
                                                              for t in dataset):
        return tuple(t[replica::replicas] for t in dataset), len(dataset[0][replica::replicas])
    if isinstance(dataset, torch.utils.data.TensorDataset):
        tensors = tuple(t[replica::replicas] for t in dataset.tensors)
        return tensors, len(tensors[0])
    try:
        n = len(dataset)
    except TypeError as exc:
        raise TypeError(f"eval_dataset must be a tuple of tensors or a map-style Dataset (with "
                        f"__len__), got {type(dataset).__name__}; or pass eval_fn=") from exc
    subset = torch.utils.data.Subset(dataset, range(replica, n, replicas))
    return subset, len(subset)


def _eval_batches(shard: Any, batch_size: int, device: torch.device) -> Iterable[Any]:
    if isinstance(shard, tuple):
        n = len(shard[0])
        for start in range(0, n, batch_size):
            yield move_to_device(tuple(t[start:start + batch_size] for t in shard), device)
        return
    for batch in torch.utils.data.DataLoader(shard, batch_size=batch_size, shuffle=False):
        yield move_to_device(batch, device)


def evaluate(strategy: Strategy, model: nn.Module, loss_fn: Callable[..., Any], dataset: Any,
              batch_size: int) -> dict[str, float]:
    """Loss (and accuracy, for class logits with integer targets) over ``dataset``, each
    replica scoring its own stride, reduced across replicas: identical on every replica."""
    module = strategy.unwrap(strategy.eval_model(model))
    shard, _ = _eval_shard(dataset, strategy.replica_id, strategy.num_replicas_in_sync)
    was_training = module.training
    module.eval()
    loss_sum, count, correct, acc_count = 0.0, 0, 0, 0
    try:
        # The bare module, not the DDP wrapper: DDP's forward may broadcast buffers, a
        # collective that replicas with different numbers of eval batches could not match.
        with torch.no_grad(), strategy.autocast():
            for batch in _eval_batches(shard, batch_size, strategy.device):
                inputs, target = split_batch(batch)
                out = module(*inputs)
                n = num_samples(target)
                loss_sum += float(loss_fn(out, target)) * n  # loss_fn returns the batch mean
                count += n
                if (isinstance(out, torch.Tensor) and isinstance(target, torch.Tensor)
                        and out.is_floating_point() and not target.is_floating_point()
                        and out.dim() == target.dim() + 1 and out.shape[0] == target.shape[0]):
                    correct += int((out.argmax(dim=1) == target).sum())
                    acc_count += int(target.numel())
    finally:
        module.train(was_training)
    totals = strategy.reduce("sum", {"loss": loss_sum, "count": count, "correct": correct,
                                     "acc_count": acc_count})
    logs: dict[str, float] = {}
    if totals["count"] > 0:
        logs["val_loss"] = float(totals["loss"]) / float(totals["count"])
    if totals["acc_count"] > 0:
        logs["val_accuracy"] = float(totals["correct"]) / float(totals["acc_count"])
    return logs
