from __future__ import annotations

import pytest
import torch

from stratagem.ps.placement import (
    FixedShardsPartitioner,
    MaxSizePartitioner,
    MinSizePartitioner,
    TensorSpec,
    greedy,
    round_robin,
)

pytestmark = pytest.mark.timeout(30)


def _mixed_model() -> list[TensorSpec]:
    """A CNN-like mix: big conv/fc weights, medium layers, many small biases and norms."""
    f = torch.float32
    specs = [TensorSpec("embed.weight", (8000, 128), f)]
    for i in range(6):
        specs += [TensorSpec(f"conv{i}.weight", (64 * (i + 1), 64, 3, 3), f),
                  TensorSpec(f"conv{i}.bias", (64 * (i + 1),), f),
                  TensorSpec(f"bn{i}.weight", (64 * (i + 1),), f),
                  TensorSpec(f"bn{i}.bias", (64 * (i + 1),), f)]
    specs += [TensorSpec("fc1.weight", (1024, 512), f), TensorSpec("fc1.bias", (1024,), f),
              TensorSpec("fc2.weight", (10, 1024), f), TensorSpec("fc2.bias", (10,), f)]
    return specs


@pytest.mark.parametrize("num_shards", [2, 3, 4])
def test_greedy_beats_round_robin_on_mixed_sizes(num_shards: int) -> None:
    specs = _mixed_model()
    g = greedy(specs, num_shards)
    rr = round_robin(specs, num_shards)
    print(f"\n{num_shards} shards: max/mean shard bytes greedy={g.imbalance:.3f} "
          f"round_robin={rr.imbalance:.3f}")
    assert g.imbalance < rr.imbalance
    assert sum(g.shard_bytes) == sum(rr.shard_bytes) == sum(s.nbytes for s in specs)


def test_greedy_is_deterministic_and_groups_small_tensors() -> None:
    specs = _mixed_model()
    a, b = greedy(specs, 3), greedy(list(specs), 3)
    assert a == b
    small = [p for p in a.parts if p.nbytes < 65536]
    assert len(small) > 5 and len({p.shard for p in small}) == 1
    # Largest first onto the least-loaded shard: the embedding (4 MB) is alone at first.
    assert a.parts_of("embed.weight")[0].shard == 0


def test_greedy_hand_example() -> None:
    f = torch.float32
    specs = [TensorSpec("a", (100_000,), f), TensorSpec("b", (60_000,), f),
             TensorSpec("c", (50_000,), f), TensorSpec("d", (10,), f), TensorSpec("e", (5,), f)]
    p = greedy(specs, 2)
    shard = {x.name: x.shard for x in p.parts}
    # a -> 0 (400 KB); b -> 1 (240 KB); c -> 1 (least loaded, 440 KB); smalls -> 0.
    assert shard == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 0}
    assert p.shard_bytes == [400_060, 440_000]


def test_partitioners_follow_tf_semantics() -> None:
    f = torch.float32
    assert FixedShardsPartitioner(4)((10, 3), f) == 4
    assert FixedShardsPartitioner(4)((2, 3), f) == 2  # never more than dim 0
    # 1000 rows x 1 KB: at least 256 KB per part -> 256 rows per part -> 3 parts (floor).
    assert MinSizePartitioner()((1000, 256), f) == 3
    assert MinSizePartitioner(max_shards=2)((1000, 256), f) == 2
    assert MinSizePartitioner()((10, 256), f) == 1
    # at most 100 KB per part: 100 rows per part -> ceil(1000 / 100) = 10 parts.
    assert MaxSizePartitioner(100 * 1024)((1000, 256), f) == 10
    assert MaxSizePartitioner(100 * 1024, max_shards=4)((1000, 256), f) == 4
    assert MaxSizePartitioner(1)((3, 256), f) == 3
    with pytest.raises(ValueError, match="positive integer"):
        FixedShardsPartitioner(0)


def test_partitioned_tensor_spreads_over_shards() -> None:
    specs = [TensorSpec("big", (10, 100_000), torch.float32), TensorSpec("s", (3,), torch.float32)]
    p = greedy(specs, 3, partitioner=FixedShardsPartitioner(3))
    parts = p.parts_of("big")
    assert [(x.row_start, x.row_end) for x in parts] == [(0, 4), (4, 7), (7, 10)]
    assert sorted(x.shard for x in parts) == [0, 1, 2]
    assert [x.key for x in parts] == ["big/part0of3", "big/part1of3", "big/part2of3"]
    assert p.parts_of("s")[0].num_parts == 1  # under small_tensor_bytes: never split
