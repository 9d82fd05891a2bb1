"""Running the `gcore-rl` command line in a subprocess and judging what a user would see."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_addition.yaml"
# a short job: 4 prompts x 4 samples, one wave per step (the demo recipe's dynamic sampling would keep
# drawing waves for a random model whose rewards are all equal), 1 intra-op thread (the tiny model
# gains nothing from more); the demo recipe stops on held-out accuracy, runs without held-out
# prompts switch that off
NO_STOP = "run.stop_at_eval_accuracy=0"
SHORT = ["run.prompts_per_step=4", "sampling.n=4", "run.progress=false", "runtime.threads_per_process=1",
         "dynamic_sampling.enabled=false"]
TIMEOUT_S = 120
TINY_SHAPE = ["hidden_size=32", "num_layers=2", "intermediate_size=64"]
"""`init-tiny` options of the small model the CLI tests share."""


def gcore_rl(*args: object, cwd: Path, extra_pythonpath: Path | None = None,
             fault: str | None = None) -> subprocess.CompletedProcess:
    """`gcore-rl ARGS` in `cwd`, offline, one thread; `extra_pythonpath` is importable (reward modules);
    `fault` ("phase:step", `gcore_rl.faults`) kills the run with SIGKILL at that moment."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if extra_pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_pythonpath), env.get("PYTHONPATH")) if p)
    env.pop("GCORE_FAULT", None)
    if fault is not None:
        env["GCORE_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "gcore_rl.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def squeeze(text: str) -> str:
    """`text` without any whitespace.

    The CLI's rich console hard-wraps stderr at 80 columns when it is not a terminal, turning a
    space into a line break or splitting a long path in the middle, so messages are compared with
    all whitespace removed.
    """
    return "".join(text.split())


def assert_user_error(proc: subprocess.CompletedProcess, code: int, *needles: str) -> None:
    """Exit status `code`, every needle in stderr, and no Python traceback."""
    detail = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert proc.returncode == code, detail
    message = squeeze(proc.stderr)
    for needle in needles:
        assert squeeze(needle) in message, detail
    assert "Traceback" not in proc.stderr, detail


def init_tiny(workdir: Path) -> Path:
    """`workdir/tiny`: a small model written by the real `init-tiny` command."""
    proc = gcore_rl("init-tiny", "tiny", *TINY_SHAPE, cwd=workdir)
    assert proc.returncode == 0, proc.stderr
    assert "tiny" in proc.stdout
    return workdir / "tiny"
