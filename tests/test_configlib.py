from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from gcore_rl.configlib import apply_overrides, describe, dump_yaml, from_dict, load_config, to_dict
from gcore_rl.errors import ConfigError


@dataclass
class Rule:
    fn: str = field(default="exact", metadata={"help": "Reward function name."})
    weight: float = field(default=1.0, metadata={"help": "Weight of this rule."})

    def validate(self) -> None:
        if self.weight < 0:
            raise ConfigError("weight", "must be >= 0")


@dataclass
class Optim:
    lr: float = field(default=1e-5, metadata={"help": "Learning rate."})
    steps: int = field(default=10, metadata={"help": "Number of steps."})
    kind: Literal["adam", "sgd"] = field(default="adam", metadata={"help": "Optimiser."})
    clip: float | None = field(default=None, metadata={"help": "Gradient clipping (None = off)."})
    warmup: bool = field(default=False, metadata={"help": "Linear warm-up."})

    def validate(self) -> None:
        if self.steps < 1:
            raise ConfigError("steps", "must be at least 1")


@dataclass
class Job:
    name: str = field(default="job", metadata={"help": "Run name."})
    optim: Optim = field(default_factory=Optim, metadata={"help": "Optimiser settings."})
    rules: list[Rule] = field(default_factory=lambda: [Rule()], metadata={"help": "Reward rules."})
    tags: dict[str, float] = field(default_factory=dict, metadata={"help": "Free-form numbers."})
    out: Path = field(default=Path("runs/x"), metadata={"help": "Output folder."})


@dataclass
class Needs:
    path: str = field(metadata={"help": "Required."})


def raises(data, match_key: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        from_dict(Job, data)
    assert info.value.key == match_key, str(info.value)
    return info.value


def test_defaults_and_nested_values():
    job = from_dict(Job, {"optim": {"lr": 3, "kind": "sgd", "clip": 1.0}, "rules": [{"fn": "f", "weight": 2}]})
    assert job.optim.lr == 3.0 and isinstance(job.optim.lr, float)
    assert job.optim.kind == "sgd" and job.optim.clip == 1.0
    assert job.rules == [Rule("f", 2.0)]
    assert job.out == Path("runs/x")
    assert from_dict(Job, {}) == Job()


def test_unknown_nested_key_names_dotted_path():
    err = raises({"optim": {"lrr": 1.0}}, "optim.lrr")
    assert "optim.lrr" in str(err)
    assert "valid keys here are: lr, steps, kind, clip, warmup" in err.message


def test_wrong_type_names_key_and_expected_type():
    err = raises({"optim": {"lr": "abc"}}, "optim.lr")
    assert "expected a float" in err.message and "'abc'" in err.message
    err = raises({"optim": {"steps": 2.5}}, "optim.steps")
    assert "expected an integer" in err.message
    raises({"optim": {"lr": True}}, "optim.lr")
    raises({"optim": {"warmup": 1}}, "optim.warmup")
    raises({"optim": 3}, "optim")
    raises({"rules": {"fn": "x"}}, "rules")


def test_literal():
    err = raises({"optim": {"kind": "rmsprop"}}, "optim.kind")
    assert "expected one of 'adam', 'sgd'" in err.message


def test_optional():
    assert from_dict(Job, {"optim": {"clip": None}}).optim.clip is None
    assert from_dict(Job, {"optim": {"clip": 2}}).optim.clip == 2.0
    err = raises({"optim": {"clip": "x"}}, "optim.clip")
    assert "a float or null" in err.message


def test_list_of_dataclasses_uses_index_in_key():
    raises({"rules": [{"fn": "a"}, {"fn": "b", "bogus": 1}]}, "rules.1.bogus")
    raises({"rules": [{"fn": "a"}, {"weight": "heavy"}]}, "rules.1.weight")


def test_dict_values_checked():
    assert from_dict(Job, {"tags": {"a": 1}}).tags == {"a": 1.0}
    raises({"tags": {"a": "x"}}, "tags.a")


def test_validate_error_gets_prefix():
    err = raises({"optim": {"steps": 0}}, "optim.steps")
    assert str(err) == "config key `optim.steps`: must be at least 1"
    raises({"rules": [{}, {"weight": -1}]}, "rules.1.weight")


def test_missing_required_field():
    with pytest.raises(ConfigError) as info:
        from_dict(Needs, {})
    assert info.value.key == "path"


def test_float_accepts_numeric_strings():
    assert from_dict(Job, {"optim": {"lr": "1e-3"}}).optim.lr == pytest.approx(1e-3)


def test_override_parsing():
    data = {"optim": {"lr": 0.1}, "rules": [{"fn": "a"}]}
    out = apply_overrides(
        data,
        [
            "optim.steps=5",
            "optim.lr=1e-3",
            "optim.warmup=true",
            "optim.clip=null",
            "name=hello world",
            "rules.0.weight=2",
            "rules.1.fn=b",
            "tags.x=0.5",
        ],
    )
    assert out["optim"] == {"lr": "1e-3", "steps": 5, "warmup": True, "clip": None}
    assert out["name"] == "hello world"
    assert out["rules"] == [{"fn": "a", "weight": 2}, {"fn": "b"}]
    assert out["tags"] == {"x": 0.5}
    job = from_dict(Job, out)
    assert job.optim.lr == pytest.approx(1e-3) and job.optim.steps == 5 and job.optim.warmup is True
    assert job.rules == [Rule("a", 2.0), Rule("b", 1.0)]


def test_override_does_not_mutate_input():
    data = {"optim": {"lr": 0.1}, "rules": [{"fn": "a"}]}
    apply_overrides(data, ["optim.lr=0.2", "rules.0.fn=z", "new.key=1"])
    assert data == {"optim": {"lr": 0.1}, "rules": [{"fn": "a"}]}


@pytest.mark.parametrize("bad", ["novalue", "=3", " =3"])
def test_malformed_override(bad):
    with pytest.raises(ConfigError) as info:
        apply_overrides({}, [bad])
    assert info.value.key == bad and "expected KEY=VALUE" in info.value.message


def test_override_list_index_errors():
    with pytest.raises(ConfigError) as info:
        apply_overrides({"rules": [{}]}, ["rules.5.fn=x"])
    assert info.value.key == "rules.5"
    with pytest.raises(ConfigError):
        apply_overrides({"rules": [{}]}, ["rules.first.fn=x"])
    with pytest.raises(ConfigError):
        apply_overrides({"name": "x"}, ["name.sub=1"])


def test_load_config_overrides_reach_into_defaults(tmp_path):
    job = load_config(Job, None, ["rules.0.weight=3", "optim.kind=sgd"])
    assert job.rules == [Rule("exact", 3.0)] and job.optim.kind == "sgd"


def test_yaml_file_errors(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(Job, missing)
    assert info.value.key == "<recipe>" and str(missing) in info.value.message

    broken = tmp_path / "broken.yaml"
    broken.write_text("optim: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(Job, broken)
    assert info.value.key == "<recipe>" and str(broken) in info.value.message

    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(Job, listy)
    assert info.value.key == "<recipe>" and "mapping" in info.value.message

    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(Job, empty) == Job()


def test_load_config_reports_nested_errors(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("optim:\n  lr: 0.5\n  steps: 0\n")
    with pytest.raises(ConfigError) as info:
        load_config(Job, recipe)
    assert info.value.key == "optim.steps"


def test_to_dict_dump_yaml_round_trip(tmp_path):
    job = Job(
        name="r1",
        optim=Optim(lr=1e-6, steps=3, kind="sgd", clip=0.5, warmup=True),
        rules=[Rule("a", 0.25), Rule("b", 2.0)],
        tags={"t": 1.5},
        out=Path("runs/r1"),
    )
    plain = to_dict(job)
    assert plain["out"] == "runs/r1" and plain["rules"][1] == {"fn": "b", "weight": 2.0}
    path = tmp_path / "sub" / "resolved.yaml"
    dump_yaml(job, path)
    assert path.read_text().startswith("name: r1\noptim:")
    assert load_config(Job, path) == job


def test_describe_lists_nested_keys():
    text = describe(Job)
    for key in ("name: str", "optim.lr: float = 1e-05", "optim.kind: 'adam' | 'sgd'", "optim.clip: float | None = null",
                "rules.<i>.weight: float = 1.0", "tags: dict[str, float]"):
        assert key in text, key
    assert "Learning rate." in text
    assert "path: str = (required)" in describe(Needs)
