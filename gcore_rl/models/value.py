"""The PPO critic: a causal-LM backbone with a scalar head that gives one value per token.

The critic is a plain Hugging Face ``AutoModelForTokenClassification`` with ``num_labels=1``
(``LlamaForTokenClassification``, ``Qwen2ForTokenClassification``, ...): the decoder body of the
policy and a ``score`` linear layer ``hidden -> 1`` (with a bias) applied at every position. That
class is the layout verl's critic uses; it saves and loads with ``save_pretrained`` /
``from_pretrained`` like every other model here, FSDP2 wraps it from outside exactly as it wraps the
actor (`gcore_rl.training.fsdp.shard_model`), and it needs no code of ours in the forward pass. A
hand-made wrapper (TRL's ``AutoModelForCausalLMWithValueHead``) would keep the unused LM head and need
its own save, load and sharding code. Dropout in front of the head is set to 0
(``classifier_dropout``; transformers' default is 0.1), so a value does not depend on train/eval mode.

Where the weights come from, read off the folder's ``config.json`` (`value_source`):

* ``causal_lm``, a policy folder (``gcore-rl init-tiny``, an SFT result): the body is the policy's,
  the LM head is dropped and the new head is **zero-initialised** (weight and bias), so every value
  starts at exactly 0. The first GAE advantages are then the plain Monte-Carlo returns (no noise
  from a random head whose output scale depends on the body's hidden-state norm), the start does
  not depend on a seed, and learning is not blocked: the head's gradient ``h_t * dL/dV_t`` is not
  zero, and after the first step the body receives gradients too.
* ``reward_model``, a scalar reward model (``AutoModelForSequenceClassification``, ``num_labels=1``,
  e.g. from ``gcore-rl rm``): its body and its ``score`` weight are reused as they are (the two
  classes name the head alike) and the bias, which the reward model's head lacks, is zero. The
  value of a whole text (last position) therefore equals the reward model's score of that text,
  and the value of a prefix is the reward model's score of the prefix (OpenRLHF starts its critic
  from the reward model the same way).
* ``value_model``, a folder written from a critic (`save_model_dir`): loaded as saved.

Batches are left-padded with explicit position ids counted from each row's first real token (as
`gcore_rl.rewards.reward_model` does), so a row's values do not depend on what it is batched with.
"""

from __future__ import annotations

import json
from typing import Literal

import torch
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from gcore_rl.errors import ModelLoadError
from gcore_rl.models.loading import LOAD_ERRORS, check_model_dir, own_storage, torch_dtype

ValueSource = Literal["causal_lm", "reward_model", "value_model"]
HEAD_WEIGHT, HEAD_BIAS = "score.weight", "score.bias"
"""Names of the value head's parameters (the same in transformers' token- and sequence-classification classes)."""


def value_source(path) -> ValueSource:
    """What kind of folder `path` is, from the ``architectures`` and label count of its config.json.

    Raises ModelLoadError naming the folder when it is none of: a causal LM, a scalar
    (``num_labels=1``) sequence classifier, a one-label token classifier.
    """
    config = json.loads((check_model_dir(path) / "config.json").read_text(encoding="utf-8"))
    architectures = [str(a) for a in config.get("architectures") or []]
    labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    for suffix, kind in (("ForCausalLM", "causal_lm"), ("ForSequenceClassification", "reward_model"),
                         ("ForTokenClassification", "value_model")):
        if any(a.endswith(suffix) for a in architectures):
            if kind != "causal_lm" and labels != 1:
                raise ModelLoadError(f"'{path}' is a {suffix[3:]} model with {labels} labels; a critic starts from "
                                     "a scalar head (num_labels=1)")
            return kind  # type: ignore[return-value]
    raise ModelLoadError(f"cannot start a critic from '{path}' (architectures: {architectures or 'none'}); point it "
                         "at a causal LM, a scalar reward model or a saved critic")


def load_value_model(path, dtype: str = "float32", attn_implementation: str = "sdpa",
                     device: torch.device | str = "cpu") -> PreTrainedModel:
    """A trainable critic from the local folder `path` (see the module docstring for the three kinds).

    Returns an ``AutoModelForTokenClassification`` with one label and no dropout, on `device`, every
    tensor in storage of its own (`own_storage`). Raises ModelLoadError naming the folder when it
    cannot be loaded, or when a head the kind promises is missing from its weights.
    """
    model_dir = check_model_dir(path)
    source = value_source(model_dir)
    try:
        config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        config.num_labels = 1
        config.classifier_dropout = 0.0
        model, info = AutoModelForTokenClassification.from_pretrained(
            model_dir, config=config, dtype=torch_dtype(dtype), attn_implementation=attn_implementation,
            local_files_only=True, output_loading_info=True)
    except LOAD_ERRORS as exc:
        raise ModelLoadError(f"could not load a critic (token classification, num_labels=1) from '{model_dir}' "
                             f"({type(exc).__name__}: {exc})") from exc
    missing = set(info["missing_keys"])
    expected_missing = {"causal_lm": {HEAD_WEIGHT, HEAD_BIAS}, "reward_model": {HEAD_BIAS}, "value_model": set()}[source]
    if missing != expected_missing:
        raise ModelLoadError(f"critic from '{model_dir}' ({source}): weights missing from the folder: "
                             f"{sorted(missing) or 'none'}, expected {sorted(expected_missing) or 'none'}")
    with torch.no_grad():
        for name, parameter in model.score.named_parameters(prefix="score"):
            if name in missing:
                parameter.zero_()
    return own_storage(model.to(device))


def state_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids `[B, T]` counted from each row's first real token (0 on left padding)."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def position_values(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The head's output at every position: entry ``[b, t]`` is the value of the prefix ``input_ids[b, :t + 1]``.

    Args: `input_ids`, `attention_mask` `[B, T]`, any mix of left and right padding.
    Returns: `[B, T]` fp32 (differentiable w.r.t. the model), 0 at padded positions. For a
    left-padded row the last column is the value of the whole text: with a critic started from a
    reward model, that is the reward model's score of the text.
    """
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=state_positions(attention_mask),
                   use_cache=False).logits
    values = logits[..., 0].float()
    return torch.where(attention_mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))


def token_values(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 first_scored: int = 1) -> torch.Tensor:
    """Values in the trainer's log-prob layout: entry ``[b, t]`` is ``V`` of the state *before* token ``t``.

    That is the head's output at position ``t - 1``, aligned as `gcore_rl.training.logprobs.token_logprobs`
    aligns log-probs with `input_ids` (and as `gcore_rl.algos.advantages.gae_advantages` reads its
    `values`): the value of the state in which token ``t`` was chosen.

    Args: `input_ids`, `attention_mask` `[B, T]`; `first_scored`: the first column that is needed (e.g.
    the batch's first response column); earlier columns are 0, and so is column 0 always.
    Returns: `[B, T]` fp32, differentiable; 0 where the state's position is padding.
    """
    before = position_values(model, input_ids, attention_mask)[:, :-1]
    values = torch.nn.functional.pad(before, (1, 0))
    first_scored = max(1, first_scored)
    if first_scored > 1:
        values = torch.nn.functional.pad(values[:, first_scored:], (first_scored, 0))
    return values
