"""Dynamic sampling in waves: sizes, EMA, buffering, padding, disabled mode, checkpoint state."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from gcore_rl.algos.dynamic_sampling import (
    DynamicSamplingConfig,
    Group,
    WaveSampler,
    group_is_valid,
    wave_size,
)
from gcore_rl.errors import ConfigError

VALID = (0.0, 1.0)
INVALID = (1.0, 1.0)


def groups(*specs: tuple[float, ...], start: int = 0) -> list[Group]:
    return [Group(key=start + i, rewards=r, payload=f"p{start + i}") for i, r in enumerate(specs)]


def on(**kw) -> DynamicSamplingConfig:
    return DynamicSamplingConfig(enabled=True, **kw)


# ---------------------------------------------------------------- config


def test_every_field_has_help():
    for f in fields(DynamicSamplingConfig):
        assert f.metadata.get("help"), f.name


@pytest.mark.parametrize(
    "kw,key",
    [
        ({"target_groups": 0}, "target_groups"),
        ({"oversampling": 0.9}, "oversampling"),
        ({"oversampling": float("inf")}, "oversampling"),
        ({"ema_decay": 1.0}, "ema_decay"),
        ({"ema_decay": -0.1}, "ema_decay"),
        ({"initial_valid_fraction": 0.0}, "initial_valid_fraction"),
        ({"initial_valid_fraction": 1.5}, "initial_valid_fraction"),
        ({"max_multiplier": 0.5}, "max_multiplier"),
        ({"max_waves": 0}, "max_waves"),
        ({"min_reward_spread": -1.0}, "min_reward_spread"),
    ],
)
def test_validate_names_key(kw, key):
    with pytest.raises(ConfigError) as err:
        DynamicSamplingConfig(**kw).validate()
    assert err.value.key == key
    assert f"`{key}`" in str(err.value)


def test_defaults_validate_and_resolve_target():
    cfg = DynamicSamplingConfig()
    cfg.validate()
    assert cfg.resolve_target(16) == 16
    assert DynamicSamplingConfig(target_groups=8).resolve_target(16) == 8


# ---------------------------------------------------------------- pure helpers


def test_group_is_valid():
    assert group_is_valid([0.0, 1.0])
    assert not group_is_valid([0.5, 0.5, 0.5])
    assert not group_is_valid([1.0])
    assert not group_is_valid([])
    assert not group_is_valid([0.0, 0.1], min_spread=0.1)
    assert group_is_valid([0.0, 0.2], min_spread=0.1)
    assert not group_is_valid([0.0, float("nan")])


def test_wave_size_hand_computed():
    cfg = on()
    assert wave_size(8, 0.5, cfg) == 20  # ceil(8 / 0.5 * 1.2) = ceil(19.2)
    assert wave_size(10, 1.0, cfg) == 12  # exactly 12, no float-noise extra prompt
    assert wave_size(4, 1.0, cfg) == 5  # ceil(4.8)
    assert wave_size(3, 0.946, cfg) == 4  # ceil(3.805...)
    assert wave_size(0, 0.5, cfg) == 0
    assert wave_size(-2, 0.5, cfg) == 0


def test_wave_size_multiplier_clamp():
    cfg = on()
    assert wave_size(5, 0.01, cfg) == 60  # 1/0.01 = 100 clamped to 10: 5 * 10 * 1.2
    assert wave_size(5, 0.0, cfg) == 60
    assert wave_size(5, 0.01, on(max_multiplier=2.0, oversampling=1.0)) == 10


# ---------------------------------------------------------------- sampler


def test_ema_update_sequence():
    s = WaveSampler(on(max_waves=5), target_groups=100)
    s.begin_step()
    s.add_wave(groups(*[VALID] * 5, *[INVALID] * 5))  # observed 0.5
    assert s.ema == pytest.approx(0.95)
    s.add_wave(groups(*[INVALID] * 4))  # observed 0.0
    assert s.ema == pytest.approx(0.855)
    s.add_wave([])  # empty wave: unchanged
    assert s.ema == pytest.approx(0.855)
    s.add_wave(groups(VALID))  # observed 1.0
    assert s.ema == pytest.approx(0.8695)


def test_waves_buffer_surplus_and_reuse_next_step():
    s = WaveSampler(on(), target_groups=4)
    s.begin_step()
    assert s.next_wave_size() == 5  # ceil(4 * 1.2)
    s.add_wave(groups(VALID, INVALID, VALID, INVALID, INVALID))  # 2/5 valid
    assert s.ema == pytest.approx(0.94)
    assert s.gap == 2
    assert s.next_wave_size() == 3  # ceil(2 / 0.94 * 1.2) = ceil(2.553)
    s.add_wave(groups(VALID, VALID, VALID, start=5))
    assert s.ema == pytest.approx(0.946)
    assert s.next_wave_size() == 0
    batch = s.finish_step()
    assert [g.key for g in batch.groups] == [0, 2, 5, 6]
    assert batch.mask == [True] * 4
    assert batch.num_valid == 4
    assert (batch.waves, batch.generated_groups) == (2, 8)
    assert batch.valid_fraction_observed == pytest.approx(5 / 8)
    assert s.buffered == 1

    s.begin_step()
    assert s.buffered == 0
    assert s.gap == 3
    assert s.next_wave_size() == 4  # ceil(3 / 0.946 * 1.2) = ceil(3.805)
    s.add_wave(groups(VALID, VALID, VALID, VALID, start=10))
    batch = s.finish_step()
    assert [g.key for g in batch.groups] == [7, 10, 11, 12]
    assert batch.groups[0].payload == "p7"
    assert s.buffered == 1
    assert batch.generated_groups == 4


def test_buffer_larger_than_target_keeps_rest():
    s = WaveSampler(on(), target_groups=2)
    s.begin_step()
    s.add_wave(groups(*[VALID] * 5))
    assert s.finish_step().mask == [True, True]
    assert s.buffered == 3
    s.begin_step()
    assert s.next_wave_size() == 0  # satisfied from the buffer alone
    batch = s.finish_step()
    assert [g.key for g in batch.groups] == [2, 3]
    assert (batch.waves, batch.generated_groups, batch.valid_fraction_observed) == (0, 0, 0.0)
    assert s.buffered == 1


def test_padding_after_max_waves():
    s = WaveSampler(on(max_waves=2), target_groups=4)
    s.begin_step()
    assert s.next_wave_size() == 5
    s.add_wave(groups(VALID, INVALID, INVALID, INVALID, INVALID))  # ema 0.92
    assert s.next_wave_size() == 4  # ceil(3 / 0.92 * 1.2) = ceil(3.913)
    s.add_wave(groups(*[INVALID] * 4, start=5))  # ema 0.828
    assert s.ema == pytest.approx(0.828)
    assert s.next_wave_size() == 0  # max waves used although the gap is 3
    batch = s.finish_step()
    assert [g.key for g in batch.groups] == [0, 1, 2, 3]
    assert batch.mask == [True, False, False, False]
    assert batch.num_valid == 1
    assert batch.valid_fraction_observed == pytest.approx(1 / 9)


def test_padding_repeats_last_group_when_short():
    s = WaveSampler(on(max_waves=1), target_groups=4)
    s.begin_step()
    s.add_wave(groups(INVALID, VALID))
    batch = s.finish_step()
    assert [g.key for g in batch.groups] == [1, 0, 0, 0]
    assert batch.mask == [True, False, False, False]

    s.begin_step()
    s.add_wave(groups(VALID, start=7))
    batch = s.finish_step()
    assert [g.key for g in batch.groups] == [7, 7, 7, 7]
    assert batch.mask == [True, False, False, False]


def test_nothing_to_pad_raises():
    s = WaveSampler(on(max_waves=1), target_groups=2)
    s.begin_step()
    s.add_wave([])
    with pytest.raises(RuntimeError):
        s.finish_step()


def test_calls_outside_step_raise():
    s = WaveSampler(on(), target_groups=2)
    for call in (s.next_wave_size, s.finish_step, lambda: s.add_wave([])):
        with pytest.raises(RuntimeError):
            call()


def test_disabled_mode_is_plain_grpo():
    s = WaveSampler(DynamicSamplingConfig(), target_groups=3)
    s.begin_step()
    assert s.next_wave_size() == 3
    s.add_wave(groups(VALID, INVALID, INVALID))
    assert s.next_wave_size() == 0
    batch = s.finish_step()
    assert [g.key for g in batch.groups] == [0, 1, 2]
    assert batch.mask == [True, True, True]
    assert (batch.waves, batch.generated_groups) == (1, 3)
    assert batch.valid_fraction_observed == pytest.approx(1 / 3)
    assert s.ema == 1.0
    assert s.buffered == 0


def test_state_dict_round_trip_drops_buffer():
    s = WaveSampler(on(), target_groups=2)
    s.begin_step()
    s.add_wave(groups(VALID, VALID, VALID, INVALID))  # ema 0.975, one buffered
    s.finish_step()
    state = json.loads(json.dumps(s.state_dict()))
    assert state["ema"] == pytest.approx(0.975)
    assert state["buffer"] == [{"key": 2, "rewards": [0.0, 1.0], "version": 0}]

    t = WaveSampler(on(), target_groups=2)
    t.load_state_dict(state)
    assert t.ema == pytest.approx(0.975)
    assert t.buffered == 0
    assert t.state_dict()["ema"] == s.state_dict()["ema"]
    t.begin_step()
    assert t.next_wave_size() == 3  # ceil(2 / 0.975 * 1.2) = ceil(2.46)


def test_state_dict_with_payloads_restores_the_buffer_and_the_next_step():
    s = WaveSampler(on(), target_groups=2)
    s.begin_step()
    s.add_wave([Group(key=i, rewards=r, payload={"text": f"g{i}"}) for i, r in enumerate((VALID, VALID, VALID, INVALID))])
    s.finish_step()
    state = json.loads(json.dumps(s.state_dict(encode_payload=lambda p: p["text"])))
    assert state["buffer"] == [{"key": 2, "rewards": [0.0, 1.0], "version": 0, "payload": "g2"}]

    t = WaveSampler(on(), target_groups=2)
    t.load_state_dict(state, decode_payload=lambda text: {"text": text})
    assert t.buffered == 1
    for sampler in (s, t):  # the resumed sampler runs the next step exactly as the original
        sampler.begin_step()
        assert sampler.next_wave_size() == 2  # one valid group is buffered: gap 1, ceil(1 / 0.975 * 1.2)
        sampler.add_wave([Group(key=7, rewards=VALID, payload={"text": "g7"}), Group(key=8, rewards=INVALID)])
    first, second = s.finish_step(), t.finish_step()
    assert [(g.key, g.payload) for g in first.groups] == [(g.key, g.payload) for g in second.groups]
    assert first.groups[0].payload == {"text": "g2"}


def test_load_state_dict_rejects_bad_state():
    s = WaveSampler(on(), target_groups=2)
    with pytest.raises(ValueError):
        s.load_state_dict({"version": 99, "ema": 0.5})
    with pytest.raises(ValueError):
        s.load_state_dict({"version": 1, "ema": 1.5})


def test_sampler_validates_config_and_target():
    with pytest.raises(ConfigError):
        WaveSampler(on(max_waves=0), target_groups=2)
    with pytest.raises(ValueError):
        WaveSampler(on(), target_groups=0)


def versioned(version: int, *specs: tuple[float, ...], start: int = 0) -> list[Group]:
    return [Group(key=start + i, rewards=r, version=version) for i, r in enumerate(specs)]


@pytest.mark.parametrize("max_age", [0, 1, 2, 3])
def test_a_buffered_group_older_than_the_bound_is_handed_back_not_trained(max_age):
    """Surplus made at version v and trained at version t is kept iff t - v <= max_age; the dropped ones come
    back from `begin_step` (their prompts are generated again), count in `stale_dropped`, and widen the gap."""
    def two_buffered() -> WaveSampler:
        s = WaveSampler(on(), target_groups=2, max_age=max_age)
        s.begin_step(trained_version=0)
        s.add_wave(versioned(0, VALID, VALID, VALID, VALID))  # two trained, two buffered (made at version 0)
        assert s.finish_step().stale_dropped == 0 and s.buffered == 2
        return s

    young = two_buffered()
    assert young.begin_step(trained_version=max_age) == [] and young.next_wave_size() == 0
    batch = young.finish_step()
    assert batch.stale_dropped == 0 and [g.version for g in batch.groups] == [0, 0]

    old = two_buffered()
    handed_back = old.begin_step(trained_version=max_age + 1)
    assert [g.key for g in handed_back] == [2, 3] and old.gap == 2 and old.buffered == 0
    old.add_wave(versioned(max_age + 1, VALID, VALID, VALID))
    batch = old.finish_step()
    assert batch.stale_dropped == 2 and [g.version for g in batch.groups] == [max_age + 1] * 2


def test_without_a_bound_or_a_version_every_buffered_group_is_taken():
    for sampler, trained in ((WaveSampler(on(), target_groups=1), 9), (WaveSampler(on(), target_groups=1, max_age=0), None)):
        sampler.begin_step(trained_version=0)
        sampler.add_wave(versioned(0, VALID, VALID))
        sampler.finish_step()
        assert sampler.begin_step(trained_version=trained) == [] and sampler.gap == 0


def test_the_buffer_keeps_each_groups_version_through_a_checkpoint():
    s = WaveSampler(on(), target_groups=1, max_age=1)
    s.begin_step(trained_version=3)
    s.add_wave(versioned(2, VALID, VALID, VALID))
    s.finish_step()
    state = json.loads(json.dumps(s.state_dict(encode_payload=lambda p: p)))
    t = WaveSampler(on(), target_groups=1, max_age=1)
    t.load_state_dict(state, decode_payload=lambda p: p)
    assert [g.version for g in t._buffer] == [2, 2]
    assert t.begin_step(trained_version=3) == [] and t.finish_step().groups[0].version == 2  # age 1: kept
    assert [g.key for g in t.begin_step(trained_version=4)] == [2]  # age 2: handed back


def test_max_surplus_age_must_be_a_count():
    with pytest.raises(ConfigError, match="max_surplus_age"):
        on(max_surplus_age=-1).validate()


def test_the_first_wave_takes_back_every_dropped_prompt_even_past_the_gap():
    s = WaveSampler(on(initial_valid_fraction=1.0, oversampling=1.0), target_groups=4, max_age=0)
    s.begin_step(trained_version=0)
    s.add_wave(versioned(0, *[VALID] * 10))  # 4 trained, 6 buffered
    s.finish_step()
    dropped = s.begin_step(trained_version=1)  # all 6 are a version old: dropped, more than the 4 missing
    assert len(dropped) == 6 and s.gap == 4 and s.next_wave_size() == 6
    s2 = WaveSampler(on(), target_groups=1, max_age=0)
    s2.begin_step(trained_version=0)
    s2.add_wave(versioned(0, VALID, VALID))
    s2.finish_step()
    s2._buffer.append(Group(key=9, rewards=VALID, version=1))  # a fresh one behind the stale one
    assert len(s2.begin_step(trained_version=1)) == 1 and s2.gap == 0
    assert s2.next_wave_size() == 1  # no group missing, but the dropped prompt is generated again
