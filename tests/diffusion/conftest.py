"""Tiny flow models shared by the diffusion tests (written once per session, loaded fresh per test); the
helpers of tests/ (cli_helpers), tests/training (process_helpers) and benchmarks/ (flow_demo_seeds) are importable here (test folders have no
`__init__.py`, so pytest puts only a test file's own folder on `sys.path`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gcore_rl.models.flow import TinyDiffusionConfig, write_tiny_diffusion

for _folder in (Path(__file__).resolve().parents[1], Path(__file__).resolve().parents[1] / "training",
                Path(__file__).resolve().parents[2] / "benchmarks"):
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))


@pytest.fixture(scope="session")
def flow_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("flow-models")
    return {arch: write_tiny_diffusion(root / arch, TinyDiffusionConfig(arch=arch, resolution=8, num_layers=1))
            for arch in ("sd3", "flux")}


@pytest.fixture(scope="module")
def ray_instance():
    """Ray with 4 logical devices on the 2 CPUs, for the tests of a diffusion job's placement on Ray."""
    import ray

    ray.init(num_cpus=2, resources={"device": 4}, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """A tiny flow policy (8 px, 1 layer) and a tiny ViT image reward model with one output."""
    from transformers import ViTConfig, ViTForImageClassification

    root = tmp_path_factory.mktemp("flow-ray")
    policy = write_tiny_diffusion(root / "policy", TinyDiffusionConfig(resolution=8, num_layers=1))
    vit = ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                              num_attention_heads=2, intermediate_size=32, num_labels=1))
    vit.save_pretrained(root / "rm")
    return {"policy": policy, "rm": root / "rm"}
