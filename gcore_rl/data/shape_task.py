"""A synthetic text-to-image task: coloured shapes on a black background, named by the prompt.

Prompts read ``"a red circle"``; each row carries its ``colour`` and ``shape`` for the rewards
(`gcore_rl.rewards.image`). `draw` renders a row's image with a random size and position, which is
what the flow-matching warm start (`gcore_rl.training.flow_sft`) learns from. Everything is numpy and
seeded, so a task's rows and images are the same on every machine.
"""

from __future__ import annotations

import numpy as np

from gcore_rl.rewards.image import PALETTE

SHAPES = ("circle", "square")


def shape_rows() -> list[dict]:
    """Every (colour, shape) prompt of the task, in a fixed order: ``{"prompt", "colour", "shape"}``."""
    return [{"prompt": f"a {colour} {shape}", "colour": colour, "shape": shape} for colour in PALETTE for shape in SHAPES]


def draw(row: dict, resolution: int, rng: np.random.Generator, min_fraction: float = 0.2,
         max_fraction: float = 0.4) -> np.ndarray:
    """``[H, W, 3]`` float32 image in [0, 1]: the row's shape in its colour, side (or diameter) a random
    fraction of the image in [min_fraction, max_fraction], at a random position, on black."""
    side = max(2, int(round(rng.uniform(min_fraction, max_fraction) * resolution)))
    top, left = rng.integers(0, resolution - side + 1, size=2)
    rows, cols = np.mgrid[0:resolution, 0:resolution]
    if row["shape"] == "circle":
        centre, radius = (top + (side - 1) / 2, left + (side - 1) / 2), side / 2
        inside = (rows - centre[0]) ** 2 + (cols - centre[1]) ** 2 <= radius**2
    else:
        inside = (rows >= top) & (rows < top + side) & (cols >= left) & (cols < left + side)
    image = np.zeros((resolution, resolution, 3), dtype=np.float32)
    image[inside] = PALETTE[row["colour"]]
    return image
