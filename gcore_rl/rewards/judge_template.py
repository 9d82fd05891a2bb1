"""The prompt template of the model rewards: how a judge (and a scalar reward model) sees a sample.

A template is text with the placeholders {prompt}, {completion} and {answer}; `render_judge_prompt`
fills them with the texts verbatim (braces inside the texts stay literal). The judge's config
(`JudgeConfig.template`), the scalar reward model and the judge-task data generator share it.

A vision-language judge or reward model reads a sample with its images (`sample_images`): the prompt
row's (matching the `<image>` placeholders its rendered {prompt} carries) and, when the completion is
itself an image (a diffusion policy's `[H, W, 3]` array in [0, 1]), that image, whose place in the
text is an `<image>` placeholder standing for {completion} (`render_sample`).
"""

from __future__ import annotations

import functools
import string

import numpy as np
from PIL import Image

from gcore_rl.errors import ConfigError
from gcore_rl.models.vision import IMAGE_PLACEHOLDER
from gcore_rl.records import RewardInput

TEMPLATE_FIELDS = ("prompt", "completion", "answer")
"""The placeholders a template may use."""


@functools.lru_cache(maxsize=64)
def parse_template(template: str) -> tuple[tuple[str, str | None], ...]:
    """Split `template` into (literal text, field name or None) pieces; ConfigError('template') if invalid."""
    if not isinstance(template, str):
        raise ConfigError("template", f"must be a string, got {type(template).__name__}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigError("template", f"is not a valid template ({exc}); write {{{{ and }}}} for literal braces") from None
    pieces: list[tuple[str, str | None]] = []
    for literal, name, spec, conversion in parsed:
        if name is not None:
            if name not in TEMPLATE_FIELDS:
                known = ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
                raise ConfigError("template", f"unknown placeholder {{{name}}}; known placeholders are {known}")
            if spec or conversion:
                raise ConfigError("template", f"placeholder {{{name}}} may not have a format spec or conversion")
        pieces.append((literal, name))
    return tuple(pieces)


def template_fields(template: str) -> set[str]:
    """The placeholders `template` uses (ConfigError('template') if it is invalid)."""
    return {name for _, name in parse_template(template) if name is not None}


def render_judge_prompt(template: str, prompt: str, completion: str, answer: str | None = None) -> str:
    """Fill `template`'s {prompt}, {completion} and {answer} (None -> '') with the texts verbatim.

    Braces inside the texts are inserted literally. Raises ConfigError('template') for a malformed
    template or an unknown placeholder.
    """
    values = {"prompt": prompt, "completion": completion, "answer": "" if answer is None else answer}
    out: list[str] = []
    for literal, name in parse_template(template):
        out.append(literal)
        if name is not None:
            out.append(str(values[name]))
    return "".join(out)


def render_sample(template: str, sample: RewardInput) -> str:
    """`render_judge_prompt` of one sample: the row's ``answer`` (None -> ''), an image completion written
    as an `IMAGE_PLACEHOLDER`."""
    answer = (sample.row or {}).get("answer")
    completion = IMAGE_PLACEHOLDER if is_image(sample.completion) else sample.completion
    return render_judge_prompt(template, prompt=sample.prompt, completion=completion,
                               answer=None if answer is None else str(answer))


def is_image(completion: object) -> bool:
    """Whether a completion is an image (a diffusion policy's `[H, W, 3]` array) rather than text."""
    return isinstance(completion, np.ndarray)


def sample_images(sample: RewardInput) -> list[Image.Image]:
    """The images a model reads with `sample`, in placeholder order: the prompt row's ``images``, then the
    completion when it is an image (converted to 8-bit RGB)."""
    images = list((sample.row or {}).get("images") or [])
    if is_image(sample.completion):
        images.append(Image.fromarray((np.clip(sample.completion, 0.0, 1.0) * 255).round().astype(np.uint8)))
    return images
