"""Sharded, seeded, per-replica batching: what ``distribute_dataset`` returns.

Every replica computes the same seeded permutation for the epoch and takes its own slice of
each global batch, so no coordination is needed and no sample is seen twice in an epoch
(no duplicate padding). Every replica takes the same number of steps, so an uneven tail can
never leave one replica waiting in a collective for another that has run out of data.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from .context import InputContext
from .validation import check_int

__all__ = ["DistributedLoader", "Inputs", "move_to_device", "skip_first_batches"]


def move_to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` (a tensor, or nested list/tuple/dict of them) on ``device``; on the CPU it
    is returned as is (no copy)."""
    if device.type == "cpu":
        return batch
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: move_to_device(v, device) for k, v in batch.items()}
    return batch


class DistributedLoader:
    """Iterates over this replica's share of each global batch.

    ``len(loader)`` is the number of steps per epoch, identical on every replica. The last,
    partial global batch (``drop_remainder=False``) is split as evenly as possible across the
    replicas; when it holds fewer samples than there are replicas it is dropped, because a
    replica with an empty batch could not take the step. Call ``set_epoch(e)`` before each
    epoch for a new shuffle; ``state_dict()`` / ``load_state_dict()`` resume mid-epoch.
    """

    def __init__(
        self,
        dataset: Dataset[Any] | Sequence[torch.Tensor],
        global_batch_size: int,
        *,
        num_replicas: int,
        replica_id: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = False,
        device: torch.device | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
    ) -> None:
        check_int("global_batch_size", global_batch_size, minimum=1,
                  fix="pass the batch size summed over all replicas, e.g. 64")
        if global_batch_size % num_replicas:
            raise ValueError(
                f"global_batch_size={global_batch_size} is not divisible by the "
                f"{num_replicas} replicas in sync; use a multiple of {num_replicas} "
                f"(e.g. {global_batch_size - global_batch_size % num_replicas or num_replicas})"
            )
        self._tensors: tuple[torch.Tensor, ...] | None = None
        if isinstance(dataset, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in dataset):
            self._tensors = tuple(dataset)
        elif isinstance(dataset, TensorDataset):
            self._tensors = tuple(dataset.tensors)
        if self._tensors is not None:
            sizes = {len(t) for t in self._tensors}
            if len(sizes) != 1:
                raise ValueError(f"tensors of a dataset tuple must have the same length, got {sorted(sizes)}")
            self._n = sizes.pop()
        else:
            try:
                self._n = len(dataset)  # type: ignore[arg-type]
            except TypeError as exc:
                raise TypeError(
                    f"distribute_dataset needs a map-style Dataset (with __len__) or a tuple of "
                    f"tensors, got {type(dataset).__name__}; for an iterable dataset use "
                    "distribute_datasets_from_function"
                ) from exc
        self.dataset = dataset
        self.global_batch_size = global_batch_size
        self.num_replicas = num_replicas
        self.replica_id = replica_id
        self.per_replica_batch_size = global_batch_size // num_replicas
        self.shuffle = shuffle
        self.seed = seed
        self.drop_remainder = drop_remainder
        self.device = device or torch.device("cpu")
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        self.epoch = 0
        self._start_step = 0
        self._resume_at: tuple[int, int] | None = None
        self._adopted: tuple[int, ...] = ()
        self.step_in_epoch = 0
        if self._n < num_replicas:
            raise ValueError(
                f"the dataset holds {self._n} samples, fewer than the {num_replicas} replicas: "
                "some replica would get no samples. Use a larger dataset or fewer workers."
            )
        if len(self) == 0:
            raise ValueError(
                f"the dataset holds {self._n} samples, less than one global batch of "
                f"{global_batch_size}, and drop_remainder=True: every replica would get no "
                "samples. Use a smaller global_batch_size or drop_remainder=False."
            )

    def __len__(self) -> int:
        full, tail = divmod(self._n, self.global_batch_size)
        return full + (1 if tail >= self.num_replicas and not self.drop_remainder else 0)

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (the permutation depends on ``seed`` and ``epoch`` only)."""
        self.epoch = int(epoch)

    def state_dict(self) -> dict[str, int]:
        """The position: the next batch is step ``step_in_epoch`` of ``epoch``. After a heal
        (:meth:`fast_forward`) not yet reached by an iteration, the live peer's position (where
        the next batch comes from): a replica healed at the job's last step never iterates
        again, and the ``set_epoch(0)`` of its epoch loop must not make it report the start."""
        epoch, step = self.epoch, self.step_in_epoch
        if self._resume_at is not None and epoch <= self._resume_at[0]:
            epoch, step = self._resume_at
        return {"epoch": epoch, "step_in_epoch": step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume: the next iteration starts at ``step_in_epoch`` of ``epoch``."""
        self.epoch = int(state["epoch"])
        self._start_step = int(state["step_in_epoch"])
        self.step_in_epoch = self._start_step

    def fast_forward(self, state: dict[str, int]) -> None:
        """Continue from a live peer's position (a replica healed into a fault-tolerant job):
        iterations for epochs before ``state["epoch"]`` yield nothing, and that epoch starts
        at ``state["step_in_epoch"]``, so the user's own epoch loop catches up by itself.

        A heal can arrive while an iteration is running (a replica that fell one step behind
        is healed between two of its steps): that iteration moves to the peer's position
        before its next batch, or ends if the peer is in a later epoch."""
        self._resume_at = (int(state["epoch"]), int(state["step_in_epoch"]))
        self.epoch = max(self.epoch, self._resume_at[0])

    def adopt(self, slots: Sequence[int]) -> None:
        """Also yield the shares of ``slots`` (other replicas' places) of every global batch
        from the next one on, each right after this replica's own share (fault tolerance's
        ``keep_global_batch``: a live replica trains on a missing one's samples). ``()``
        stops. ``len()`` and the position still count global batches."""
        slots = tuple(int(k) for k in slots)
        bad = [k for k in slots if not 0 <= k < self.num_replicas or k == self.replica_id]
        if bad or len(set(slots)) != len(slots):
            raise ValueError(f"adopt: slots must be distinct places other than this replica's "
                             f"({self.replica_id}) in range({self.num_replicas}), got {slots}")
        self._adopted = slots

    def skip_first_batches(self, num_batches: int) -> DistributedLoader:
        """Start the next iteration at step ``num_batches`` of the current epoch (the skipped
        batches are never loaded); later iterations start at 0. Returns ``self``."""
        check_int("num_batches", num_batches, minimum=0,
                  fix="pass the number of batches of this epoch already trained on")
        if num_batches > len(self):
            raise ValueError(
                f"cannot skip {num_batches} batches of an epoch of {len(self)} steps "
                f"(global_batch_size={self.global_batch_size}). Fix: pass the step within the "
                "epoch (step % len(loader)), and set_epoch to the epoch to resume")
        self._start_step = num_batches
        self.step_in_epoch = num_batches
        return self

    def _permutation(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self._n)
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self._n, generator=gen)

    def _index_batches(self, slot: int | None = None,
                       perm: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The sample indices of ``slot``'s share (this replica's by default) of each global
        batch of the epoch."""
        perm = self._permutation() if perm is None else perm
        G, b = self.global_batch_size, self.per_replica_batch_size
        r = self.replica_id if slot is None else slot
        full = self._n // G
        batches = [perm[s * G + r * b: s * G + (r + 1) * b] for s in range(full)]
        if len(self) > full:
            tail = perm[full * G:]
            batches.append(torch.tensor_split(tail, self.num_replicas)[r])
        return batches

    def __iter__(self) -> Iterator[Any]:
        if self._resume_at is not None:
            epoch, step = self._resume_at
            if self.epoch < epoch:
                return  # an epoch the live replicas have finished
            if self.epoch == epoch:
                self._start_step = step
            self._resume_at = None
        epoch = self.epoch
        perm = self._permutation()
        batches = self._index_batches(perm=perm)
        others: dict[int, list[torch.Tensor]] = {}  # adopted slots' shares, this epoch
        # One loader per adopted slot, kept while it yields consecutive steps (a new one
        # only when adoption starts or the position jumps after a heal).
        feeds: dict[int, tuple[Iterator[Any], int]] = {}
        step = self._start_step
        self.step_in_epoch = step
        self._start_step = 0
        while step < len(batches):
            source = self._batches_from(batches, step)
            for batch in source:
                if self._resume_at is not None:  # healed between two steps: jump
                    break
                step += 1
                self.step_in_epoch = step
                yield batch
                for k in self._adopted:  # keep_global_batch: a missing replica's share
                    if k not in others:
                        others[k] = self._index_batches(k, perm)
                    feed, at = feeds.get(k, (None, -1))
                    if feed is None or at != step - 1:
                        feed = self._batches_from(others[k], step - 1)
                    feeds[k] = (feed, step)
                    yield next(feed)
            else:
                return
            assert self._resume_at is not None
            target_epoch, target = self._resume_at
            if target_epoch > epoch:
                return  # the peer is in a later epoch: __iter__ of that epoch resumes it
            self._resume_at = None
            # The peer's position in this epoch; (epoch - 1, end) is this epoch's start.
            step = target if target_epoch == epoch else 0
            self.step_in_epoch = step

    def _batches_from(self, batches: list[torch.Tensor], start: int) -> Iterator[Any]:
        """The batches of ``batches[start:]``, loaded and moved to the device one at a time."""
        if self._tensors is not None:
            for idx in batches[start:]:
                yield move_to_device(tuple(t[idx] for t in self._tensors), self.device)
            return
        loader = DataLoader(
            self.dataset,  # type: ignore[arg-type]
            batch_sampler=[idx.tolist() for idx in batches[start:]],  # type: ignore[arg-type]
            num_workers=self.num_workers,
            collate_fn=self.collate_fn,
        )
        for batch in loader:
            yield move_to_device(batch, self.device)


class _Skipping:
    """An iterable whose next iteration drops the first ``num_batches`` of ``loader``'s."""

    def __init__(self, loader: Iterable[Any], num_batches: int) -> None:
        self.loader = loader
        self.num_batches = num_batches

    def __iter__(self) -> Iterator[Any]:
        skip, self.num_batches = self.num_batches, 0
        return itertools.islice(iter(self.loader), skip, None)

    def __len__(self) -> int:
        return len(self.loader) - self.num_batches  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # set_epoch, dataset, sampler, ...
        return getattr(self.loader, name)


def skip_first_batches(loader: Any, num_batches: int) -> Any:
    """``loader`` with its next iteration starting after its first ``num_batches`` batches:
    a :class:`DistributedLoader` is positioned in place (nothing is loaded to be thrown
    away) and returned; any other iterable (a torch ``DataLoader``) is wrapped, and its
    skipped batches are loaded and dropped. Later iterations are whole."""
    if isinstance(loader, DistributedLoader):
        return loader.skip_first_batches(num_batches)
    check_int("num_batches", num_batches, minimum=0,
              fix="pass the number of batches of this epoch already trained on")
    if not hasattr(loader, "__iter__"):
        raise TypeError(f"skip_first_batches needs an iterable loader, got "
                        f"{type(loader).__name__}. Fix: pass the loader you iterate")
    return _Skipping(loader, num_batches)


class Inputs:
    """How a strategy feeds its replicas. Data is sharded by the replicas' fixed places in
    the job as launched (``comm().slot`` of ``comm().num_slots``): under fault tolerance a
    missing replica's share is skipped or, with ``keep_global_batch``, adopted by a live one,
    never re-sharded. ``on_loader`` sees each loader made (the fault-tolerance layer)."""

    def __init__(self, comm: Callable[[], Any], device: torch.device,
                 on_loader: Callable[[DistributedLoader], None]) -> None:
        self._comm, self.device, self._on_loader = comm, device, on_loader

    def dataset(self, dataset: Any, global_batch_size: int, *, shuffle: bool, seed: int,
                drop_remainder: bool, **kwargs: Any) -> DistributedLoader:
        comm = self._comm()
        loader = DistributedLoader(dataset, global_batch_size, num_replicas=comm.num_slots,
                                   replica_id=comm.slot, shuffle=shuffle, seed=seed,
                                   drop_remainder=drop_remainder, device=self.device, **kwargs)
        self._on_loader(loader)
        return loader

    def from_function(self, input_fn: Callable[[InputContext], Any]) -> Any:
        comm = self._comm()
        return input_fn(InputContext(num_input_pipelines=comm.num_slots,
                                     input_pipeline_id=comm.slot,
                                     num_replicas_in_sync=comm.num_slots))
