"""A scalar reward model that reads images: a vision-language body (Qwen2-VL) with a one-output head.

transformers has sequence-classification classes for text decoders (``Qwen2ForSequenceClassification``)
but none for Qwen2-VL, so this is the same layout built from parts: the VLM as Hugging Face saves it
(config, weights, tokenizer, image processor) and, beside it, ``reward_head.safetensors`` holding the
head's ``score.weight`` `[1, H]` (no bias, as in transformers' classes). A folder with that file is a
vision reward model; the same folder without it is a policy. The score of a sample is the head applied
to the decoder's last hidden state at the row's last real token, which is how transformers'
``*ForSequenceClassification`` pools; batches are left-padded, so that is the last column.

The policy's LM head stays in the folder unused: the body loads with the model's own class and its
own checkpoint code, which keeps a real Qwen2-VL folder and the tiny one on one path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from gcore_rl.errors import ModelLoadError
from gcore_rl.models.loading import check_model_dir, load_causal_lm, read_model_config, save_model_dir
from gcore_rl.models.vision import batch_positions, is_vision_config, vision_forward_inputs
from gcore_rl.records import ImageInputs

HEAD_FILE = "reward_head.safetensors"
"""The scalar head of a vision reward model, beside the vision-language model's own files."""
HEAD_WEIGHT = "score.weight"


def is_vision_reward_dir(path: str | Path) -> bool:
    """Whether `path` holds a vision reward model (a vision-language model folder with `HEAD_FILE`)."""
    return (Path(path) / HEAD_FILE).is_file()


def check_vision_reward_dir(path: str | Path) -> None:
    """Raise ModelLoadError naming the folder unless `path` is a vision reward model whose head fits its body:
    `HEAD_FILE` holds `score.weight` of shape `[1, hidden_size]`. Reads config.json and the head file's header
    only (cheap enough for the driver to check before any process starts)."""
    from safetensors import safe_open

    model_dir = check_model_dir(path)
    if not is_vision_reward_dir(model_dir):
        raise ModelLoadError(f"'{model_dir}' is a vision-language model without a reward head ({HEAD_FILE}): a "
                             "policy, not a reward model; train one from it with `gcore-rl rm model.path="
                             f"{model_dir} data.task=shapes_preferences ...` (or your own image preference rows)")
    config = read_model_config(model_dir)
    hidden = (config.get("text_config") or {}).get("hidden_size", config.get("hidden_size"))
    try:
        with safe_open(str(model_dir / HEAD_FILE), framework="pt") as head:
            shape = list(head.get_slice(HEAD_WEIGHT).get_shape()) if HEAD_WEIGHT in head.keys() else None
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"could not read the reward head '{model_dir / HEAD_FILE}' ({type(exc).__name__}: "
                             f"{exc})") from exc
    if shape != [1, hidden]:
        found = "no " + HEAD_WEIGHT if shape is None else f"{HEAD_WEIGHT} of shape {shape}"
        raise ModelLoadError(f"reward head '{model_dir / HEAD_FILE}' holds {found}; the model's hidden size "
                             f"{hidden} needs [1, {hidden}] (was it saved with another model?)")


class VisionRewardModel(torch.nn.Module):
    """A vision-language model's decoder with a linear head `hidden -> 1` at the last position.

    Args:
        body: a Qwen2-VL-family model (`AutoModelForImageTextToText`); its `model` gives hidden states.
        score: the head, `torch.nn.Linear(H, 1, bias=False)`.
    """

    def __init__(self, body: PreTrainedModel, score: torch.nn.Linear):
        super().__init__()
        self.body = body
        self.score = score

    @property
    def config(self):
        return self.body.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                images: Sequence[ImageInputs | None]) -> torch.Tensor:
        """Scores `[B]` (fp32) of left-padded rows `input_ids`, `attention_mask` `[B, T]` whose prompts carry
        `images` (one entry per row, None for a row without images; pixels in row order)."""
        positions = batch_positions(self.body, input_ids, attention_mask, images)
        hidden = self.body.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                                 use_cache=False, **vision_forward_inputs(images, input_ids.device)).last_hidden_state
        return self.score(hidden[:, -1]).squeeze(-1).float()


def _hidden_size(body: PreTrainedModel) -> int:
    return int(body.config.get_text_config().hidden_size)


def start_vision_reward_model(path: str | Path, dtype: str = "float32", attn_implementation: str = "sdpa",
                              device: torch.device | str = "cpu") -> VisionRewardModel:
    """A trainable vision reward model from the local folder `path`: a vision-language policy (the head is
    new, drawn from the global torch generator with the model's ``initializer_range``, as transformers
    initialises a classification head) or a vision reward model (its head as saved).

    Raises ModelLoadError naming the folder when it is not a vision-language model or cannot be loaded.
    """
    model_dir = check_model_dir(path)
    if not is_vision_config(read_model_config(model_dir)):
        raise ModelLoadError(f"'{model_dir}' is not a vision-language model; a vision reward model starts from a "
                             "Qwen2-VL folder (e.g. `gcore-rl init-tiny DIR arch=qwen2_vl` or its SFT result)")
    body = load_causal_lm(model_dir, dtype, attn_implementation, device)
    score = torch.nn.Linear(_hidden_size(body), 1, bias=False, dtype=body.dtype, device=body.device)
    if is_vision_reward_dir(model_dir):
        _load_head(score, model_dir / HEAD_FILE)
    else:
        with torch.no_grad():
            score.weight.normal_(0.0, float(getattr(body.config.get_text_config(), "initializer_range", 0.02)))
    return VisionRewardModel(body, score)


def load_vision_reward_model(path: str | Path, device: torch.device | str = "cpu",
                             dtype: str = "float32") -> VisionRewardModel:
    """A frozen vision reward model (eval mode, no gradients) from the local folder `path`.

    Raises ModelLoadError naming the folder when it has no `HEAD_FILE` or the head does not fit the body.
    """
    model_dir = check_model_dir(path)
    check_vision_reward_dir(model_dir)
    model = start_vision_reward_model(model_dir, dtype, device=device)
    model.requires_grad_(False)
    return model.eval()


def _load_head(score: torch.nn.Linear, file: Path) -> None:
    try:
        weight = load_file(file).get(HEAD_WEIGHT)
    except (OSError, SafetensorError) as exc:
        raise ModelLoadError(f"could not read the reward head '{file}' ({type(exc).__name__}: {exc})") from exc
    if weight is None or tuple(weight.shape) != tuple(score.weight.shape):
        found = "no " + HEAD_WEIGHT if weight is None else f"{HEAD_WEIGHT} of shape {list(weight.shape)}"
        raise ModelLoadError(f"reward head '{file}' holds {found}; the model's hidden size needs "
                             f"{list(score.weight.shape)}")
    with torch.no_grad():
        score.weight.copy_(weight)


def save_vision_reward_model(model: VisionRewardModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> Path:
    """Write the body (weights, tokenizer, image processor) and `HEAD_FILE` to `out_dir`."""
    out = save_model_dir(model.body, tokenizer, out_dir)
    save_file({HEAD_WEIGHT: model.score.weight.detach().contiguous().cpu()}, str(out / HEAD_FILE))
    return out
