"""Image tensors ↔ arrays, and the PNG grids a run writes of its samples."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor


def to_arrays(images: Tensor) -> list[np.ndarray]:
    """``[B, 3, H, W]`` tensor in [0, 1] → B float32 ``[H, W, 3]`` arrays (what image rewards receive)."""
    return [np.ascontiguousarray(image.permute(1, 2, 0).float().numpy()) for image in images]


def to_model_range(arrays: list[np.ndarray]) -> Tensor:
    """B ``[H, W, 3]`` arrays in [0, 1] → ``[B, 3, H, W]`` tensor in [-1, 1] (pixel-space latents)."""
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float() * 2.0 - 1.0


def write_grid(images: Tensor, path: str | Path, columns: int, scale: int = 4, labels: list[str] | None = None) -> Path:
    """Write ``[B, 3, H, W]`` images in [0, 1] as one PNG grid (each image enlarged `scale`× by pixel
    repetition, 2-pixel grey gutters); with `labels`, the first of each row's labels is the row's caption
    in a text file next to it (`path` with suffix .txt)."""
    from PIL import Image

    b, _, h, w = images.shape
    rows = -(-b // columns)
    gutter = 2
    canvas = np.full((rows * (h * scale + gutter) + gutter, columns * (w * scale + gutter) + gutter, 3), 96, dtype=np.uint8)
    for i, array in enumerate(to_arrays(images)):
        r, c = divmod(i, columns)
        tile = np.repeat(np.repeat((array.clip(0, 1) * 255).round().astype(np.uint8), scale, 0), scale, 1)
        top, left = gutter + r * (h * scale + gutter), gutter + c * (w * scale + gutter)
        canvas[top:top + h * scale, left:left + w * scale] = tile
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(canvas).save(path)
    if labels:
        path.with_suffix(".txt").write_text("".join(f"row {r + 1}: {labels[r * columns]}\n" for r in range(rows)))
    return path
