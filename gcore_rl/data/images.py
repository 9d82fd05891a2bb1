"""The images of prompt rows: decoded from files, checked, and drawn for the synthetic visual task.

A prompt row with images holds ``images``: a list of RGB `PIL.Image.Image`s, decoded and loaded,
and its text has one `gcore_rl.models.vision.IMAGE_PLACEHOLDER` per image, in order (a chat row: one
``{"type": "image"}`` content part per image, `gcore_rl.data.chat`). In a file an image is a path
(relative to the folder of the data file, or absolute), its encoded bytes, or a ``{"bytes", "path"}``
struct (the layout of Hugging Face `datasets.Image`); the column holds a list of them (or one).

Decoding is the expensive part, so only a controller's own rows are decoded (`decode_images`), while
the count of images against placeholders is checked on the whole source, on Arrow columns
(`first_count_mismatch`), so every controller reports the same first bad row. Every problem is a
`DataError` that names the source file and the global row (and the image file for a path).

The synthetic scenes (`random_scene`, `draw_scene`) are coloured shapes on black, drawn with numpy
from a seeded generator, so the same scene has the same pixels on every machine.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from gcore_rl.errors import DataError
from gcore_rl.models.vision import IMAGE_PLACEHOLDER, count_of
from gcore_rl.rewards.image import PALETTE

if TYPE_CHECKING:
    import pyarrow as pa


def image_count(value: Any) -> int:
    """How many images a row's image column holds: a list's length, 0 for null, 1 for a single image."""
    if value is None:
        return 0
    return len(value) if isinstance(value, list) else 1


def decode_images(value: Any, base_dir: Path, where: str, max_pixels: int) -> list[Image.Image]:
    """A row's images (the value of its image column) as loaded RGB images; `where` names the row in errors.

    Paths are relative to `base_dir` (the data file's folder) unless absolute. DataError for a missing
    file, bytes that are no image, an image over `max_pixels` pixels, or a value that is no image at all.
    """
    values = [] if value is None else value if isinstance(value, list) else [value]
    return [_decode_one(item, base_dir, f"{where}: image {number}", max_pixels) for number, item in enumerate(values)]


def _decode_one(value: Any, base_dir: Path, where: str, max_pixels: int) -> Image.Image:
    if isinstance(value, dict):  # datasets.Image: the bytes when stored, else the path
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _open_image(io.BytesIO(bytes(value)), f"{where} ({len(value)} bytes)", max_pixels)
    if isinstance(value, str) and value:
        path = Path(value).expanduser()
        path = path if path.is_absolute() else base_dir / path
        if not path.is_file():
            raise DataError(f"{where} is the file {path}, which does not exist (relative image paths start from the "
                            f"data file's folder, {base_dir}); fix the path or add the file")
        return _open_image(path, f"{where}, file {path}", max_pixels)
    raise DataError(f"{where} is neither a path nor image bytes (got {type(value).__name__} {value!r:.40}); give "
                    "a path, the encoded bytes, or a {bytes, path} struct as datasets.Image stores it")


def _open_image(source: io.BytesIO | Path, where: str, max_pixels: int) -> Image.Image:
    """The image at `source` decoded as RGB; its size is checked from the header, before the pixels are read."""
    try:
        with warnings.catch_warnings():  # the size check below is ours; PIL's own bomb warning would only repeat it
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(source) as image:
                width, height = image.size
                if width * height > max_pixels:
                    raise DataError(f"{where} is {width}×{height} = {width * height} pixels, more than "
                                    f"data.max_image_pixels={max_pixels}; downscale the image, or raise "
                                    "data.max_image_pixels if the model's processor should scale it down")
                return image.convert("RGB")  # a new, loaded image: the file is closed when this returns
    except Image.DecompressionBombError as exc:
        raise DataError(f"{where} is refused by PIL as a possible decompression bomb ({exc}); downscale the image "
                        "or remove the row") from None
    except (OSError, SyntaxError, ValueError) as exc:  # PIL's errors for unknown formats and broken data
        raise DataError(f"{where} cannot be decoded as an image ({type(exc).__name__}: {exc}); replace it with a "
                        "valid PNG/JPEG or remove the row") from None


def placeholder_problem(placeholders: int, images: int, what: str = f"{IMAGE_PLACEHOLDER} placeholders") -> str | None:
    """Why a row's text and images do not pair up one to one, or None when they do."""
    if placeholders == images:
        return None
    return (f"the prompt has {placeholders} {what} but the row has {count_of(images, 'image')}; give exactly one image "
            "per placeholder, in order")


def image_counts(column: pa.ChunkedArray) -> pa.ChunkedArray:
    """Images per row of an image column (`image_count` on Arrow, without converting the values)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return pc.fill_null(pc.list_value_length(column), 0)
    return pc.if_else(pc.is_null(column), 0, 1)


def first_count_mismatch(placeholders: pa.ChunkedArray, images: pa.ChunkedArray) -> int | None:
    """The first row whose placeholder count (`placeholders`, per row) differs from its image count
    (`image_counts(images)`), or None when every row pairs up."""
    import pyarrow as pa
    import pyarrow.compute as pc

    differs = pc.not_equal(pc.cast(placeholders, pa.int64()), pc.cast(image_counts(images), pa.int64()))
    index = int(pc.index(differs, True).as_py())
    return None if index < 0 else index


# --- the synthetic shapes scenes ------------------------------------------------------------------

SCENE_COLOURS = ("red", "green", "blue", "yellow")
"""Colours of the synthetic scenes (of `gcore_rl.rewards.image.PALETTE`): few and far apart, so a tiny
vision tower tells them apart at a glance."""
SCENE_SHAPES = ("circle", "square")


def shape_mask(shape: str, top: int, left: int, side: int, size: int) -> np.ndarray:
    """``[size, size]`` bool: the pixels of a square, or of the circle inscribed in it, whose box has its
    top-left corner at (`top`, `left`) and sides of `side` pixels."""
    rows, cols = np.mgrid[0:size, 0:size]
    if shape == "circle":
        centre_row, centre_col, radius = top + (side - 1) / 2, left + (side - 1) / 2, side / 2
        return (rows - centre_row) ** 2 + (cols - centre_col) ** 2 <= radius**2
    return (rows >= top) & (rows < top + side) & (cols >= left) & (cols < left + side)


def random_scene(rng: np.random.Generator, size: int, count: int) -> dict[str, Any]:
    """A scene of `count` (1-4) shapes in a `size`² image: ``{"size", "shapes": [[shape, top, left, side], ...]}``.

    Each shape lies in its own quadrant, a margin of an eighth of a quadrant from its edges, so shapes
    never touch (also after the model's processor scales the image down) and can be counted.
    """
    cell = size // 2
    margin = max(1, cell // 8)
    low, high = max(2, (3 * cell) // 8), cell - 2 * margin
    shapes = []
    for quadrant in rng.permutation(4)[:count]:
        side = int(rng.integers(low, high + 1))
        top, left = (int(quadrant) // 2) * cell + margin, (int(quadrant) % 2) * cell + margin
        top += int(rng.integers(0, high - side + 1))
        left += int(rng.integers(0, high - side + 1))
        shapes.append([SCENE_SHAPES[int(rng.integers(len(SCENE_SHAPES)))], top, left, side])
    return {"size": size, "shapes": shapes}


def draw_scene(scene: dict[str, Any], colour: str) -> Image.Image:
    """The RGB image of a `random_scene`: its shapes in `colour` on black."""
    size = int(scene["size"])
    pixels = np.zeros((size, size, 3), dtype=np.uint8)
    rgb = np.round(np.asarray(PALETTE[colour]) * 255).astype(np.uint8)
    for shape, top, left, side in scene["shapes"]:
        pixels[shape_mask(shape, top, left, side, size)] = rgb
    return Image.fromarray(pixels)
