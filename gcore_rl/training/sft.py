"""Supervised warm start: teach a model the answer format of a prompt dataset.

Cross-entropy on the answer tokens (and the closing EOS) of `prompt + answer` sequences; the
prompt tokens are context only. Chat-format rows (`messages`) are rendered with the chat template:
the final assistant turn is the target, as the template writes it (reply and end-of-turn marker),
and everything before it is context (`gcore_rl.data.chat`). Used to give the tiny random model enough competence that RL
has a reward signal to climb (a random policy almost never produces a correct sum).

With `target_accuracy` the run stops on a measured criterion: greedy accuracy on held-out
prompts, checked every `eval_every` steps, reaching the target. `steps` is then only a cap; a run
that reaches it first saves its model and fails with `SftTargetNotReached`, so a pipeline does not
go on to RL from a start too weak to learn from. With `stop_at_target=false` every step runs and the
last step's evaluation is held to the target: the first evaluation past a target is the luckiest of
a noisy run's, while a rate that decays to `steps` (`lr_schedule`) ends on a settled model.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from gcore_rl.agents.tools import load_tools
from gcore_rl.configlib import dump_yaml, load_config, to_dict
from gcore_rl.data.chat import ChatRenderer, is_chat_row, render_prompt_rows, resolve_chat_template
from gcore_rl.data.config import DataConfig
from gcore_rl.data.prompts import PromptEncoder, policy_prompt_encoder
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.data.sources import load_eval_rows, load_prompt_rows
from gcore_rl.errors import ConfigError, DataError, TargetNotReached
from gcore_rl.models.loading import ModelConfig, context_limit, load_causal_lm, load_tokenizer, save_model_dir
from gcore_rl.models.vision import count_of
from gcore_rl.records import prompt_images
from gcore_rl.rewards.ecosystem import check_reward_path, task_scorer
from gcore_rl.rewards.rule import RewardConfig, RewardFnConfig, RuleRewards
from gcore_rl.rollout.backends import EngineConfig, EngineSource, build_engine
from gcore_rl.telemetry.loggers import check_loggers, default_loggers, open_loggers
from gcore_rl.telemetry.progress import TrainProgress
from gcore_rl.training.held_out import HeldOutAccuracy
from gcore_rl.training.logprobs import position_inputs
from gcore_rl.training.optim_step import LR_SCHEDULE_HELP, LrSchedule, rate_factor


@dataclass
class SftConfig:
    """A supervised fine-tuning run."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="runs/tiny-base"), metadata={"help": "Model to start from."})
    data: DataConfig = field(default_factory=DataConfig, metadata={
        "help": "Rows with `prompt` and `answer`, or chat rows with `messages` (the final assistant turn is the target)."})
    output_dir: str = field(default="runs/tiny-sft", metadata={"help": "Where the fine-tuned model is saved (HF format)."})
    steps: int = field(default=200, metadata={"help": "Optimiser steps; with target_accuracy and stop_at_target, the most steps (a cap)."})
    batch_size: int = field(default=64, metadata={"help": "Sequences per step."})
    lr: float = field(default=2e-3, metadata={"help": "Peak AdamW learning rate (linear warm-up, then lr_schedule)."})
    warmup_steps: int = field(default=20, metadata={"help": "Steps of linear warm-up."})
    lr_schedule: LrSchedule = field(default="constant", metadata={"help": LR_SCHEDULE_HELP})
    seed: int = field(default=0, metadata={"help": "Seed of initialisation order and data order."})
    threads: int = field(default=0, metadata={"help": "torch intra-op threads (0 = all cores)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})
    eval_every: int = field(default=0, metadata={"help": "Greedy accuracy on data.eval_prompts held-out prompts (a built-in "
                                                         "task's) every this many steps, and before the first (0 = never)."})
    target_accuracy: float = field(default=0.0, metadata={
        "help": "Stop once held-out greedy accuracy reaches this (0 = run all `steps`). If `steps` runs out first, "
                "the model is saved and the command fails naming both, so RL never starts from a weaker warm start."})
    stop_at_target: bool = field(default=True, metadata={
        "help": "Stop at the first evaluation reaching target_accuracy. false: run every step (a schedule that "
                "decays to its end settles the model) and hold the last step's evaluation to the target."})
    accuracy_fn: str = field(default="gcore_rl.rewards.builtin:exact_match",
                             metadata={"help": "`module:function` scoring a held-out completion, as a rule reward."})
    eval_max_new_tokens: int = field(default=8, metadata={"help": "Longest greedy completion when evaluating."})
    loggers: list[str] = field(default_factory=default_loggers, metadata={"help": "Where step metrics go besides OUTPUT_DIR/sft_metrics.jsonl (always written): any of tensorboard, wandb, mlflow, as for run.loggers of a GRPO job."})
    train_turns: Literal["final", "all"] = field(default="final", metadata={"help": "Chat rows: train on the final assistant turn only ('final'), or on every assistant turn from the first on with the messages between them (a tool's answers, user turns) in the sequence but masked ('all': tool-use traces)."})
    tools: list[str] = field(default_factory=list, metadata={"help": "Import paths of tools whose schemas chat prompts are rendered with (the template's `tools=`), as a tool-using rollout renders them (rollout.options.tools)."})

    def validate(self) -> None:
        for key in ("steps", "batch_size", "eval_max_new_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.lr <= 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")
        if self.eval_every < 0:
            raise ConfigError("eval_every", f"must be >= 0, got {self.eval_every}")
        if not 0.0 <= self.target_accuracy <= 1.0:
            raise ConfigError("target_accuracy", f"must be in [0, 1], got {self.target_accuracy}")
        check_reward_path(self.accuracy_fn, "accuracy_fn")
        check_loggers(self.loggers)
        if self.target_accuracy > 0 and (self.eval_every == 0 or not self.data.task or self.data.eval_prompts == 0):
            raise ConfigError("target_accuracy", "needs held-out evaluation: eval_every > 0 and a built-in data.task "
                              "with data.eval_prompts > 0 (a prompt file has no held-out split)")


def load_sft_config(recipe: str | Path | None, overrides: Sequence[str] = ()) -> SftConfig:
    """Load an SFT recipe with dotted overrides (ConfigError on bad input); on a reasoning-gym task the
    default `exact_match` accuracy becomes the task's own scorer (`task_scorer`)."""
    cfg = load_config(SftConfig, recipe, overrides)
    return replace(cfg, accuracy_fn=task_scorer(cfg.data.task, cfg.accuracy_fn))


class SftTargetNotReached(TargetNotReached):
    """The step cap ran out before held-out accuracy reached `target_accuracy` (the model is saved)."""


@dataclass
class SftResult:
    """How a warm start ended. `eval_accuracy` is the last held-out accuracy (None without evaluation)."""

    loss: float
    steps: int
    wall_seconds: float
    eval_accuracy_before: float | None
    eval_accuracy: float | None
    target_reached: bool | None


@dataclass(frozen=True)
class SftExample:
    """One training sequence: context tokens (a `VisionPrompt` when the row has images), then the target
    tokens, which carry the loss where `target_mask` is 1 (None: all of them; 0 on a tool's answer or a user
    turn between the assistant turns of a multi-turn target)."""

    prompt_ids: Sequence[int]
    target_ids: list[int]
    target_mask: list[int] | None = None


def sft_examples(rows: list[dict], prompts: PromptEncoder, source: str, chat_template: str | None = None,
                 model_path: str = "", train_turns: str = "final", tools: Sequence[dict] = ()) -> list[SftExample]:
    """Tokenized examples of `rows` (row i of `source` named in errors as ``row i``).

    A plain row gives ``prompt`` → ``answer + EOS``; a chat row (`messages`) gives its rendered
    prompt → its final assistant turn as the template renders it (`ChatRenderer.final_reply`),
    with `chat_template` (``data.chat_template``) or the tokenizer's own template, the schemas of `tools`
    handed to it. With `train_turns="all"` a chat row's target is every message from its first assistant turn
    on (`ChatRenderer.turns`), each encoded on its own as a rollout inserts it, the assistant turns trained and
    the rest (tool answers, user turns) masked. A row's images go with its prompt (`prompts`, the policy's
    `PromptEncoder`).
    """
    tokenizer = prompts.tokenizer
    renderer = None
    if any(is_chat_row(row) for row in rows):
        renderer = ChatRenderer(tokenizer, resolve_chat_template(tokenizer, chat_template, model_path), tools)
    examples = []
    for index, row in enumerate(rows):
        if renderer is not None and is_chat_row(row) and train_turns == "all":
            prompt, segments = renderer.turns(row["messages"], f"{source}, row {index}")
            pieces = [(tokenizer.encode(text, add_special_tokens=False), trained) for text, trained in segments]
            examples.append(SftExample(prompts({**row, "prompt": prompt}, f"{source}, row {index}"),
                                       [t for ids, _ in pieces for t in ids],
                                       [int(trained) for ids, trained in pieces for _ in ids]))
            continue
        if renderer is not None and is_chat_row(row):
            prompt, completion = renderer.final_reply(row["messages"], f"{source}, row {index}")
            examples.append(SftExample(prompts({**row, "prompt": prompt}, f"{source}, row {index}"),
                                       tokenizer.encode(completion, add_special_tokens=False)))
            continue
        if row.get("answer") is None:
            raise DataError(f"SFT row {index} of {source} has no `answer` field; SFT needs a reference answer per prompt")
        examples.append(SftExample(prompts(row, f"{source}, row {index}"),
                                   tokenizer.encode(str(row["answer"]), add_special_tokens=False)
                                   + [tokenizer.eos_token_id]))
    return examples


def sft_batch(examples: list[SftExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + target` sequences.

    Returns input_ids, attention_mask, loss_mask, all `[B, T]`; loss_mask marks the target tokens.
    """
    seqs = [list(example.prompt_ids) + example.target_ids for example in examples]
    targets = [[0.0] * len(example.prompt_ids)
               + ([1.0] * len(example.target_ids) if example.target_mask is None else [float(m) for m in example.target_mask])
               for example in examples]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width))
    for i, (seq, tgt) in enumerate(zip(seqs, targets, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        loss_mask[i, : len(seq)] = torch.tensor(tgt)
    return ids, attn, loss_mask


def run_sft(cfg: SftConfig) -> SftResult:
    """Fine-tune and save to `cfg.output_dir`.

    Raises `SftTargetNotReached` (after saving) when `target_accuracy` is set and the cap came first.
    """
    out = Path(cfg.output_dir)
    if (out / "sft_metrics.jsonl").exists():
        raise ConfigError("output_dir", f"'{out}' already holds an SFT run (sft_metrics.jsonl); choose a new "
                          "output_dir or remove the old one, so earlier results are never overwritten")
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    prompts = policy_prompt_encoder(cfg.model.path, tokenizer)
    model = load_causal_lm(cfg.model.path, cfg.model.dtype, cfg.model.attn_implementation)
    source = cfg.data.source_name()
    examples = sft_examples(load_prompt_rows(cfg.data), prompts, source, cfg.data.chat_template, cfg.model.path,
                            cfg.train_turns, load_tools(cfg.tools, "tools")[1])
    if cfg.data.chat_template is not None:  # the saved model renders chats as it was trained to
        tokenizer.chat_template = resolve_chat_template(tokenizer, cfg.data.chat_template, cfg.model.path)
    check_lengths(examples, context_limit(cfg.model.path), source, cfg.model.path)
    sampler = ShardedPromptSampler(len(examples), seed=cfg.seed, shuffle=True)
    evaluate = _held_out(cfg, model, prompts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: rate_factor(s, cfg.warmup_steps, cfg.steps, cfg.lr_schedule))
    dump_yaml(cfg, out / "sft_config.yaml")  # first, so a run that fails its target keeps its settings too
    started = time.perf_counter()
    model.train()
    loss_value = float("nan")
    accuracy = before = evaluate(model) if evaluate else None
    step = 0
    with open_loggers(cfg.loggers, out, out / "sft_metrics.jsonl", to_dict(cfg)) as writer, TrainProgress(cfg.steps, enabled=cfg.progress) as progress:
        while step < cfg.steps and not (cfg.stop_at_target and _reached(cfg, accuracy)):
            step += 1
            batch = [examples[i] for i in sampler.next_indices(cfg.batch_size)]
            ids, attn, loss_mask = sft_batch(batch, tokenizer.pad_token_id)
            images = tuple(prompt_images(example.prompt_ids) for example in batch)
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False,
                           **position_inputs(model, ids, attn, images)).logits[:, :-1]
            token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (token_loss * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_value = float(loss.detach())
            metrics = {"sft/loss": loss_value, "lr": scheduler.get_last_lr()[0]}
            if evaluate and (step % cfg.eval_every == 0 or (step == cfg.steps and not cfg.stop_at_target)):
                accuracy = metrics["sft/eval_accuracy"] = evaluate(model)
                model.train()
            writer.write(step, metrics)
            progress.update(step, metrics)
    save_model_dir(model, tokenizer, out)
    result = SftResult(loss=loss_value, steps=step, wall_seconds=time.perf_counter() - started,
                       eval_accuracy_before=before, eval_accuracy=accuracy,
                       target_reached=_reached(cfg, accuracy) if cfg.target_accuracy > 0 else None)
    if result.target_reached is False:
        raise SftTargetNotReached(
            f"SFT stopped at its cap of {cfg.steps} steps with held-out accuracy {accuracy:.3f}, below "
            f"target_accuracy={cfg.target_accuracy}; the model is saved in {out} but is too weak a start for RL. "
            "Allow more steps (steps=N), raise lr, or lower target_accuracy; remove the output directory first.")
    return result


def check_lengths(examples: list[SftExample], limit: int | None, source: str, model_path: str) -> None:
    """DataError naming the first example whose ``prompt + answer + EOS`` (or chat prompt + reply) does not fit
    the model's context.

    Checked once, before the first step: past `max_position_embeddings` a model trains on positions
    it was never built for, silently.
    """
    if limit is None:
        return
    for index, example in enumerate(examples):
        length = len(example.prompt_ids) + len(example.target_ids)
        if length > limit:
            images = prompt_images(example.prompt_ids)
            counted = f" (its {count_of(images.count, 'image')} included)" if images is not None else ""
            raise DataError(f"{source}, row {index}: prompt + answer + EOS are {length} tokens{counted} but the model "
                            f"'{model_path}' takes {limit} (max_position_embeddings); shorten or remove the row, "
                            "or start from a model with a longer context")


def _held_out(cfg: SftConfig, model, prompts: PromptEncoder) -> HeldOutAccuracy | None:
    """The held-out evaluator, when the run evaluates (`eval_every` > 0 and the task has held-out rows)."""
    rows = load_eval_rows(cfg.data) if cfg.eval_every > 0 else []
    if not rows:
        return None
    tokenizer = prompts.tokenizer
    if any(is_chat_row(row) for row in rows):
        renderer = ChatRenderer(tokenizer, resolve_chat_template(tokenizer, cfg.data.chat_template, cfg.model.path))
        rows = render_prompt_rows(rows, renderer, f"the held-out rows of {cfg.data.source_name()}", range(len(rows)))
    try:
        scorer = RuleRewards(RewardConfig(rules=[RewardFnConfig(fn=cfg.accuracy_fn)], accuracy_fn=cfg.accuracy_fn))
    except ConfigError as exc:
        raise ConfigError("accuracy_fn", exc.message) from None  # the SFT key, not the scorer's internal one
    source = EngineSource(cfg.model.path, next(model.parameters()).device, tokenizer.eos_token_id, tokenizer.pad_token_id,
                          cfg.model.dtype, cfg.model.attn_implementation)
    with torch.random.fork_rng(devices=[]):  # loading draws nothing from the training's random stream
        engine = build_engine(EngineConfig(max_num_seqs=len(rows)), source)
    return HeldOutAccuracy(engine, prompts, rows, scorer, cfg.eval_max_new_tokens)


def _reached(cfg: SftConfig, accuracy: float | None) -> bool:
    """Whether the measured stop criterion holds (never without a target)."""
    return cfg.target_accuracy > 0 and accuracy is not None and accuracy >= cfg.target_accuracy
