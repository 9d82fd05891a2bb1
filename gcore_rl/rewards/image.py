"""Built-in rule rewards on pixels, for diffusion policies.

An image rule reward has the signature of every rule reward, ``fn(prompt, image, **row) -> float``,
where `image` is the decoded sample as a ``[H, W, 3]`` float32 numpy array in [0, 1] (see
`gcore_rl.rewards.rule`): the same `RewardConfig` weights, error policy and worker pool serve text
and images. Rows name a ``colour`` of `PALETTE` (the synthetic task `gcore_rl.data.shape_task` draws them).
"""

from __future__ import annotations

import numpy as np

PALETTE: dict[str, tuple[float, float, float]] = {
    "red": (1.0, 0.0, 0.0), "green": (0.0, 1.0, 0.0), "blue": (0.0, 0.0, 1.0),
    "yellow": (1.0, 1.0, 0.0), "cyan": (0.0, 1.0, 1.0), "magenta": (1.0, 0.0, 1.0),
}
"""The colours the pixel rewards know, as RGB in [0, 1]."""


def _check_image(image: object) -> np.ndarray:
    if not isinstance(image, np.ndarray) or image.ndim != 3 or image.shape[-1] != 3:
        raise TypeError(f"expected an image as a [H, W, 3] array in [0, 1], got "
                        f"{type(image).__name__}{getattr(image, 'shape', '')}")
    return image


def _target(colour: str) -> np.ndarray:
    if colour not in PALETTE:
        raise ValueError(f"colour {colour!r} is not one of {', '.join(PALETTE)}")
    return np.asarray(PALETTE[colour], dtype=np.float32)


def colour_coverage(prompt: str, image: np.ndarray, colour: str, width: float = 0.35, penalty: float = 0.5,
                    **_: object) -> float:
    """How much of the image is painted in the row's colour, less how much in other colours, in [-penalty, 1].

    Per pixel, ``match = exp(-|pixel - colour|² / (2·width²))`` and ``lit`` = its brightest channel;
    the score is the mean over pixels of ``match - penalty·lit·(1 - match)``: 1 for an image of that
    colour only, 0 for black, about -penalty for an image of another bright colour, so colour noise does not pay.
    """
    pixels = _check_image(image)
    match = np.exp(-((pixels - _target(colour)) ** 2).sum(axis=-1) / (2.0 * width**2))
    return float((match - penalty * pixels.max(axis=-1) * (1.0 - match)).mean())


def colour_accuracy(prompt: str, image: np.ndarray, colour: str, **_: object) -> float:
    """1.0 when the mean colour of the image's lit pixels (brightest channel > 0.3) is nearest to the
    row's colour among the palette, else 0.0 (also 0.0 for an image with no lit pixel)."""
    _target(colour)  # an unknown colour is an error, not a 0
    pixels = _check_image(image).reshape(-1, 3)
    lit = pixels[pixels.max(axis=1) > 0.3]
    if len(lit) == 0:
        return 0.0
    mean = lit.mean(axis=0)
    nearest = min(PALETTE, key=lambda name: float(((mean - np.asarray(PALETTE[name])) ** 2).sum()))
    return float(nearest == colour)


def brightness(prompt: str, image: np.ndarray, target: float = 1.0, **_: object) -> float:
    """1 - |mean pixel value - target| (a target brightness in [0, 1])."""
    return 1.0 - abs(float(_check_image(image).mean()) - target)
