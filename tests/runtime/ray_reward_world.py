"""A Ray instance whose controllers can import a reward module written for the test (shared by the Ray resume tests)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model

DIGITS_REWARD = "def fraction(prompt, completion, **row):\n    return sum(c.isdigit() for c in completion) / 6\n"
"""A reward that varies on a random tiny model (the share of digits in 6 tokens), so the job trains."""


@contextlib.contextmanager
def ray_reward_world(ray, root: Path, module: str, devices: int) -> Iterator[Path]:
    """`root` with a tiny model (`root/tiny`) and `module`.py holding `fraction`, importable by the driver and by
    every Ray worker (on PYTHONPATH before Ray starts), inside a Ray instance of `devices` logical devices."""
    (root / f"{module}.py").write_text(DIGITS_REWARD)
    write_tiny_model(root / "tiny", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), saved) if p)
    sys.path.insert(0, str(root))  # the driver checks the reward function too
    ray.init(num_cpus=2, resources={"device": devices}, include_dashboard=False, log_to_driver=False)
    try:
        yield root
    finally:
        ray.shutdown()
        sys.path.remove(str(root))
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
