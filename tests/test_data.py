"""distribute_dataset / distribute_datasets_from_function."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

import stratagem as sg
from stratagem.data import DistributedLoader

pytestmark = pytest.mark.timeout(30)


def shards(n, gbs, replicas, **kw):
    data = (torch.arange(n),)
    loaders = [DistributedLoader(data, gbs, num_replicas=replicas, replica_id=r, **kw) for r in range(replicas)]
    return loaders, [[b[0].tolist() for b in loader] for loader in loaders]


@pytest.mark.parametrize("n,gbs,replicas", [(100, 8, 2), (103, 12, 3), (10, 4, 4), (7, 6, 3)])
def test_every_sample_at_most_once_and_equal_step_counts(n, gbs, replicas):
    loaders, batches = shards(n, gbs, replicas, seed=5)
    steps = {len(b) for b in batches}
    assert len(steps) == 1 and steps.pop() == len(loaders[0])
    seen = [i for per_replica in batches for batch in per_replica for i in batch]
    assert len(seen) == len(set(seen))
    tail = n % gbs
    expected = n if tail == 0 or tail >= replicas else n - tail
    assert len(seen) == expected
    for per_replica in batches:
        assert all(len(b) <= gbs // replicas for b in per_replica)
        assert all(len(b) > 0 for b in per_replica)


def test_drop_remainder_and_no_shuffle():
    _, batches = shards(10, 4, 2, shuffle=False, drop_remainder=True)
    assert batches == [[[0, 1], [4, 5]], [[2, 3], [6, 7]]]


def test_set_epoch_reshuffles_deterministically():
    loader = DistributedLoader((torch.arange(50),), 10, num_replicas=1, replica_id=0, seed=1)
    first = [b[0].tolist() for b in loader]
    again = [b[0].tolist() for b in loader]
    loader.set_epoch(1)
    second = [b[0].tolist() for b in loader]
    assert first == again and first != second
    other_seed = DistributedLoader((torch.arange(50),), 10, num_replicas=1, replica_id=0, seed=2)
    assert [b[0].tolist() for b in other_seed] != first


def test_non_divisible_global_batch_names_both_numbers():
    with pytest.raises(ValueError, match=r"global_batch_size=10.*3 replicas"):
        DistributedLoader((torch.arange(30),), 10, num_replicas=3, replica_id=0)


def test_dataset_smaller_than_replicas_raises_before_any_collective():
    with pytest.raises(ValueError, match="3 samples, fewer than the 4 replicas"):
        DistributedLoader((torch.arange(3),), 4, num_replicas=4, replica_id=0)
    with pytest.raises(ValueError, match="drop_remainder"):
        DistributedLoader((torch.arange(5),), 8, num_replicas=2, replica_id=0, drop_remainder=True)


def test_map_style_dataset_and_resume_position():
    class Squares(Dataset):
        def __len__(self):
            return 20

        def __getitem__(self, i):
            return torch.tensor(float(i)), torch.tensor(i * i)

    loader = sg.OneDevice().distribute_dataset(Squares(), 4, shuffle=True, seed=0)
    full = [b[0].tolist() for b in loader]
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["step_in_epoch"] == 2
    resumed = sg.OneDevice().distribute_dataset(Squares(), 4, shuffle=True, seed=0)
    resumed.load_state_dict(state)
    assert [b[0].tolist() for b in resumed] == full[2:]
    x, y = next(iter(loader))
    torch.testing.assert_close(y, (x * x).long())


def test_distribute_datasets_from_function_input_context():
    seen = []

    def input_fn(ctx: sg.InputContext):
        seen.append(ctx)
        return ctx.get_per_replica_batch_size(64)

    assert sg.OneDevice().distribute_datasets_from_function(input_fn) == 64
    assert seen[0].num_input_pipelines == 1 and seen[0].input_pipeline_id == 0
    with pytest.raises(ValueError, match="not divisible"):
        sg.InputContext(num_input_pipelines=3, input_pipeline_id=0, num_replicas_in_sync=3) \
            .get_per_replica_batch_size(64)


class _Rows(Dataset):
    """A map-style dataset (the DataLoader path of DistributedLoader)."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


@pytest.mark.parametrize("dataset", ["tensors", "map-style"])
def test_a_heal_during_an_iteration_moves_it_to_the_peers_position(dataset):
    # Fault tolerance: a replica one step behind is healed between two of its steps; its
    # running iteration must continue at the peer's position (it used to continue at its own,
    # one batch apart from its peers for the rest of the run).
    data = (torch.arange(40),) if dataset == "tensors" else _Rows()

    def ids(batch):
        return (batch[0] if isinstance(batch, (tuple, list)) else batch).flatten().tolist()

    peer = DistributedLoader(data, 8, num_replicas=2, replica_id=0, shuffle=True, seed=1)
    expected = [ids(b) for b in peer]  # epoch 0, steps 0..4
    loader = DistributedLoader(data, 8, num_replicas=2, replica_id=0, shuffle=True, seed=1)
    it = iter(loader)
    assert ids(next(it)) == expected[0]
    loader.fast_forward({"epoch": 0, "step_in_epoch": 3})  # the peer has trained 3 steps
    assert ids(next(it)) == expected[3] and loader.step_in_epoch == 4
    assert [ids(b) for b in it] == [expected[4]]
    # A peer in a later epoch: this iteration ends, and that epoch resumes at its step.
    loader.set_epoch(0)
    it = iter(loader)
    next(it)
    loader.fast_forward({"epoch": 2, "step_in_epoch": 1})
    assert list(it) == []
    peer.set_epoch(2)
    later = [ids(b) for b in peer]
    loader.set_epoch(1)
    assert list(loader) == []  # an epoch the peers have finished
    loader.set_epoch(2)
    assert [ids(b) for b in loader] == later[1:]
    # Healed at the job's last step: the epoch loop's set_epoch(0) runs, the loop ends before
    # any batch, and the position saved or compared is still the peer's.
    loader.fast_forward({"epoch": 1, "step_in_epoch": 3})
    loader.set_epoch(0)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["step_in_epoch"] == 3


@pytest.mark.parametrize("dataset", ["tensors", "map-style"])
def test_adopted_slots_yield_their_shares_right_after_this_replicas_own(dataset, monkeypatch):
    # keep_global_batch: from the next step on, replica 0 also yields slot 2's share of each
    # global batch (slot 2's own loader's batches, in order), adoption can start mid-epoch,
    # follows a heal's jump, and stops with adopt(()). One loader per adopted slot while the
    # steps are consecutive (the DataLoader path used to build one per adopted batch).
    data = (torch.arange(40),) if dataset == "tensors" else _Rows()

    def ids(batch):
        return (batch[0] if isinstance(batch, (tuple, list)) else batch).flatten().tolist()

    def loader(r):
        return DistributedLoader(data, 12, num_replicas=3, replica_id=r, shuffle=True, seed=4)

    own, theirs = [ids(b) for b in loader(0)], [ids(b) for b in loader(2)]
    assert len(own) == 4
    me = loader(0)
    built = []
    original = DistributedLoader._batches_from

    def counting(self, batches, start):
        built.append(start)
        return original(self, batches, start)

    monkeypatch.setattr(DistributedLoader, "_batches_from", counting)
    it = iter(me)
    assert ids(next(it)) == own[0]
    me.adopt([2])
    # Adopted during step 0 (the quorum of a step is formed after its batch was drawn):
    # slot 2's share of that same step comes next.
    assert [ids(next(it)) for _ in range(5)] == [theirs[0], own[1], theirs[1], own[2],
                                                 theirs[2]]
    assert built == [0, 0]  # this replica's feed, then one for slot 2, kept
    me.fast_forward({"epoch": 0, "step_in_epoch": 1})  # a heal moves the position back
    assert [ids(b) for b in it] == [own[1], theirs[1], own[2], theirs[2], own[3], theirs[3]]
    assert built == [0, 0, 1, 1]
    me.adopt(())
    assert [ids(b) for b in me] == own
    with pytest.raises(ValueError, match=r"distinct places other than this replica's \(0\)"):
        me.adopt([0])
