import pytest

from gcore_rl.data.sampler import ShardedPromptSampler


def test_every_epoch_visits_each_local_position_once():
    s = ShardedPromptSampler(23, seed=3, shard_index=2)
    for epoch in range(3):
        assert sorted(s.next_indices(23)) == list(range(23))
        assert s.epoch == epoch and s.position == 23


def test_epochs_and_shards_get_different_orders():
    s = ShardedPromptSampler(50, seed=1)
    first, second = s.next_indices(50), s.next_indices(50)
    assert first != second and first != list(range(50))
    other_shard = ShardedPromptSampler(50, seed=1, shard_index=1).next_indices(50)
    other_seed = ShardedPromptSampler(50, seed=2).next_indices(50)
    assert other_shard != first and other_seed != first
    assert ShardedPromptSampler(50, seed=1).next_indices(100) == first + second


def test_no_shuffle_is_identity_order():
    plain = ShardedPromptSampler(5, shuffle=False, shard_index=3)
    assert plain.next_indices(7) == [0, 1, 2, 3, 4, 0, 1]


def test_negative_seed_is_accepted():
    assert sorted(ShardedPromptSampler(6, seed=-5).next_indices(6)) == list(range(6))


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
    assert len(big) == 10 and set(big) == {0, 1, 2}


def test_state_dict_round_trip_continues_identically():
    uninterrupted = ShardedPromptSampler(6, seed=9, shard_index=1)
    first = ShardedPromptSampler(6, seed=9, shard_index=1)
    expected = uninterrupted.next_indices(4) + uninterrupted.next_indices(13)
    got = first.next_indices(4)
    state = first.state_dict()
    assert state == {"epoch": 0, "position": 4, "skipped": [], "deferred": [], "seed": 9, "shuffle": True, "shard_index": 1, "num_rows": 6}
    resumed = ShardedPromptSampler(6, seed=0, shard_index=1)  # seed and shuffle come from the state
    resumed.load_state_dict(state)
    got += resumed.next_indices(13)
    assert got == expected


def test_load_state_dict_rejects_other_layout():
    state = ShardedPromptSampler(10, shard_index=1).state_dict()
    with pytest.raises(ValueError, match="num_rows"):
        ShardedPromptSampler(11, shard_index=1).load_state_dict(state)
    with pytest.raises(ValueError, match="shard_index"):
        ShardedPromptSampler(10, shard_index=0).load_state_dict(state)
    with pytest.raises(ValueError, match="position"):
        ShardedPromptSampler(10, shard_index=1).load_state_dict({**state, "position": 11})


def test_invalid_arguments():
    with pytest.raises(ValueError, match="num_rows"):
        ShardedPromptSampler(0)
    with pytest.raises(ValueError, match="shard_index"):
        ShardedPromptSampler(10, shard_index=-1)
    with pytest.raises(ValueError, match="n must"):
        ShardedPromptSampler(10).next_indices(-1)
    with pytest.raises(TypeError):
        ShardedPromptSampler(10, 0, 2)  # the old (num_rows, shard_index, num_shards) call must not pass silently


def test_continue_epoch_after_a_reshard_visits_every_row_of_the_epoch_exactly_once():
    """Two shards draw part of epoch 0; one shard holding all rows then finishes that epoch with the rest."""
    rows = 11
    old = [ShardedPromptSampler(len(range(k, rows, 2)), seed=5, shard_index=k) for k in range(2)]
    drawn_global = [2 * local + k for k, sampler in enumerate(old) for local in sampler.next_indices(3)]
    seen = {2 * local + k for k, sampler in enumerate(old) for local in sampler.drawn_in_epoch()}
    assert seen == set(drawn_global)

    merged = ShardedPromptSampler(rows, seed=5, shard_index=0)  # global ids are local positions here
    merged.continue_epoch(0, seen)
    rest = merged.next_indices(rows - len(seen))
    assert sorted(drawn_global + rest) == list(range(rows))
    assert sorted(merged.drawn_in_epoch()) == list(range(rows))
    assert merged.epoch == 0

    state = merged.state_dict()  # a second resume in the middle of the reshard epoch continues alike
    again = ShardedPromptSampler(rows, seed=5, shard_index=0)
    again.load_state_dict(state)
    assert again.next_indices(5) == merged.next_indices(5)
    assert merged.epoch == 1 and sorted(merged.drawn_in_epoch()) == sorted(set(merged.drawn_in_epoch()))
