"""What `gcore-rl --help` and each command's --help show: an examples section whose command lines parse, name
recipes and scenarios that exist and keys the configs have; and the block `train` prints about where a run's
outputs go (a real run checks it in tests/test_cli.py)."""

from __future__ import annotations

import shlex

import pytest
from cli_helpers import REPO, gcore_rl

from gcore_rl.cli import EXAMPLES, _parse, _recipe_kind, build_parser, where_outputs_go
from gcore_rl.config import RunConfig
from gcore_rl.configlib import load_config
from gcore_rl.diffusion.config import FlowRunConfig

PARSER, SUB = build_parser()
COMMANDS = ["", *SUB.choices]
"""The top level ("") and every command."""


def help_text(command: str) -> str:
    return (SUB.choices[command] if command else PARSER).format_help()


def examples(command: str) -> list[list[str]]:
    """The command lines of the "examples:" section of `command`'s help, as argument lists without `gcore-rl`."""
    text = help_text(command)
    assert "\nexamples:\n" in text, text
    lines = [line.strip() for line in text.split("\nexamples:\n", 1)[1].splitlines()]
    return [shlex.split(line)[1:] for line in lines if line.startswith("gcore-rl ")]


def test_every_command_has_examples():
    assert sorted(EXAMPLES) == sorted(COMMANDS)
    for command in COMMANDS:
        found = examples(command)
        assert 1 <= len(found) <= 4, (command, found)
        assert all(argv[0] == command for argv in found) if command else found


def _config_class(command: str, recipe: str) -> type:
    from gcore_rl.config import JobConfig
    from gcore_rl.diffusion.config import FlowGrpoJobConfig
    from gcore_rl.training.flow_sft import FlowSftConfig
    from gcore_rl.training.reward_trainer import RewardTrainConfig
    from gcore_rl.training.sft import SftConfig

    kind = _recipe_kind(recipe)
    return {"train": FlowGrpoJobConfig if kind == "flow_grpo" else JobConfig,
            "sft": FlowSftConfig if kind == "flow_matching" else SftConfig, "rm": RewardTrainConfig}[command]


@pytest.mark.parametrize("command", COMMANDS)
def test_examples_parse_and_name_what_exists(command, monkeypatch):
    """Each example parses as the CLI parses it, every recipe or scenario it names is in the repository, and a
    recipe or scenario with its overrides loads (the keys exist, the values fit)."""
    monkeypatch.chdir(REPO)
    for argv in examples(command):
        args = _parse(*build_parser(), argv)
        for arg in argv:
            if arg.startswith(("recipes/", "scenarios/")):
                assert (REPO / arg).is_file(), (argv, arg)
        if args.command in ("train", "sft", "rm"):
            load_config(_config_class(args.command, args.recipe), args.recipe, args.overrides)
        if args.command == "simulate" and args.scenario:
            from gcore_rl.sim.scenario import load_scenario

            load_scenario(args.scenario, args.overrides)


def test_help_prints_examples_and_exits_0(tmp_path):
    for argv, seen in (([], "`gcore-rl COMMAND --help` shows"), (["train"], "run.resume=auto")):
        proc = gcore_rl(*argv, "--help", cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert "examples:" in proc.stdout and "gcore-rl train recipes/grpo_addition.yaml" in proc.stdout
        assert seen in proc.stdout


def test_outputs_block_of_the_defaults():
    assert where_outputs_go(RunConfig(output_dir="runs/x")).splitlines() == [
        "outputs of this run:",
        "  run folder   runs/x",
        "  metrics      runs/x/metrics.jsonl",
        "  report       runs/x/report.html (at the end; `gcore-rl report runs/x` draws it any time)",
        "  checkpoints  off (run.checkpoint_every=0)",
        "  final model  runs/x/final",
    ]


def test_outputs_block_names_checkpoints_loggers_and_what_is_not_saved(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run = RunConfig(output_dir="runs/x", checkpoint_every=5, keep_checkpoints=3, report_every=10, save_final=False,
                    loggers=["jsonl", "tensorboard", "mlflow"])
    text = where_outputs_go(run)
    assert "metrics      runs/x/metrics.jsonl, tensorboard: runs/x/tensorboard, mlflow: runs/x/mlruns" in text
    assert "report.html (every 10 steps and at the end;" in text
    assert "checkpoints  runs/x/checkpoints, every 5 steps (the newest 3 kept)" in text
    assert "final model  not saved (run.save_final=false)" in text
    elsewhere = RunConfig(output_dir="runs/x", checkpoint_every=1, checkpoint_dir="/ckpt")
    assert "checkpoints  /ckpt, every step (the newest 2 kept)" in where_outputs_go(elsewhere)


def test_outputs_block_of_a_diffusion_job():
    text = where_outputs_go(FlowRunConfig(output_dir="runs/f"), flow=True)
    assert "sample grids runs/f/grid_before.png, runs/f/grid_after.png" in text
    assert "report" not in text
    assert "final model  runs/f/final" in text


def test_a_reader_that_leaves_early_gets_no_traceback():
    """`gcore-rl config-reference | head -2`: the pipe closes while the reference is printed."""
    import os
    import subprocess
    import sys

    proc = subprocess.run(f"{sys.executable} -m gcore_rl.cli config-reference | head -2", shell=True,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.splitlines()[0].startswith("run") and "Traceback" not in proc.stderr, proc.stderr
    # the race made certain: a reader gone before the first write
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        gone = subprocess.run([sys.executable, "-m", "gcore_rl.cli", "config-reference"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert gone.returncode == 0 and "Traceback" not in gone.stderr, gone.stderr
