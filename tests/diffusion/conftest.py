"""Tiny flow models shared by the diffusion tests (written once per session, loaded fresh per test); the
helpers of tests/ (cli_helpers) and benchmarks/ (flow_demo_seeds) are importable here (test folders have no
`__init__.py`, so pytest puts only a test file's own folder on `sys.path`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gcore_rl.diffusion.model import TinyDiffusionConfig, write_tiny_diffusion

for _folder in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parents[2] / "benchmarks"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


@pytest.fixture(scope="session")
def flow_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flow-models")
    return {arch: write_tiny_diffusion(root / arch, TinyDiffusionConfig(arch=arch, resolution=8, num_layers=1))
            for arch in ("sd3", "flux")}
