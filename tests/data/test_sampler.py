import pytest

from gcore_rl.data.sampler import ShardedPromptSampler


def test_shards_are_disjoint_and_cover_an_epoch():
    num_rows, num_shards = 23, 4
    shards = [ShardedPromptSampler(num_rows, i, num_shards, seed=3) for i in range(num_shards)]
    seen = []
    for s in shards:
        seen.append(s.next_indices(s.shard_size))
        assert s.epoch == 0
    flat = [i for part in seen for i in part]
    assert sorted(flat) == list(range(num_rows))
    assert sorted(len(p) for p in seen) == [5, 6, 6, 6]


def test_shuffle_and_epochs_differ():
    s = ShardedPromptSampler(50, seed=1)
    first = s.next_indices(50)
    second = s.next_indices(50)
    assert sorted(first) == sorted(second) == list(range(50))
    assert first != second and first != list(range(50))
    plain = ShardedPromptSampler(5, shuffle=False)
    assert plain.next_indices(7) == [0, 1, 2, 3, 4, 0, 1]


def test_epoch_rollover_within_a_batch():
    s = ShardedPromptSampler(10, seed=0)
    reference = ShardedPromptSampler(10, seed=0)
    epoch0 = reference.next_indices(10)
    epoch1 = reference.next_indices(10)
    s.next_indices(8)
    batch = s.next_indices(5)
    assert batch == epoch0[8:] + epoch1[:3]
    assert s.epoch == 1 and s.position == 3
    big = ShardedPromptSampler(3, seed=0).next_indices(10)
    assert len(big) == 10


def test_state_dict_round_trip_continues_identically():
    uninterrupted = ShardedPromptSampler(17, shard_index=1, num_shards=3, seed=9)
    first = ShardedPromptSampler(17, shard_index=1, num_shards=3, seed=9)
    expected = uninterrupted.next_indices(4) + uninterrupted.next_indices(13)
    got = first.next_indices(4)
    state = first.state_dict()
    assert state["epoch"] == 0 and state["position"] == 4 and state["num_rows"] == 17
    resumed = ShardedPromptSampler(17, shard_index=1, num_shards=3, seed=9)
    resumed.load_state_dict(state)
    got += resumed.next_indices(13)
    assert got == expected


def test_load_state_dict_rejects_other_layout():
    state = ShardedPromptSampler(10, 0, 2).state_dict()
    with pytest.raises(ValueError, match="num_rows"):
        ShardedPromptSampler(11, 0, 2).load_state_dict(state)
    with pytest.raises(ValueError, match="num_shards"):
        ShardedPromptSampler(10, 0, 1).load_state_dict(state)


def test_invalid_arguments():
    with pytest.raises(ValueError):
        ShardedPromptSampler(10, shard_index=2, num_shards=2)
    with pytest.raises(ValueError):
        ShardedPromptSampler(10, num_shards=0)
    with pytest.raises(ValueError, match="no rows"):
        ShardedPromptSampler(2, shard_index=0, num_shards=3)
