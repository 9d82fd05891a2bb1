"""Reward-model training: a Bradley–Terry scalar head on preference pairs (``gcore-rl rm``).

Each data row holds a prompt, a preferred completion (``chosen``) and a dispreferred one
(``rejected``). Both are rendered through the reward model's `template`, scored by a
sequence-classification head with one output, and the loss is the Bradley–Terry negative log
likelihood ``mean(-log sigmoid(r_chosen - r_rejected))`` (as TRL's RewardTrainer and OpenRLHF's
train_rm). Rendering, tokenising, left padding and pooling are the very functions that
`gcore_rl.rewards.reward_model.ScalarRewardModel` uses at inference (`ScalarRewardModel.encode`,
`ScalarRewardModel.forward_scores`), so a trained model scores a sample exactly as it was trained.

The starting point is a local Hugging Face folder: a causal LM (e.g. the SFT policy; its LM head
is dropped and a new, randomly initialised ``score`` head of one output is added) or an existing
scalar reward model. A vision-language policy (Qwen2-VL) becomes a vision reward model
(`gcore_rl.models.vision_reward`: the VLM plus ``reward_head.safetensors``) that reads the rows'
images (``images``, as for GRPO data; the ``shapes_preferences`` task draws them). The result is
saved in HF format and used in a GRPO job through the ``reward_model`` section (written to
``reward_model.yaml`` next to the weights). Held-out pairs are scored before and after training; the pair accuracy (chosen scored
strictly above rejected) is reported overall and, for rows with a ``mistake`` column (the
``addition_preferences`` and ``shapes_preferences`` tasks), per kind of mistake; with `eval_every`
also during training, where `target_accuracy` stops the run (and fails it, the model saved, when the
step cap comes first) and `keep_best` saves the best evaluation's weights rather than the last step's.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from gcore_rl.configlib import dump_yaml, to_dict
from gcore_rl.data.chat import ChatRenderer, is_chat_row, resolve_chat_template
from gcore_rl.data.config import DataConfig
from gcore_rl.data.images import placeholder_problem
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.data.sources import EVAL_SEED_OFFSET, load_prompt_rows
from gcore_rl.data.tasks import attach_task_images, make_task_rows
from gcore_rl.errors import ConfigError, DataError, ModelLoadError, TargetNotReached
from gcore_rl.models.loading import (
    ModelConfig,
    check_model_dir,
    load_tokenizer,
    read_model_config,
    save_model_dir,
    torch_dtype,
)
from gcore_rl.models.vision import IMAGE_PLACEHOLDER, VisionProcessor, is_vision_config
from gcore_rl.models.vision_reward import (
    VisionRewardModel,
    save_vision_reward_model,
    start_vision_reward_model,
)
from gcore_rl.records import RewardInput
from gcore_rl.rewards.judge_template import sample_images
from gcore_rl.rewards.reward_model import RewardModelConfig, ScalarRewardModel
from gcore_rl.telemetry.loggers import check_loggers, default_loggers, open_loggers
from gcore_rl.telemetry.progress import TrainProgress
from gcore_rl.training.optim_step import LR_SCHEDULE_HELP, LrSchedule, rate_factor

METRICS_FILE = "rm_metrics.jsonl"
"""Per-step metrics of a reward-model run, in its output_dir."""
SUMMARY_FILE = "rm_summary.json"
"""What `run_reward_training` returns, as JSON in output_dir (written also when the target was not reached)."""
REWARD_MODEL_SECTION_FILE = "reward_model.yaml"
"""The ``reward_model`` section of a GRPO recipe that uses the trained model, written to output_dir."""

_RM_DEFAULTS = RewardModelConfig()
_RM_HELP = {f: RewardModelConfig.__dataclass_fields__[f].metadata["help"] for f in ("template", "add_special_tokens", "max_length")}


@dataclass
class RewardTrainConfig:
    """A reward-model (Bradley–Terry) training run."""

    model: ModelConfig = field(
        default_factory=lambda: ModelConfig(path="runs/tiny-sft"),
        metadata={"help": "Model to start from: a causal-LM folder (e.g. an SFT policy; a new scalar head replaces "
                          "its LM head) or an existing scalar reward model (num_labels=1)."},
    )
    data: DataConfig = field(
        default_factory=lambda: DataConfig(task="addition_preferences"),
        metadata={"help": "Preference rows: `prompt` plus the `chosen_field` and `rejected_field` completions "
                          "(task addition_preferences, or a file), or chat rows: `messages` plus chosen/rejected "
                          "replies, or chosen/rejected whole conversations (TRL's preference forms). "
                          "data.eval_prompts is not used: see eval_pairs."},
    )
    chosen_field: str = field(default="chosen", metadata={"help": "Column holding the preferred completion."})
    rejected_field: str = field(default="rejected", metadata={"help": "Column holding the dispreferred completion."})
    template: str = field(default=_RM_DEFAULTS.template, metadata={"help": _RM_HELP["template"] + " Use the same value in the job's reward_model section."})
    add_special_tokens: bool = field(default=_RM_DEFAULTS.add_special_tokens, metadata={"help": _RM_HELP["add_special_tokens"]})
    max_length: int = field(default=_RM_DEFAULTS.max_length, metadata={"help": _RM_HELP["max_length"]})
    output_dir: str = field(default="runs/tiny-rm", metadata={"help": "Where the reward model is saved (HF format); must not exist yet or be empty."})
    steps: int = field(default=300, metadata={"help": "Optimiser steps."})
    batch_size: int = field(default=32, metadata={"help": "Preference pairs per step (2 × batch_size sequences)."})
    lr: float = field(default=3e-4, metadata={"help": "Peak AdamW learning rate (linear warm-up, then lr_schedule)."})
    warmup_steps: int = field(default=20, metadata={"help": "Steps of linear warm-up."})
    lr_schedule: LrSchedule = field(default="constant", metadata={"help": LR_SCHEDULE_HELP})
    seed: int = field(default=0, metadata={"help": "Seed of the new head's initialisation and of the data order."})
    threads: int = field(default=0, metadata={"help": "torch intra-op threads (0 = all cores)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})
    eval_pairs: int = field(
        default=256,
        metadata={"help": "Held-out pairs scored before and after training (synthetic task: generated with seed "
                          "data.seed + 1000003; file: the first eval_pairs rows of eval_path); 0 = no evaluation."},
    )
    eval_every: int = field(default=0, metadata={"help": "Score the held-out pairs every this many steps too, not "
                                                         "only before and after training (0 = only then)."})
    target_accuracy: float = field(default=0.0, metadata={
        "help": "Stop once held-out pair accuracy reaches this (0 = run all `steps`; needs eval_every). If `steps` "
                "runs out first, the model is saved and the command fails naming both, so RL never starts on a "
                "weaker reward model."})
    keep_best: bool = field(default=False, metadata={
        "help": "Save the weights of the evaluation (every eval_every steps) with the best held-out pair accuracy, "
                "ties to the lower held-out loss, not the last step's; keeps a CPU copy of the weights. The "
                "held-out pairs then choose the model: their accuracy is a validation figure."})
    eval_path: str | None = field(
        default=None,
        metadata={"help": "File of held-out preference rows (same columns as data.path) when training from a file."},
    )
    loggers: list[str] = field(default_factory=default_loggers, metadata={"help": "Where step metrics go besides OUTPUT_DIR/rm_metrics.jsonl (always written): any of tensorboard, wandb, mlflow, as for run.loggers of a GRPO job."})

    def validate(self) -> None:
        for section in ("model", "data"):  # again here for configs built in code rather than by load_config
            try:
                getattr(self, section).validate()
            except ConfigError as exc:
                raise exc.with_prefix(section) from None
        for key in ("steps", "batch_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(key, f"must be at least 1, got {value!r}")
        for key in ("warmup_steps", "threads", "eval_pairs", "eval_every"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ConfigError("target_accuracy", f"must be in [0, 1], got {self.target_accuracy}")
        for key, wanted in (("target_accuracy", self.target_accuracy > 0), ("keep_best", self.keep_best)):
            if wanted and (self.eval_every == 0 or self.eval_pairs == 0 or (self.data.path and not self.eval_path)):
                raise ConfigError(key, "needs held-out pairs scored during training: eval_every > 0, eval_pairs > 0 "
                                  "and, for file data (data.path), eval_path")
        if not math.isfinite(self.lr) or self.lr <= 0:
            raise ConfigError("lr", f"must be a finite number > 0, got {self.lr}")
        if not (isinstance(self.output_dir, str) and self.output_dir.strip()):
            raise ConfigError("output_dir", "must name a directory for the trained reward model")
        for key in ("chosen_field", "rejected_field"):
            name = getattr(self, key)
            if not name:
                raise ConfigError(key, "must be a non-empty column name")
            if name in (self.data.prompt_field, self.data.answer_field):
                raise ConfigError(key, f"`{name}` is also data.prompt_field or data.answer_field; the chosen and "
                                  "rejected completions need columns of their own")
        if self.chosen_field == self.rejected_field:
            raise ConfigError("rejected_field", f"must differ from chosen_field (both are `{self.chosen_field}`)")
        if self.eval_path is not None and self.data.path is None:
            raise ConfigError("eval_path", "is for file data (data.path); a synthetic task generates its own held-out pairs")
        # template / add_special_tokens / max_length: the same rules as at inference (same key names)
        self.reward_model_config().validate()
        check_loggers(self.loggers)

    def reward_model_config(self, model_path: str | None = None) -> RewardModelConfig:
        """The inference config that renders and truncates texts exactly as this run trains on them."""
        return RewardModelConfig(enabled=model_path is not None, model_path=model_path, template=self.template,
                                 add_special_tokens=self.add_special_tokens, max_length=self.max_length)


@dataclass
class PreferencePair:
    """One preference pair: the chosen and rejected samples (same prompt and row), and the row's `mistake` if any."""

    chosen: RewardInput
    rejected: RewardInput
    kind: str | None = None


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """``mean(-log sigmoid(chosen - rejected))`` over pairs: the Bradley–Terry negative log likelihood."""
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


def preference_pairs(rows: Sequence[dict[str, Any]], source: str, chosen_field: str = "chosen",
                     rejected_field: str = "rejected", chat: ChatRenderer | None = None) -> list[PreferencePair]:
    """Validated pairs of `rows` (from `source`, named in errors).

    A completion may be a string or a number (converted to text). Raises `DataError` naming the
    source, the row index and the field for a row without a string prompt or without a chosen or
    rejected completion. Chat rows (`messages`, or conversations as chosen/rejected) are rendered
    with `chat` (`ChatRenderer.preference`): the prompt with the generation prompt, each side as
    the template writes the reply.
    """
    pairs = []
    for index, row in enumerate(rows):
        kind = row.get("mistake")
        kind = None if kind is None else str(kind)
        if chat is not None and (is_chat_row(row) or isinstance(row.get(chosen_field), list)):
            prompt, chosen, rejected = chat.preference(row, (chosen_field, rejected_field), f"{source}, row {index}")
            pairs.append(PreferencePair(RewardInput(prompt, chosen, row), RewardInput(prompt, rejected, row), kind))
            continue
        prompt = row.get("prompt")
        if not isinstance(prompt, str):
            raise DataError(f"preference row {index} of {source} has no text prompt (got {prompt!r})")
        texts = []
        for key in (chosen_field, rejected_field):
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                problem = "has no" if value is None else f"has a {type(value).__name__} in its"
                raise DataError(f"preference row {index} of {source} {problem} `{key}` field; every row needs a "
                                f"chosen and a rejected completion as text (columns `{chosen_field}` and "
                                f"`{rejected_field}`, set by chosen_field / rejected_field)")
            texts.append(str(value))
        pairs.append(PreferencePair(RewardInput(prompt, texts[0], row), RewardInput(prompt, texts[1], row), kind))
    return pairs


def init_reward_model(cfg: ModelConfig):
    """A trainable scalar reward model from the local folder `cfg.path`: a sequence-classification model with
    one output, or for a vision-language folder a `VisionRewardModel` (`gcore_rl.models.vision_reward`).

    From a policy folder the ``score`` head is new (initialised from the global torch seed).
    Wrap it in a `ScalarRewardModel`, which sets the pad id the pooling needs. Raises ModelLoadError
    naming the folder.
    """
    from transformers import AutoModelForSequenceClassification

    model_dir = check_model_dir(cfg.path)
    if is_vision_config(read_model_config(model_dir)):
        return start_vision_reward_model(model_dir, cfg.dtype, cfg.attn_implementation)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            model_dir, num_labels=1, dtype=torch_dtype(cfg.dtype), attn_implementation=cfg.attn_implementation,
            local_files_only=True)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"could not start a scalar reward model (sequence classification, num_labels=1) from "
                             f"'{model_dir}': {exc}") from exc
    return model


def pair_scores(scorer: ScalarRewardModel, pairs: Sequence[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw scores `[P]` of the chosen and of the rejected samples, WITH gradients (one left-padded forward pass).

    Samples are encoded by `scorer.encode` and scored by `scorer.forward_scores`, as in `ScalarRewardModel.raw_scores`.
    """
    encoded = [scorer.encode(p.chosen) for p in pairs] + [scorer.encode(p.rejected) for p in pairs]
    scores = scorer.forward_scores(encoded)
    return scores[: len(pairs)], scores[len(pairs):]


def evaluate_pairs(scorer: ScalarRewardModel, pairs: Sequence[PreferencePair]) -> dict[str, float]:
    """Pair accuracy (chosen strictly above rejected), mean margin and loss of `pairs`, scored as at inference.

    Keys ``eval/accuracy``, ``eval/margin``, ``eval/loss``, and ``eval/accuracy/<kind>`` for each
    `PreferencePair.kind` present. Empty dict for no pairs.
    """
    if not pairs:
        return {}
    chosen = torch.tensor(scorer.raw_scores([p.chosen for p in pairs]))
    rejected = torch.tensor(scorer.raw_scores([p.rejected for p in pairs]))
    wins = (chosen > rejected).float()
    metrics = {"eval/accuracy": float(wins.mean()), "eval/margin": float((chosen - rejected).mean()),
               "eval/loss": float(bradley_terry_loss(chosen, rejected))}
    by_kind: dict[str, list[float]] = defaultdict(list)
    for pair, win in zip(pairs, wins.tolist(), strict=True):
        if pair.kind is not None:
            by_kind[pair.kind].append(win)
    for kind in sorted(by_kind):
        metrics[f"eval/accuracy/{kind}"] = sum(by_kind[kind]) / len(by_kind[kind])
    return metrics


def load_eval_pairs(cfg: RewardTrainConfig, tokenizer=None) -> list[PreferencePair]:
    """The held-out pairs: `eval_pairs` fresh task rows (seed ``data.seed + 1_000_003``) or the first rows of `eval_path`."""
    if cfg.eval_pairs == 0:
        return []
    data = cfg.data
    if data.task is not None:
        rows = attach_task_images(make_task_rows(data.task, cfg.eval_pairs, data.seed + EVAL_SEED_OFFSET,
                                                 **data.task_options))
        return preference_pairs(rows, f"synthetic task '{data.task}' (held-out)", cfg.chosen_field, cfg.rejected_field)
    if cfg.eval_path is None:
        return []
    eval_data = DataConfig(task=None, path=cfg.eval_path, prompt_field=data.prompt_field, answer_field=data.answer_field,
                           messages_field=data.messages_field, chat_template=data.chat_template)
    rows = load_prompt_rows(eval_data, require_prompt=False)[: cfg.eval_pairs]
    return preference_pairs(rows, cfg.eval_path, cfg.chosen_field, cfg.rejected_field, _chat(cfg, rows, tokenizer))


def _chat(cfg: RewardTrainConfig, rows: Sequence[dict[str, Any]], tokenizer) -> ChatRenderer | None:
    """The renderer for chat preference rows (None when `rows` has none)."""
    if not any(is_chat_row(row) or isinstance(row.get(cfg.chosen_field), list) for row in rows):
        return None
    return ChatRenderer(tokenizer, resolve_chat_template(tokenizer, cfg.data.chat_template, cfg.model.path))


def _check_images(pairs: Sequence[PreferencePair], vision: bool, model_path: str, source: str) -> None:
    """DataError naming the first row with images when the model is text-only (it would read only their
    placeholders); for a vision-language model, the first row whose placeholders and images do not pair up.
    The two sides of a pair share the prompt and the row, so the chosen side stands for both."""
    for index, pair in enumerate(pairs):
        images = len(sample_images(pair.chosen))
        if images and not vision:
            raise DataError(f"preference row {index} of {source} has images, and '{model_path}' is a text-only model "
                            "that cannot read them; start the reward model from a vision-language policy (e.g. "
                            "`gcore-rl init-tiny DIR arch=qwen2_vl`, or its SFT result) or drop the images")
        problem = vision and placeholder_problem(pair.chosen.prompt.count(IMAGE_PLACEHOLDER), images)
        if problem:
            raise DataError(f"preference row {index} of {source}: {problem}")


def _check_output_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise ConfigError("output_dir", f"'{out}' exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        what = "a reward-model run" if (out / METRICS_FILE).exists() else "files"
        raise ConfigError("output_dir", f"'{out}' already holds {what}; choose a new output_dir or remove the old "
                          "one, so earlier results (or the starting model) are never overwritten")


def run_reward_training(cfg: RewardTrainConfig) -> dict[str, float]:
    """Train a scalar reward model and save it to `cfg.output_dir`; returns the final metrics.

    Everything that can be wrong (config, output folder, model folder, tokenizer, every training
    and held-out row) is checked before the output folder is created. Returned keys: ``loss``,
    ``accuracy`` and ``margin`` (last training step), ``steps`` (run: fewer than `cfg.steps` when
    `target_accuracy` was reached), ``eval/...`` of `evaluate_pairs` for the saved weights (when
    there are held-out pairs: after the last step, or with `keep_best` at ``best_step``),
    ``eval_accuracy_before`` and ``wall_seconds``; also written to `SUMMARY_FILE`. Raises
    `TargetNotReached` after saving when `target_accuracy` is set and the cap came first.
    """
    cfg.validate()
    out = Path(cfg.output_dir)
    _check_output_dir(out)
    tokenizer = load_tokenizer(cfg.model.path)
    source = cfg.data.path or (f"synthetic task '{cfg.data.task}' (data.task must name a task with preference "
                               "pairs, such as addition_preferences; a recipe's `data:` section without `task` "
                               "gets the prompt task `addition`)")
    rows = load_prompt_rows(cfg.data, require_prompt=False)
    pairs = preference_pairs(rows, source, cfg.chosen_field, cfg.rejected_field, _chat(cfg, rows, tokenizer))
    held_out = load_eval_pairs(cfg, tokenizer)
    vision = is_vision_config(read_model_config(cfg.model.path))
    _check_images(pairs, vision, cfg.model.path, source)
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    model = init_reward_model(cfg.model)
    processor = VisionProcessor.from_model_dir(cfg.model.path, tokenizer) if vision else None
    scorer = ScalarRewardModel(cfg.reward_model_config(), model, tokenizer, processor=processor)
    sampler = ShardedPromptSampler(len(pairs), seed=cfg.seed, shuffle=cfg.data.shuffle)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: rate_factor(s, cfg.warmup_steps, cfg.steps, cfg.lr_schedule))
    started = time.perf_counter()
    dump_yaml(cfg, out / "rm_config.yaml")  # first, so a run that fails its target keeps its settings too
    result: dict[str, float] = {}
    best = BestWeights() if cfg.keep_best else None
    with open_loggers(cfg.loggers, out, out / METRICS_FILE, to_dict(cfg)) as writer, \
            TrainProgress(cfg.steps, enabled=cfg.progress, description="reward model") as progress:
        before = evaluate_pairs(scorer, held_out)
        if before:
            writer.write(0, before)
            result["eval_accuracy_before"] = before["eval/accuracy"]
        last: dict[str, float] = {}
        model.train()
        for step in range(1, cfg.steps + 1):
            chosen, rejected = pair_scores(scorer, [pairs[i] for i in sampler.next_indices(cfg.batch_size)])
            loss = bradley_terry_loss(chosen, rejected)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            margin = (chosen - rejected).detach()
            result.update(loss=float(loss.detach()), accuracy=float((margin > 0).float().mean()),
                          margin=float(margin.mean()))
            writer.write(step, {"rm/loss": result["loss"], "rm/accuracy": result["accuracy"],
                                "rm/margin": result["margin"], "rm/grad_norm": float(grad_norm),
                                "lr": scheduler.get_last_lr()[0]})
            progress.update(step, {"accuracy": result["accuracy"]})
            due = step == cfg.steps or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
            if not (held_out and due):
                continue
            model.eval()
            last = evaluate_pairs(scorer, held_out)
            model.train()
            writer.write(step, last)
            if best is not None:
                best.offer(step, last, model)
            if 0 < cfg.target_accuracy <= last["eval/accuracy"]:
                break
        model.eval()
    result["steps"] = step
    if best is not None and best.state is not None:
        model.load_state_dict(best.state)
        last = best.metrics
        result["best_step"] = best.step
    result.update(last)
    model.requires_grad_(False)
    if isinstance(model, VisionRewardModel):
        save_vision_reward_model(model, tokenizer, out)
    else:
        save_model_dir(model, tokenizer, out)
    dump_yaml(_RewardModelSection(cfg.reward_model_config(str(out))), out / REWARD_MODEL_SECTION_FILE)
    result["wall_seconds"] = time.perf_counter() - started
    (out / SUMMARY_FILE).write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
    reached = last.get("eval/accuracy", 0.0)
    if cfg.target_accuracy > 0 and reached < cfg.target_accuracy:
        raise TargetNotReached(
            f"reward-model training stopped at its cap of {cfg.steps} steps with held-out pair accuracy "
            f"{reached:.3f}, below target_accuracy={cfg.target_accuracy}; the model is saved in {out} "
            "but would reward RL by its mistakes. Allow more steps (steps=N), train on more pairs "
            "(data.num_prompts), or lower target_accuracy; remove the output directory first.")
    return result


def better_evaluation(new: dict[str, float], old: dict[str, float]) -> bool:
    """Whether held-out metrics `new` beat `old`: higher pair accuracy, ties broken by lower held-out loss."""
    return (new["eval/accuracy"], -new["eval/loss"]) > (old["eval/accuracy"], -old["eval/loss"])


@dataclass
class BestWeights:
    """The best held-out evaluation so far (`better_evaluation`), its step and a CPU copy of the weights then."""

    step: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, torch.Tensor] | None = None

    def offer(self, step: int, metrics: dict[str, float], model: torch.nn.Module) -> None:
        """Keep `model`'s weights if `metrics` (of step `step`) beat the best so far."""
        if self.state is None or better_evaluation(metrics, self.metrics):
            self.step, self.metrics = step, metrics
            self.state = {name: value.detach().to("cpu", copy=True) for name, value in model.state_dict().items()}


@dataclass
class _RewardModelSection:
    """``reward_model:`` section of a job recipe (what `REWARD_MODEL_SECTION_FILE` holds)."""

    reward_model: RewardModelConfig
