"""`plan()` is a pure function: devices and roles in, a Plan object out, clear errors otherwise."""

from __future__ import annotations

import pytest

from gcore_rl.errors import ConfigError
from gcore_rl.placement.plan import plan, worker_specs


def test_colocate_puts_every_role_on_every_device_and_slices_evenly():
    result = plan("colocate", devices=4, roles=["actor", "rollout", "reference"], controllers=2)
    assert result.devices == (0, 1, 2, 3)
    assert result.slices == ((0, 1), (2, 3))
    assert result.devices_of("rollout", "rollout") == (0, 1, 2, 3)
    assert result.devices_of("update", "actor") == (0, 1, 2, 3)
    assert result.devices_of("update", "reference") == (0, 1, 2, 3)
    assert result.devices_of("rollout", "actor") == ()
    assert result.roles_on("update", 3) == ("actor", "reference")
    assert result.roles_on("rollout", 0) == ("rollout",)


def test_single_controller_owns_all_devices():
    assert plan("colocate", devices=1, roles=["actor", "rollout"]).slices == ((0,),)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"strategy": "spread", "devices": 2, "roles": ["actor"]}, "placement.strategy"),
    ({"strategy": "colocate", "devices": 0, "roles": ["actor"]}, "runtime.controllers"),
    ({"strategy": "colocate", "devices": 3, "roles": ["actor"], "controllers": 2}, "runtime.controllers"),
    ({"strategy": "colocate", "devices": 2, "roles": ["actor", ""]}, "placement.roles"),
])
def test_impossible_requests_name_the_key(kwargs, key):
    with pytest.raises(ConfigError) as info:
        plan(**kwargs)
    assert info.value.key == key


def test_partial_splits_each_slice_into_rollout_and_judge_devices():
    result = plan("partial", devices=8, roles=["actor", "reference", "rollout", "judge"], controllers=2, rollout_devices=3)
    assert result.slices == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert result.devices_of("rollout", "rollout") == (0, 1, 2, 4, 5, 6)
    assert result.devices_of("rollout", "judge") == (3, 7)
    assert result.devices_of("update", "actor") == tuple(range(8))
    assert result.devices_of("update", "judge") == ()


def test_interleave_scores_on_one_half_while_the_reference_runs_on_the_other():
    result = plan("interleave", devices=8, roles=["actor", "reference", "critic", "rollout", "judge", "reward_model"],
                  controllers=2)
    assert result.devices_of("rollout", "rollout") == tuple(range(8))  # every device generates
    assert result.devices_of("rollout", "judge") == result.devices_of("rollout", "reward_model") == (0, 1, 4, 5)
    assert result.devices_of("rollout", "reference") == (2, 3, 6, 7)
    assert result.devices_of("update", "actor") == result.devices_of("update", "critic") == tuple(range(8))
    assert result.devices_of("update", "reference") == ()  # computed in the rollout phase, not next to the actor
    specs = worker_specs(result)
    assert [s.reference_phase for s in specs] == [None, None, "rollout", "rollout"] * 2
    assert all(s.time_share and s.trainer_rank == s.device for s in specs)
    colocated = worker_specs(plan("colocate", devices=2, roles=["actor", "reference", "rollout"]))
    assert [s.reference_phase for s in colocated] == ["update", "update"]


@pytest.mark.parametrize("roles", [["actor", "rollout", "judge"], ["actor", "reference", "rollout"]])
def test_interleave_needs_a_reward_model_and_a_reference(roles):
    with pytest.raises(ConfigError) as err:
        plan("interleave", devices=4, roles=roles)
    assert err.value.key == "placement.strategy" and "algo.kl_coef > 0" in err.value.message


def test_interleave_refuses_a_split_it_would_ignore():
    with pytest.raises(ConfigError) as err:
        plan("interleave", devices=4, roles=["actor", "reference", "rollout", "judge"], rollout_devices=1)
    assert err.value.key == "placement.rollout_devices"
    with pytest.raises(ConfigError) as err:
        plan("interleave", devices=1, roles=["actor", "reference", "rollout", "judge"])
    assert "separate halves" in err.value.message


def test_disaggregated_keeps_fixed_disjoint_devices_in_both_phases():
    result = plan("disaggregated", devices=8, roles=["actor", "rollout", "judge"], controllers=2,
                  train_devices=2, rollout_devices=1)
    assert result.devices_of("update", "actor") == (0, 1, 4, 5)
    assert result.devices_of("rollout", "rollout") == (2, 6)
    assert result.devices_of("rollout", "judge") == (3, 7)
    for role in ("rollout", "judge"):
        assert result.devices_of("update", role) == result.devices_of("rollout", role)
    assert not set(result.devices_of("update", "actor")) & set(result.devices_of("rollout", "rollout"))


def test_partial_without_judge_gives_the_whole_slice_to_rollout():
    result = plan("partial", devices=2, roles=["actor", "rollout"])
    assert result.devices_of("rollout", "rollout") == (0, 1)


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"strategy": "partial", "devices": 1, "roles": ["actor", "rollout", "judge"]}, "placement.rollout_devices"),
    ({"strategy": "partial", "devices": 4, "roles": ["rollout", "judge"], "rollout_devices": 4}, "placement.rollout_devices"),
    ({"strategy": "disaggregated", "devices": 2, "roles": ["actor", "rollout"], "train_devices": 2}, "placement.train_devices"),
    ({"strategy": "partial", "devices": 4, "roles": ["actor", "rollout", "judge"], "rollout_devices": 3,
      "min_devices": {"judge": 2}}, "placement.min_devices"),
])
def test_impossible_splits_and_models_that_do_not_fit(kwargs, key):
    with pytest.raises(ConfigError) as info:
        plan(**kwargs)
    assert info.value.key == key
    if key == "placement.min_devices":
        assert "judge" in info.value.message and "needs 2" in info.value.message


def test_scalar_reward_model_shares_the_reward_devices_with_the_judge():
    roles = ["actor", "rollout", "judge", "reward_model"]
    partial = plan("partial", devices=4, roles=roles, controllers=2)
    assert partial.devices_of("rollout", "rollout") == (0, 2)
    assert partial.devices_of("rollout", "judge") == partial.devices_of("rollout", "reward_model") == (1, 3)
    assert partial.devices_of("update", "reward_model") == ()  # a scoring role, idle while training
    colocate = plan("colocate", devices=2, roles=roles)
    assert colocate.roles_on("rollout", 1) == ("rollout", "judge", "reward_model")
    assert colocate.roles_on("update", 1) == ("actor",)
    # without a judge the reward model alone gets the reward devices
    alone = plan("partial", devices=2, roles=["actor", "rollout", "reward_model"])
    assert alone.devices_of("rollout", "reward_model") == (1,) and alone.devices_of("rollout", "rollout") == (0,)
    # disaggregated, one generation device per slice: rollout and the reward models take turns on it
    dis = plan("disaggregated", devices=4, roles=roles, controllers=2)
    assert dis.devices_of("rollout", "reward_model") == dis.devices_of("rollout", "rollout") == (1, 3)
    specs = worker_specs(dis)
    assert [s.time_share for s in specs] == [False, True, False, True]


def test_min_devices_from_the_job_config_refuses_a_plan_where_the_judge_cannot_fit(tmp_path):
    from gcore_rl.config import JobConfig, build_plan
    from gcore_rl.configlib import load_config

    base = ["runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=4", "judge.enabled=true",
            f"judge.model_path={tmp_path}", "placement.strategy=partial", "run.prompts_per_step=4"]
    ok = load_config(JobConfig, None, [*base, "placement.rollout_devices=2", "placement.min_devices={judge: 2}"])
    assert len(ok.placement.min_devices) == 1 and build_plan(ok).devices_of("rollout", "judge") == (2, 3)
    with pytest.raises(ConfigError) as info:
        build_plan(load_config(JobConfig, None, [*base, "placement.rollout_devices=3", "placement.min_devices={judge: 2}"]))
    assert info.value.key == "placement.min_devices" and "needs 2 device(s)" in info.value.message
    with pytest.raises(ConfigError) as info:
        load_config(JobConfig, None, [*base, "placement.min_devices={critics: 1}"])
    assert info.value.key == "placement.min_devices.critics"


def test_dynamic_starts_as_partial_but_every_device_hosts_both_rollout_roles():
    result = plan("dynamic", 6, ["actor", "rollout", "judge"], controllers=2, rollout_devices=2)
    assert result.devices_of("rollout", "rollout") == (0, 1, 3, 4)
    assert result.devices_of("rollout", "judge") == (2, 5)
    assert result.devices_of("update", "actor") == tuple(range(6))
    assert result.rollout_devices == 2 and result.version == 0
    specs = worker_specs(result)
    assert all(set(s.roles) == {"actor", "rollout", "judge"} and s.time_share for s in specs)
    assert not any(s.publishes_weights for s in specs)


def test_dynamic_needs_a_reward_model_and_validates_its_rebalance_section(tmp_path):
    from gcore_rl.config import JobConfig, build_plan
    from gcore_rl.configlib import load_config

    base = ["runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=4",
            "placement.strategy=dynamic", "run.prompts_per_step=4"]
    with pytest.raises(ConfigError) as info:
        build_plan(load_config(JobConfig, None, base))
    assert info.value.key == "placement.strategy" and "judge.enabled" in info.value.message
    judged = [*base, "judge.enabled=true", f"judge.model_path={tmp_path}"]
    assert load_config(JobConfig, None, [*judged, "placement.rebalance.unit=2"]).placement.rebalance.unit == 2
    with pytest.raises(ConfigError) as info:
        load_config(JobConfig, None, [*judged, "placement.rebalance.window=0"])
    assert info.value.key == "placement.rebalance.window"
    with pytest.raises(ConfigError) as info:  # two devices can only be split 1 + 1: nothing to move
        build_plan(load_config(JobConfig, None, [*judged, "runtime.devices_per_controller=2"]))
    assert info.value.key == "placement.strategy" and "at least 3 devices" in info.value.message


def test_traits_say_what_each_strategy_asks_of_the_runtime():
    from gcore_rl.placement.plan import STRATEGIES, STRATEGY_TRAITS

    roles = ["actor", "reference", "rollout", "judge"]
    split = {"disaggregated": 1, "interleave": None}
    plans = {s: plan(s, 4, roles, rollout_devices=split.get(s, 2)) for s in STRATEGIES}
    assert {s for s, p in plans.items() if p.traits.reference_in_rollout} == {"interleave"}
    assert {s for s, p in plans.items() if p.traits.overlaps_steps} == {"disaggregated"}
    assert {s for s, p in plans.items() if p.traits.rebalances} == {"dynamic"}
    assert {s for s, p in plans.items() if p.traits.streams_to_scorers} == {"partial", "dynamic", "disaggregated"}
    assert {s for s, p in plans.items() if not p.traits.splits_slice} == {"colocate"}
    for name, result in plans.items():  # the worker specs follow the traits, not the names
        specs = worker_specs(result)
        assert any(s.publishes_weights for s in specs) == result.traits.publishes_weights
        assert all(s.time_share for s in specs) == (not result.traits.publishes_weights), name
    assert set(STRATEGY_TRAITS) == set(STRATEGIES)


def test_a_rebalancing_plan_moves_to_a_new_version_and_a_fixed_one_refuses():
    first = plan("dynamic", 8, ["actor", "rollout", "judge", "reward_model"], controllers=2, rollout_devices=1)
    moved = first.with_rollout_devices(3)
    assert (first.version, moved.version, moved.with_rollout_devices(2).version) == (0, 1, 2)
    assert moved.devices_of("rollout", "rollout") == (0, 1, 2, 4, 5, 6)
    assert moved.devices_of("rollout", "judge") == moved.devices_of("rollout", "reward_model") == (3, 7)
    assert moved.phases["update"] == first.phases["update"] and moved.rollout_devices == 3
    with pytest.raises(ConfigError):
        first.with_rollout_devices(4)  # nothing left for the reward models
    with pytest.raises(ValueError):
        plan("partial", 4, ["actor", "rollout", "judge"]).with_rollout_devices(1)


def test_no_strategy_name_is_compared_outside_placement():
    """Consumers ask the plan's traits; only `placement/` (and the simulator's own models) know the names."""
    import ast
    from pathlib import Path

    from gcore_rl.placement.plan import STRATEGIES

    package = Path(__file__).resolve().parents[2] / "gcore_rl"
    found = []
    for path in package.rglob("*.py"):
        if path.parent.name in ("placement", "sim"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c for c in ast.walk(node) if isinstance(c, ast.Constant) and c.value in STRATEGIES]
                found += [f"{path.name}:{node.lineno} compares with '{c.value}'" for c in constants]
    assert not found, found


def test_the_driver_builds_the_plan_once_per_job(tmp_path, monkeypatch):
    """The plan is data shipped to the controllers and workers; nothing rebuilds it from the config."""
    import gcore_rl.config as config_module
    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.runtime.driver import run_job

    built = []
    original = config_module.plan
    monkeypatch.setattr(config_module, "plan", lambda *a, **k: built.append(a) or original(*a, **k))
    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=16, num_layers=1, intermediate_size=32))
    cfg = load_config(JobConfig, None, [f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=1",
                                        "run.prompts_per_step=2", "sampling.n=2", "sampling.max_new_tokens=2",
                                        "data.eval_prompts=0", "run.progress=false", "run.save_final=false",
                                        "runtime.threads_per_process=1"])
    assert run_job(cfg).steps == 1
    assert len(built) == 1


def test_a_slice_smaller_than_the_strategy_needs_is_refused_by_name():
    with pytest.raises(ConfigError) as info:
        plan("disaggregated", 2, ["actor", "rollout"], controllers=2)
    assert info.value.key == "placement.strategy" and "at least 2 devices per slice" in info.value.message
    assert plan("disaggregated", 4, ["actor", "rollout"], controllers=2).devices_of("update", "actor") == (0, 2)


@pytest.mark.parametrize(("overrides", "says"), [
    (["placement.strategy=disaggregated", "placement.max_staleness=0"], "positive integer"),
    (["placement.strategy=disaggregated", "placement.max_staleness=-2"], "positive integer"),
    (["placement.strategy=partial", "placement.max_staleness=2"], "disaggregated"),
])
def test_max_staleness_is_a_positive_bound_for_a_strategy_that_rolls_out_ahead(overrides, says):
    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config

    base = ["runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=2", "run.prompts_per_step=4"]
    assert load_config(JobConfig, None, [*base, "placement.strategy=disaggregated",
                                         "placement.max_staleness=3"]).placement.max_staleness == 3
    assert load_config(JobConfig, None, [*base, "placement.strategy=partial"]).placement.max_staleness == 1
    with pytest.raises(ConfigError) as info:
        load_config(JobConfig, None, [*base, *overrides])
    assert info.value.key == "placement.max_staleness" and says in info.value.message


def test_a_critic_of_its_own_takes_the_last_training_devices_of_each_slice():
    roles = ["actor", "rollout", "reference", "critic"]
    result = plan("colocate", 6, roles, controllers=2, critic_devices=1)
    assert result.devices_of("update", "actor") == (0, 1, 3, 4)
    assert result.devices_of("update", "reference") == (0, 1, 3, 4)  # the reference shard stays with the actor
    assert result.devices_of("update", "critic") == (2, 5)
    assert result.devices_of("rollout", "rollout") == (0, 1, 2, 3, 4, 5)  # the critic's devices still generate
    specs = worker_specs(result)
    assert [s.trainer_rank for s in specs] == [0, 1, None, 2, 3, None]
    assert [s.critic_rank for s in specs] == [None, None, 0, None, None, 1]
    assert {s.critic_world for s in specs} == {2} and {s.trainer_world for s in specs} == {4}
    assert [s.group_rank for s in specs] == [0, 1, 0, 2, 3, 1]
    # an engine on a device without a trainer takes the weights one trainer of its slice publishes
    assert [s.publishes_weights for s in specs] == [True, False, False, True, False, False]
    assert "actor" not in specs[2].roles and {"critic", "rollout"} <= set(specs[2].roles)
    # with the critic next to the actor nothing changes: no critic group, no publisher
    together = worker_specs(plan("colocate", 6, roles, controllers=2))
    assert {s.critic_rank for s in together} == {None} and not any(s.publishes_weights for s in together)


def test_a_critic_of_its_own_under_disaggregated_leaves_generation_alone():
    result = plan("disaggregated", 3, ["actor", "rollout", "critic"], train_devices=2, critic_devices=1)
    assert result.devices_of("update", "actor") == (0,)
    assert result.devices_of("update", "critic") == (1,)
    assert result.devices_of("rollout", "rollout") == (2,)
    specs = worker_specs(result)
    assert [s.roles for s in specs] == [("actor",), ("critic",), ("rollout",)]
    assert [s.publishes_weights for s in specs] == [True, False, False]


@pytest.mark.parametrize(("kwargs", "says"), [
    (dict(strategy="colocate", devices=2, roles=["actor", "rollout"], critic_devices=1), "trains none"),
    (dict(strategy="colocate", devices=2, roles=["actor", "rollout", "critic"], critic_devices=2), "at least one"),
    (dict(strategy="disaggregated", devices=3, roles=["actor", "rollout", "critic"], critic_devices=1), "at least one"),
])
def test_a_critic_of_its_own_needs_a_critic_and_leaves_the_actor_a_device(kwargs, says):
    with pytest.raises(ConfigError) as info:
        plan(**kwargs)
    assert info.value.key == "placement.critic_devices" and says in info.value.message
