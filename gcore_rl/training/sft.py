"""Supervised warm start: teach a model the answer format of a prompt dataset.

Cross-entropy on the answer tokens (and the closing EOS) of `prompt + answer` sequences; the
prompt tokens are context only. Used to give the tiny random model enough competence that RL
has a reward signal to climb (a random policy almost never produces a correct sum).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gcore_rl.data.config import DataConfig
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.data.sources import load_prompt_rows
from gcore_rl.errors import ConfigError, DataError
from gcore_rl.models.loading import ModelConfig, load_causal_lm, load_tokenizer, save_model_dir
from gcore_rl.telemetry.metrics import MetricsWriter
from gcore_rl.telemetry.progress import TrainProgress


@dataclass
class SftConfig:
    """A supervised fine-tuning run."""

    model: ModelConfig = field(default_factory=lambda: ModelConfig(path="runs/tiny-base"), metadata={"help": "Model to start from."})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": "Rows with `prompt` and `answer`."})
    output_dir: str = field(default="runs/tiny-sft", metadata={"help": "Where the fine-tuned model is saved (HF format)."})
    steps: int = field(default=200, metadata={"help": "Optimiser steps."})
    batch_size: int = field(default=64, metadata={"help": "Sequences per step."})
    lr: float = field(default=2e-3, metadata={"help": "Peak AdamW learning rate (linear warm-up, then constant)."})
    warmup_steps: int = field(default=20, metadata={"help": "Steps of linear warm-up."})
    seed: int = field(default=0, metadata={"help": "Seed of initialisation order and data order."})
    threads: int = field(default=0, metadata={"help": "torch intra-op threads (0 = all cores)."})
    progress: bool = field(default=True, metadata={"help": "Show a progress bar."})

    def validate(self) -> None:
        for key in ("steps", "batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.lr <= 0:
            raise ConfigError("lr", f"must be > 0, got {self.lr}")


def sft_batch(rows: list[dict], tokenizer, source: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded `prompt + answer + EOS` rows.

    Returns input_ids, attention_mask, loss_mask, all `[B, T]`; loss_mask marks answer and EOS
    tokens (the targets).
    """
    seqs, targets = [], []
    for index, row in enumerate(rows):
        if "answer" not in row or row["answer"] is None:
            raise DataError(f"SFT row {index} of {source} has no `answer` field; SFT needs a reference answer per prompt")
        prompt = tokenizer.encode(row["prompt"], add_special_tokens=False)
        answer = tokenizer.encode(str(row["answer"]), add_special_tokens=False) + [tokenizer.eos_token_id]
        seqs.append(prompt + answer)
        targets.append([0.0] * len(prompt) + [1.0] * len(answer))
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    loss_mask = torch.zeros((len(seqs), width))
    for i, (seq, tgt) in enumerate(zip(seqs, targets, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        loss_mask[i, : len(seq)] = torch.tensor(tgt)
    return ids, attn, loss_mask


def run_sft(cfg: SftConfig) -> dict[str, float]:
    """Fine-tune and save to `cfg.output_dir`; returns the final loss and wall time."""
    out = Path(cfg.output_dir)
    if (out / "sft_metrics.jsonl").exists():
        raise ConfigError("output_dir", f"'{out}' already holds an SFT run (sft_metrics.jsonl); choose a new "
                          "output_dir or remove the old one, so earlier results are never overwritten")
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model.path)
    model = load_causal_lm(cfg.model.path, cfg.model.dtype, cfg.model.attn_implementation)
    rows = load_prompt_rows(cfg.data)
    sampler = ShardedPromptSampler(len(rows), seed=cfg.seed, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    source = cfg.data.path or f"synthetic task '{cfg.data.task}'"
    model.train()
    loss_value = float("nan")
    with MetricsWriter(out / "sft_metrics.jsonl") as writer, TrainProgress(cfg.steps, enabled=cfg.progress) as progress:
        for step in range(1, cfg.steps + 1):
            ids, attn, loss_mask = sft_batch([rows[i] for i in sampler.next_indices(cfg.batch_size)], tokenizer, source)
            logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, :-1]
            token_loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            loss = (token_loss * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            loss_value = float(loss.detach())
            writer.write(step, {"sft/loss": loss_value, "lr": scheduler.get_last_lr()[0]})
            progress.update(step, {"sft/loss": loss_value})
    save_model_dir(model, tokenizer, out)
    return {"loss": loss_value, "wall_seconds": time.perf_counter() - started}
