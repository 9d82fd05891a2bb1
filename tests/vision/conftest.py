"""A tiny Qwen2-VL written once per session (loaded fresh per test) and random images; the helpers of tests/
(cli_helpers) are importable here (test folders have no `__init__.py`, so pytest puts only a test file's own
folder on `sys.path`)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.models.vision import TinyVisionConfig

if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@pytest.fixture(scope="session")
def vlm_dir(tmp_path_factory) -> Path:
    cfg = TinyModelConfig(arch="qwen2_vl", hidden_size=64, num_layers=2, intermediate_size=128, seed=3,
                          vision=TinyVisionConfig(image_size=16, patch_size=4))
    return write_tiny_model(tmp_path_factory.mktemp("vlm") / "tiny-vl", cfg)


@pytest.fixture(scope="session")
def random_image():
    """`random_image(seed, size=16)`: an RGB image of uniform random pixels."""
    def make(seed: int, size: int = 16) -> Image.Image:
        return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8))
    return make
