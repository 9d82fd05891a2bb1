"""A corpus of bad inputs, each given to the real command line as a user would give it.

Every case must end with one paragraph that names the culprit (config key, file, row, what to
do), exit non-zero (2 for a config or usage error, 1 for a bad file or row) without a Python
traceback, and leave every file that existed before it (an earlier run, the models, the data)
exactly as it was. Add a case for every new way a user can hand the project something wrong.
Cases fail before the first training step; the one short run at the end checks the explicit
alternative to failing (`data.overlong_prompts=truncate`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from checkpoint_helpers import write_checkpoint
from cli_helpers import NO_STOP, RECIPE, REPO, SHORT, assert_user_error, gcore_rl, init_tiny

# a one-step job that writes nothing it does not need
TRAIN = ["train", "{recipe}", "run.steps=1", "data.eval_prompts=0", NO_STOP, "run.save_final=false", *SHORT]
PPO = ["algo.advantage=gae", "algo.kl_coef=0.05"]
FROM_FILE = ["model.path={tiny}", "data.task=null", "run.output_dir={out}"]
SHARD = "trainer/__0_0.distcp"
"""The DCP shard of a checkpoint saved by one process."""
ADDITION_ROWS = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 5)]


@dataclass(frozen=True)
class Case:
    """A command line (``{name}`` stands for a path of the `world` fixture), its exit status and the text it must name."""

    args: tuple[str, ...]
    code: int
    named: tuple[str, ...]


def case(*args: str, code: int, named: tuple[str, ...]) -> Case:
    return Case(args, code, named)


CASES: dict[str, Case] = {
    # config and usage: exit 2, the key named
    "unknown-key": case(*TRAIN, "algo.not_a_key=1", "run.output_dir={earlier}", code=2,
                        named=("config error", "algo.not_a_key")),
    "bad-type": case(*TRAIN, "train.lr=abc", "run.output_dir={earlier}", code=2, named=("config error", "train.lr")),
    "unknown-logger": case(*TRAIN, "run.loggers=[jsonl,csv]", "run.output_dir={earlier}", code=2,
                           named=("config error", "run.loggers", "'csv'", "jsonl, tensorboard, wandb, mlflow")),
    "reward-timeout-not-positive": case(*TRAIN, "reward.workers=2", "reward.timeout_s=0", "run.output_dir={earlier}",
                                        code=2, named=("config error", "reward.timeout_s", "> 0")),
    "preempt-grace-not-positive": case(*TRAIN, "run.preempt_grace_s=0", "run.output_dir={earlier}", code=2,
                                       named=("config error", "run.preempt_grace_s", "> 0")),
    "lora-rank-not-positive": case(*TRAIN, "model.lora.enabled=true", "model.lora.rank=0", "run.output_dir={earlier}",
                                   code=2, named=("config error", "model.lora.rank", "at least 1")),
    "lora-targets-that-match-nothing": case(*TRAIN, "model.path={tiny}", "model.lora.enabled=true",
                                            "model.lora.target_modules=[qkv_proj]", "run.output_dir={out}", code=2,
                                            named=("config error", "model.lora.target_modules", "qkv_proj",
                                                   "match no module")),
    "offload-where-no-trainer-shares-its-device": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray",
                                                       "placement.strategy=disaggregated", "runtime.devices_per_controller=2",
                                                       "train.offload=all", "run.output_dir={out}", code=2,
                                                       named=("config error", "train.offload", "disaggregated")),
    "row-seeding-with-logit-noise": case(*TRAIN, "model.path={tiny}", "engine.seeding=row", "engine.logit_noise_std=0.1",
                                         "run.output_dir={out}", code=2,
                                         named=("config error", "engine.seeding", "logit_noise_std")),
    "offload-with-every-model-resident": case(*TRAIN, "model.path={tiny}", "runtime.time_share=false",
                                              "train.offload=optimizer", "run.output_dir={out}", code=2,
                                              named=("config error", "train.offload", "runtime.time_share=false")),
    "lora-adapters-to-an-engine-that-cannot-apply-them": case(
        *TRAIN, "model.path={tiny}", "model.lora.enabled=true", "model.lora.sync=adapters",
        "engine.backend=gcore_rl.rollout.backends:build_engine", "run.output_dir={out}", code=2,
        named=("config error", "model.lora.sync", "gcore_rl.rollout.backends:build_engine", "sync=merged")),
    "vllm-environment-missing": case(*TRAIN, "model.path={tiny}", "engine.backend=vllm",
                                     "engine.vllm.python={out}/no-such-venv/bin/python", "run.output_dir={out}", code=2,
                                     named=("config error", "engine.vllm.python", "no-such-venv", "make vllm-env")),
    "vllm-environment-without-vllm": case(*TRAIN, "model.path={tiny}", "judge.enabled=true",
                                          "judge.model_path={tiny}", "judge.engine.backend=vllm",
                                          f"judge.engine.vllm.python={Path(sys.executable)}", "run.output_dir={out}",
                                          code=2, named=("config error", "judge.engine.vllm.python", "cannot import vllm",
                                                         "make vllm-env")),
    "vllm-startup-timeout-not-positive": case(*TRAIN, "engine.backend=vllm", "engine.vllm.startup_timeout_s=0",
                                              "run.output_dir={earlier}", code=2,
                                              named=("config error", "engine.vllm.startup_timeout_s", "> 0")),
    "vllm-weight-sync-unknown": case(*TRAIN, "engine.backend=vllm", "engine.vllm.weight_sync=nccl",
                                     "run.output_dir={earlier}", code=2,
                                     named=("config error", "engine.vllm.weight_sync", "file, group")),
    "vllm-with-a-setting-only-the-builtin-engine-reads": case(*TRAIN, "engine.backend=vllm", "engine.logit_noise_std=0.1",
                                                              "run.output_dir={earlier}", code=2,
                                                              named=("config error", "engine.logit_noise_std", "backend=vllm")),
    "prefix-cache-budget-negative": case(*TRAIN, "engine.prefix_cache_tokens=-1", "run.output_dir={earlier}", code=2,
                                         named=("config error", "engine.prefix_cache_tokens", ">= 0")),
    "finish-check-interval-negative": case(*TRAIN, "engine.finish_check_every=-1", "run.output_dir={earlier}", code=2,
                                           named=("config error", "engine.finish_check_every", ">= 0")),
    "target-kl-with-one-optimiser-step": case(*TRAIN, "train.target_kl=0.01", "train.mini_batches=1",
                                              "run.output_dir={earlier}", code=2,
                                              named=("config error", "train.target_kl", "mini_batches")),
    "trust-region-bound-negative": case(*TRAIN, "train.max_kl=-0.1", "run.output_dir={earlier}", code=2,
                                        named=("config error", "train.max_kl", ">= 0")),
    "vllm-max-model-len-filled-by-the-completion": case(*TRAIN, "model.path={tiny}", "engine.backend=vllm",
                                                        "engine.vllm.max_model_len=8", "sampling.max_new_tokens=8",
                                                        "run.output_dir={out}", code=2,
                                                        named=("config error", "sampling.max_new_tokens",
                                                               "engine.vllm.max_model_len=8")),
    "critic-lora-targets-that-match-nothing": case(*TRAIN, *PPO, "model.path={tiny}", "critic.lora.enabled=true",
                                                   "critic.lora.target_modules=[qkv_proj]", "run.output_dir={out}",
                                                   code=2, named=("config error", "critic.lora.target_modules", "qkv_proj")),
    "impossible-combination": case(*TRAIN, "run.prompts_per_step=3", "runtime.controllers=2", code=2,
                                   named=("config error", "run.prompts_per_step")),
    "slice-too-small-for-the-strategy": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray", "placement.strategy=disaggregated",
                                             "runtime.devices_per_controller=1", "run.output_dir={out}", code=2,
                                             named=("config error", "placement.strategy", "at least 2 devices per slice")),
    "interleave-with-nothing-to-interleave": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray",
                                                  "placement.strategy=interleave", "runtime.devices_per_controller=2",
                                                  "run.output_dir={out}", code=2,
                                                  named=("config error", "placement.strategy", "algo.kl_coef > 0")),
    "forecast-engine-window-without-the-replay": case(*TRAIN, "placement.forecast.engine_window=2", "run.output_dir={earlier}",
                                                      code=2, named=("config error", "placement.forecast.engine_window",
                                                                     "model=replay")),
    "weight-bucket-not-positive": case(*TRAIN, "runtime.weight_bucket_mib=0", "run.output_dir={earlier}", code=2,
                                       named=("config error", "runtime.weight_bucket_mib", "> 0")),
    "critic-devices-without-a-critic": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray", "runtime.devices_per_controller=2",
                                            "placement.critic_devices=1", "run.output_dir={out}", code=2,
                                            named=("config error", "placement.critic_devices", "trains none")),
    "critic-devices-leave-the-actor-none": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray", "algo.advantage=gae",
                                                "runtime.devices_per_controller=2", "placement.critic_devices=2",
                                                "run.output_dir={out}", code=2,
                                                named=("config error", "placement.critic_devices", "at least one")),
    "critic-devices-with-kl-in-reward": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray", "algo.advantage=gae",
                                             "algo.kl_in_reward=true", "algo.kl_coef=0.1", "runtime.devices_per_controller=2",
                                             "placement.critic_devices=1", "run.output_dir={out}", code=2,
                                             named=("config error", "placement.critic_devices", "kl_in_reward")),
    "critic-devices-rows-uneven": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray", "algo.advantage=gae",
                                       "runtime.devices_per_controller=4", "placement.critic_devices=3",
                                       "run.output_dir={out}", code=2,
                                       named=("config error", "run.prompts_per_step", "critic devices")),
    "staleness-bound-not-positive": case(*TRAIN, "placement.strategy=disaggregated", "placement.max_staleness=0",
                                         "run.output_dir={earlier}", code=2,
                                         named=("config error", "placement.max_staleness", "positive integer")),
    "staleness-bound-without-overlap": case(*TRAIN, "placement.max_staleness=2", "run.output_dir={earlier}", code=2,
                                            named=("config error", "placement.max_staleness", "disaggregated")),
    "forecast-costs-unreadable": case(*TRAIN, "model.path={tiny}", "placement.forecast.model=replay",
                                      "placement.forecast.costs=/nonexistent/costs.yaml", "run.output_dir={out}", code=2,
                                      named=("config error", "placement.forecast.costs", "/nonexistent/costs.yaml")),
    "forecast-hardware-unknown": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray", "placement.strategy=dynamic",
                                      "runtime.devices_per_controller=3", "run.prompts_per_step=6", "sampling.n=2",
                                      "judge.enabled=true", "judge.model_path={tiny}", "placement.forecast.model=replay",
                                      "placement.forecast.hardware=Z80", "run.output_dir={out}", code=2,
                                      named=("config error", "placement.forecast.hardware", "Z80")),
    "forecast-calibrate-window-negative": case(*TRAIN, "placement.forecast.calibrate_window=-1", "run.output_dir={earlier}",
                                               code=2, named=("config error", "placement.forecast.calibrate_window",
                                                              "non-negative integer")),
    "mismatch-cap-not-above-one": case(*TRAIN, "algo.mismatch_correction=tis", "algo.mismatch_cap=1",
                                       "run.output_dir={earlier}", code=2, named=("config error", "algo.mismatch_cap", "> 1")),
    "overlong-buffer-fills-the-length": case(*TRAIN, "sampling.max_new_tokens=6", "reward.overlong_buffer=6",
                                             "run.output_dir={earlier}", code=2,
                                             named=("config error", "reward.overlong_buffer", "max_new_tokens=6")),
    "overlong-penalty-negative": case(*TRAIN, "reward.overlong_buffer=2", "reward.overlong_penalty=-1",
                                      "run.output_dir={earlier}", code=2, named=("config error", "reward.overlong_penalty")),
    "kl-in-reward-without-gae": case(*TRAIN, "algo.kl_in_reward=true", "algo.kl_coef=0.1", "run.output_dir={earlier}",
                                     code=2, named=("config error", "algo.kl_in_reward", "algo.advantage=gae")),
    "kl-in-reward-without-a-kl-weight": case(*TRAIN, "algo.advantage=gae", "algo.kl_in_reward=true",
                                             "run.output_dir={earlier}", code=2,
                                             named=("config error", "algo.kl_in_reward", "algo.kl_coef > 0")),
    "critic-value-clip-not-positive": case(*TRAIN, "algo.advantage=gae", "critic.value_clip=0", "run.output_dir={earlier}",
                                           code=2, named=("config error", "critic.value_clip", "null")),
    "gae-option-without-gae": case(*TRAIN, "algo.lam=0.9", "run.output_dir={earlier}", code=2,
                                   named=("config error", "algo.lam", "algo.advantage=gae")),
    "critic-warm-up-as-long-as-the-run": case(*TRAIN, "algo.advantage=gae", "critic.actor_freeze_steps=1",
                                              "run.output_dir={earlier}", code=2,
                                              named=("config error", "critic.actor_freeze_steps", "untrained")),
    "interleave-with-a-split-it-ignores": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray", "placement.strategy=interleave",
                                               "runtime.devices_per_controller=2", "algo.kl_coef=0.1",
                                               "reward_model.enabled=true", "reward_model.model_path={tiny}",
                                               "placement.rollout_devices=1", "run.output_dir={out}", code=2,
                                               named=("config error", "placement.rollout_devices", "interleave")),
    "critic-options-without-a-critic": case(*TRAIN, "critic.lr=0.001", "run.output_dir={earlier}", code=2,
                                            named=("config error", "critic.lr", "algo.advantage=gae")),
    "sequence-parallel-on-one-device-slices": case(*TRAIN, "model.path={tiny}", "train.sequence_parallel=2",
                                                   "run.output_dir={out}", code=2,
                                                   named=("config error", "train.sequence_parallel", "runtime.kind=ray")),
    "sequence-parallel-not-dividing-the-heads": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray",
                                                     "runtime.devices_per_controller=3", "train.sequence_parallel=3", "run.prompts_per_step=3",
                                                     "run.output_dir={out}", code=2,
                                                     named=("config error", "train.sequence_parallel", "attention heads")),
    "critic-from-a-folder-without-a-model": case(*TRAIN, "model.path={tiny}", "algo.advantage=gae",
                                                 "critic.model_path={no_config}", "run.output_dir={out}", code=1,
                                                 named=("{no_config}", "config.json")),
    "gspo-with-token-level-aggregation": case(*TRAIN, "algo.policy_loss=gspo", "algo.loss_aggregation=token_mean",
                                              "run.output_dir={earlier}", code=2,
                                              named=("config error", "algo.loss_aggregation", "seq_mean_token_mean")),
    "dual-clip-constant-not-above-one": case(*TRAIN, "algo.policy_loss=dual_clip", "algo.dual_clip_c=0.9",
                                             "run.output_dir={earlier}", code=2,
                                             named=("config error", "algo.dual_clip_c", "> 1")),
    "engine-noise-negative": case(*TRAIN, "engine.logit_noise_std=-0.5", "run.output_dir={earlier}", code=2,
                                  named=("config error", "engine.logit_noise_std")),
    "update-delay-negative": case(*TRAIN, "train.added_seconds_per_update=-1", "run.output_dir={earlier}", code=2,
                                  named=("config error", "train.added_seconds_per_update", ">= 0")),
    "engine-prefill-chunk-negative": case(*TRAIN, "engine.prefill_chunk_tokens=-1", "run.output_dir={earlier}", code=2,
                                          named=("config error", "engine.prefill_chunk_tokens", "got -1")),
    "algo-value-not-finite": case(*TRAIN, "algo.gspo_clip_high=nan", "run.output_dir={earlier}", code=2,
                                  named=("config error", "algo.gspo_clip_high", "finite")),
    "whitening-estimator-on-several-controllers": case(*TRAIN, "algo.advantage=reinforce_pp", "runtime.controllers=2",
                                                       "run.prompts_per_step=8", "run.output_dir={earlier}", code=2,
                                                       named=("config error", "algo.advantage", "runtime.controllers")),
    "missing-recipe": case("train", "no/such/recipe.yaml", code=2, named=("no/such/recipe.yaml",)),
    "output-dir-holds-a-run": case(*TRAIN, "model.path={tiny}", "run.output_dir={earlier}", code=2,
                                   named=("run.output_dir", "{earlier}", "already holds a run")),
    "cuda-without-cuda": case(*TRAIN, "model.path={tiny}", "runtime.device=cuda", "run.output_dir={earlier}", code=2,
                              named=("runtime.device", "no usable CUDA device", "runtime.device=cpu")),
    "cuda-without-cuda-on-ray": case(*TRAIN, "model.path={tiny}", "runtime.kind=ray", "runtime.device=cuda",
                                     "run.output_dir={out}", code=2, named=("runtime.device", "runtime.device=cpu")),
    "completion-fills-the-context": case(*TRAIN, "model.path={tiny}", "sampling.max_new_tokens=256",
                                         "run.output_dir={out}", code=2,
                                         named=("sampling.max_new_tokens", "max_position_embeddings=256", "{tiny}")),
    "token-budget-below-the-completion": case(*TRAIN, "model.path={tiny}", "sampling.max_new_tokens=6",
                                              "train.max_tokens_per_micro_batch=6", "run.output_dir={out}", code=2,
                                              named=("sampling.max_new_tokens", "train.max_tokens_per_micro_batch=6")),
    "token-budget-negative": case(*TRAIN, "train.max_tokens_per_micro_batch=-1", "run.output_dir={earlier}", code=2,
                                  named=("config error", "train.max_tokens_per_micro_batch", "got -1")),
    "init-tiny-negative-size": case("init-tiny", "{out}", "hidden_size=-3", code=2,
                                    named=("config error", "hidden_size", "-3")),
    "init-tiny-over-a-model": case("init-tiny", "{earlier}/final", code=2, named=("{earlier}/final", "already holds a model")),
    "simulate-override-after-an-option": case("simulate", "{scenario}", "--out", "{out}", "gpus=abc", "--steps", "1",
                                              code=2, named=("config error", "gpus", "'abc'")),
    "simulate-streaming-with-a-judge": case("simulate", "{scenario}", "--out", "{out}", "--steps", "1", "--strategies",
                                            "streaming", code=2, named=("config error", "strategies", "models.judge")),
    "simulate-negative-staleness": case("simulate", "{scenario}", "--out", "{out}", "--steps", "1", "--strategies",
                                        "streaming", "models.judge=null", "placement.max_staleness=-1", code=2,
                                        named=("config error", "placement.max_staleness", "-1")),
    "simulate-no-train-chunks": case("simulate", "{scenario}", "--out", "{out}", "--steps", "1", "--strategies",
                                     "streaming", "models.judge=null", "placement.train_chunks=0", code=2,
                                     named=("config error", "placement.train_chunks")),
    "simulate-sequence-parallel-over-the-heads": case("simulate", "{scenario}", "--out", "{out}", "--steps", "1",
                                                      "workload.sequence_parallel=3", code=2,
                                                      named=("config error", "workload.sequence_parallel", "heads")),
    "simulate-refill-scale-not-positive": case("simulate", "{scenario}", "--out", "{out}", "--steps", "1",
                                               "workload.refill_response_scale=0", code=2,
                                               named=("config error", "workload.refill_response_scale", "> 0")),
    "simulate-heavy-shard-negative": case("simulate", "{scenario}", "--out", "{out}", "--steps", "1",
                                          "workload.heavy_shard_scale=-1", code=2,
                                          named=("config error", "workload.heavy_shard_scale", "> 0")),
    "simulate-agent-fewer-turns-than-its-least": case("simulate", "{scenario}", "--out", "{out}", "--steps", "1",
                                                      "workload.agent.turns=3", "workload.agent.turns_min=4", code=2,
                                                      named=("config error", "workload.agent.turns_min", "got 4")),
    "simulate-agent-negative-tool-latency": case("simulate", "{scenario}", "--out", "{out}", "--steps", "1",
                                                 "workload.agent.turns=3", "workload.agent.tool_seconds.median_s=-1",
                                                 code=2, named=("config error", "workload.agent.tool_seconds.median_s")),
    # model folders: exit 1, the folder or file named
    "missing-model": case(*TRAIN, "model.path=/nonexistent", code=1, named=("/nonexistent", "init-tiny")),
    "model-without-config": case(*TRAIN, "model.path={no_config}", code=1, named=("{no_config}", "config.json")),
    "damaged-weights": case(*TRAIN, "model.path={damaged}", "run.output_dir={earlier}", code=1,
                            named=("{damaged}/model.safetensors", "damaged", "copy or save the model again")),
    "damaged-tokenizer": case(*TRAIN, "model.path={bad_tokenizer}", "run.output_dir={out}", code=1,
                              named=("{bad_tokenizer}", "tokenizer.json")),
    "damaged-reference": case(*TRAIN, "model.path={tiny}", "reference_path={damaged}", "run.output_dir={out}", code=1,
                              named=("{damaged}/model.safetensors",)),
    "damaged-judge": case(*TRAIN, "model.path={tiny}", "judge.enabled=true", "judge.model_path={damaged}",
                          "run.output_dir={out}", code=1, named=("{damaged}/model.safetensors",)),
    "damaged-reward-model": case(*TRAIN, "model.path={tiny}", "reward_model.enabled=true",
                                 "reward_model.model_path={damaged}", "run.output_dir={out}", code=1,
                                 named=("{damaged}/model.safetensors",)),
    "sft-damaged-weights": case("sft", "{recipes}/sft_addition.yaml", "model.path={damaged}", "output_dir={out}",
                                "steps=1", code=1, named=("{damaged}/model.safetensors",)),
    "rm-damaged-weights": case("rm", "{recipes}/rm_addition.yaml", "model.path={damaged}", "output_dir={out}",
                               "steps=1", "eval_pairs=0", code=1, named=("{damaged}/model.safetensors",)),
    # run reports: exit 1, the path named
    "report-of-a-folder-without-metrics": case("report", "{tiny}", "--out", "{out}/report.html", code=1,
                                               named=("{tiny}", "metrics.jsonl")),
    "report-of-a-file": case("report", "{tiny}/config.json", "--out", "{out}/report.html", code=1,
                             named=("{tiny}/config.json", "not a directory")),
    # prompt data: exit 1, the file and the line or row named
    "non-utf8-jsonl": case(*TRAIN, *FROM_FILE, "data.path={latin1_jsonl}", code=1,
                           named=("{latin1_jsonl}", "line 2", "not UTF-8")),
    "non-utf8-parquet": case(*TRAIN, *FROM_FILE, "data.path={latin1_parquet}", code=1,
                             named=("{latin1_parquet}", "row 1", "column `prompt`", "not UTF-8")),
    "malformed-json-line": case(*TRAIN, *FROM_FILE, "data.path={broken_jsonl}", code=1,
                                named=("{broken_jsonl}", "line 3", "not valid JSON")),
    "row-without-prompt": case(*TRAIN, *FROM_FILE, "data.path={no_prompt_jsonl}", code=1,
                               named=("{no_prompt_jsonl}", "row 2", "prompt")),
    "sft-row-longer-than-the-context": case("sft", "{recipes}/sft_addition.yaml", "model.path={tiny}", "data.task=null",
                                            "data.path={long_jsonl}", "output_dir={out}", "steps=1", "eval_every=0",
                                            "target_accuracy=0", code=1,
                                            named=("{long_jsonl}", "row 3", "599 tokens", "max_position_embeddings")),
    "sft-accuracy-fn-not-importable": case("sft", "{recipes}/sft_addition.yaml", "model.path={tiny}", "output_dir={out}",
                                           "accuracy_fn=no_such_module:score", code=2,
                                           named=("config error", "accuracy_fn", "no_such_module:score")),
    # checkpoints: exit 1, the checkpoint folder and its damaged file named
    "export-truncated-checkpoint": case("export", "{checkpoint_truncated}", "{out}", code=1,
                                        named=(f"{{checkpoint_truncated}}/{SHARD}", "bytes", "run.resume=PATH")),
    "export-checkpoint-without-its-shard": case("export", "{checkpoint_no_shard}", "{out}", code=1,
                                                named=(f"{{checkpoint_no_shard}}/{SHARD}", "is missing")),
    "export-a-folder-that-is-not-a-checkpoint": case("export", "{tiny}", "{out}", code=1,
                                                     named=("{tiny}/manifest.json", "not a finished checkpoint",
                                                            "gcore-rl checkpoints RUN_DIR")),
    # resuming: a damaged checkpoint names its file (exit 1); a changed job names the keys (exit 2)
    "resume-from-a-truncated-checkpoint": case(*TRAIN, "model.path={policy}", "run.resume={resume_truncated}",
                                               "run.output_dir={out}", code=1,
                                               named=(f"{{resume_truncated}}/{SHARD}", "bytes")),
    "resume-from-a-checkpoint-without-its-shard": case(*TRAIN, "model.path={policy}", "run.resume={resume_no_shard}",
                                                       "run.output_dir={out}", code=1,
                                                       named=(f"{{resume_no_shard}}/{SHARD}", "is missing")),
    "resume-from-a-folder-that-is-not-a-checkpoint": case(*TRAIN, "model.path={policy}", "run.resume={tiny}",
                                                          "run.output_dir={out}", code=1,
                                                          named=("run.resume", "{tiny}", "not a checkpoint folder")),
    "resume-with-another-model": case(*TRAIN, "model.path={tiny}", "run.resume={resume_good}", "run.output_dir={out}",
                                      code=2, named=("config error", "run.resume", "model.path was", "{policy}")),
    "resume-with-another-algorithm": case(*TRAIN, "model.path={policy}", "algo.kl_coef=0.05", "run.resume={resume_good}",
                                          "run.output_dir={out}", code=2,
                                          named=("config error", "algo.kl_coef was 0.0, now 0.05")),
    "resume-moving-the-critic-to-devices-of-its-own": case(
        *TRAIN, *PPO, "model.path={ppo_policy}", "run.resume={resume_ppo}", "run.output_dir={out}", "runtime.kind=ray",
        "runtime.controllers=1", "runtime.devices_per_controller=3", "placement.strategy=disaggregated",
        "placement.train_devices=2", "placement.critic_devices=1", code=2,
        named=("config error", "placement.critic_devices", "{resume_ppo}", "with the actor", "devices of its own")),
    "resume-a-lora-checkpoint-without-lora": case(*TRAIN, "model.path={lora_policy}", "run.resume={resume_lora}",
                                                  "run.output_dir={out}", code=2,
                                                  named=("config error", "{resume_lora}", "model.lora.enabled was True")),
    "resume-a-full-checkpoint-with-lora": case(*TRAIN, *PPO, "model.path={ppo_policy}", "model.lora.enabled=true",
                                               "run.resume={resume_ppo}", "run.output_dir={out}", code=2,
                                               named=("config error", "{resume_ppo}", "model.lora.enabled was False")),
    "export-adapters-of-a-full-checkpoint": case("export", "{resume_ppo}", "{out}", "--adapter", code=1,
                                                 named=("{resume_ppo}", "trained every parameter", "without --adapter")),
    "adapters-without-their-base-as-the-model": case(*TRAIN, "model.path={adapter_only}", "run.output_dir={out}", code=1,
                                                     named=("{adapter_only}", "adapter_config.json", "elsewhere/base",
                                                            "base model")),
    "resume-a-model-whose-shape-changed": case(*TRAIN, "model.path={policy}", "run.resume={resume_good}",
                                               "run.output_dir={out}", code=1,
                                               named=("{resume_good}/trainer", "does not fit this model")),
    "prompt-longer-than-the-context": case(*TRAIN, *FROM_FILE, "data.path={long_jsonl}", code=1,
                                           named=("{long_jsonl}", "row 3", "300 tokens", "max_position_embeddings=256",
                                                  "data.overlong_prompts=truncate")),
    "prompt-longer-than-the-token-budget": case(*TRAIN, *FROM_FILE, "data.path={long_jsonl}", "sampling.max_new_tokens=4",
                                                "train.max_tokens_per_micro_batch=64", code=1,
                                                named=("{long_jsonl}", "row 3", "300 tokens", "only 60 fit",
                                                       "train.max_tokens_per_micro_batch=64",
                                                       "data.overlong_prompts=truncate")),
    # chat-format prompt data: exit 1 naming the file and row (exit 2 for a template path that is not there)
    "chat-template-fails-to-render": case(*TRAIN, *FROM_FILE, "data.path={chat_jsonl}", "data.chat_template={strict_jinja}",
                                          code=1, named=("{chat_jsonl}", "row 2", "chat template failed to render",
                                                         "no system turns here")),
    "chat-row-with-an-unknown-role": case(*TRAIN, *FROM_FILE, "data.path={chat_tool_jsonl}", code=1,
                                          named=("{chat_tool_jsonl}", "row 1", "unknown role 'function'")),
    "chat-row-without-a-user-turn": case(*TRAIN, *FROM_FILE, "data.path={chat_no_user_jsonl}", code=1,
                                         named=("{chat_no_user_jsonl}", "row 3", "no user turn")),
    "chat-template-path-missing": case(*TRAIN, *FROM_FILE, "data.path={chat_jsonl}", "data.chat_template={out}/t.jinja",
                                       code=2, named=("config error", "data.chat_template", "{out}/t.jinja")),
    # reasoning-gym tasks and ecosystem rewards (the tasks extra)
    "reasoning-gym-task-unknown": case(*TRAIN, "data.task=reasoning_gym:basic_arithmetc", "run.output_dir={out}", code=2,
                                       named=("config error", "data.task", "did you mean reasoning_gym:basic_arithmetic",
                                              "available:")),
    "reasoning-gym-task-options-rejected": case(*TRAIN, "data.task=reasoning_gym:basic_arithmetic",
                                                "data.task_options={{min_terms: 5, max_terms: 2}}", "run.output_dir={out}",
                                                code=2, named=("config error", "data.task", "min_terms=5",
                                                               "max_terms must be >= min_terms")),
    "multiply-tool-call-share-out-of-range": case(*TRAIN, "model.path={tiny}", "data.task=multiply_tool", "data.task_options={{calls: 2}}",
                                                  "run.output_dir={out}", code=1,
                                                  named=("multiply_tool", "calls must be a share in [0, 1]")),
    "reasoning-gym-task-option-unknown": case(*TRAIN, "data.task=reasoning_gym:basic_arithmetic",
                                              "data.task_options={{digits: 2}}", "run.output_dir={out}", code=2,
                                              named=("config error", "data.task", "digits")),
}
# diffusion policies (kind: flow_grpo / flow_matching recipes): the same contract
FLOW = ["train", "{recipes}/flow_grpo_shapes.yaml", "run.steps=1", "run.progress=false", "run.save_final=false",
        "run.prompts_per_step=2", "sampling.n=2", "sampling.resolution=8", "run.output_dir={out}"]
CASES.update({
    "flow-resume-from-a-folder-that-is-not-a-checkpoint": case(*FLOW, "model.path={flow}", "run.resume={flow}", code=1,
                                                               named=("run.resume", "{flow}", "not a checkpoint folder")),
    "flow-resume-from-a-language-checkpoint": case(*FLOW, "model.path={flow}", "run.resume={resume_good}", code=1,
                                                   named=("{resume_good}", "config.yaml", "cannot be read")),
    "flow-policy-that-is-not-a-diffusers-model": case(*FLOW, "model.path={tiny}", code=1,
                                                      named=("{tiny}", "transformers model", "transformer/")),
    "flow-scheduler-not-flow-matching": case(*FLOW, "model.path={flow_ddpm}", code=1,
                                             named=("{flow_ddpm}/scheduler", "DDPMScheduler", "FlowMatchEulerDiscreteScheduler")),
    "flow-resolution-not-a-multiple-of-the-patch": case(*FLOW, "model.path={flow}", "sampling.resolution=7", code=2,
                                                        named=("config error", "sampling.resolution", "7 px", "multiple of 2")),
    "flow-resolution-beyond-the-position-embeddings": case(*FLOW, "model.path={flow}", "sampling.resolution=64", code=2,
                                                           named=("config error", "sampling.resolution", "position embeddings")),
    "flow-text-reward-on-images": case(*FLOW, "model.path={flow}", "reward.rules=[{{fn: gcore_rl.rewards.builtin:exact_match}}]",
                                       code=2, named=("config error", "reward.rules.0.fn", "scores text")),
    "flow-noise-level-zero": case(*FLOW, "model.path={flow}", "sampling.noise_level=0", code=2,
                                  named=("config error", "sampling.noise_level", "no log-probability")),
    "flow-image-reward-model-with-two-outputs": case(*FLOW, "model.path={flow}", "reward_model.model_path={vit_two}", code=1,
                                                     named=("{vit_two}", "shape (1, 2)", "num_labels=1")),
    "flow-image-reward-model-giving-nan": case(*FLOW, "model.path={flow}", "reward_model.model_path={vit_nan}", code=1,
                                               named=("{vit_nan}", "non-finite score")),
    "flow-image-reward-model-not-a-model": case(*FLOW, "model.path={flow}", "reward_model.model_path={flow}", code=1,
                                                named=("{flow}", "no config.json")),
    "flow-vision-policy-as-the-image-reward-model": case(*FLOW, "model.path={flow}", "reward_model.model_path={tiny_vl}",
                                                         code=1, named=("{tiny_vl}", "without a reward head", "gcore-rl rm")),
    "flow-partial-on-the-local-runtime": case(*FLOW, "model.path={flow}", "placement.strategy=partial",
                                              "reward_model.model_path={vit_two}", code=2,
                                              named=("config error", "placement.strategy", "runtime.kind=ray")),
    "flow-partial-without-a-reward-model": case(*FLOW, "model.path={flow}", "placement.strategy=partial",
                                                "runtime.kind=ray", "runtime.devices_per_controller=2", code=2,
                                                named=("config error", "placement.strategy", "reward_model.model_path")),
    "flow-cuda-without-cuda": case(*FLOW, "model.path={flow}", "runtime.device=cuda", code=2,
                                   named=("config error", "runtime.device", "no usable CUDA device")),
    "flow-cuda-on-ray-without-cuda": case(*FLOW, "model.path={flow}", "runtime.device=cuda", "runtime.kind=ray", code=2,
                                          named=("config error", "runtime.device", "no usable CUDA device")),
    "flow-batch-whitening-over-two-controllers": case(*FLOW, "model.path={flow}", "algo.advantage=reinforce_pp",
                                                      "runtime.controllers=2", "run.prompts_per_step=2", code=2,
                                                      named=("config error", "algo.advantage", "whitens")),
    "flow-dynamic-on-two-devices-per-controller": case(*FLOW, "model.path={flow}", "placement.strategy=dynamic",
                                                       "reward_model.model_path={vit_two}", "runtime.kind=ray",
                                                       "runtime.devices_per_controller=2", code=2,
                                                       named=("config error", "placement.strategy",
                                                              "at least 3 devices per slice")),
    "flow-staleness-two-under-colocate": case(*FLOW, "model.path={flow}", "placement.max_staleness=2", code=2,
                                              named=("config error", "placement.max_staleness", "rolls out ahead")),
    "flow-min-devices-of-a-role-it-has-not": case(*FLOW, "model.path={flow}", "placement.min_devices={{judge: 2}}",
                                                  code=2, named=("config error", "placement.min_devices.judge",
                                                                 "unknown role")),
    "flow-lora-syncing-adapters-alone": case(*FLOW, "model.path={flow}", "model.lora.enabled=true",
                                             "model.lora.sync=adapters", code=2,
                                             named=("config error", "model.lora.sync", "merged weights only")),
    "flow-lora-targets-that-match-nothing": case(*FLOW, "model.path={flow}", "model.lora.enabled=true",
                                                 "model.lora.target_modules=[q_proj]", code=2,
                                                 named=("config error", "model.lora.target_modules", "match no module")),
    "flow-sft-over-a-model": case("sft", "{recipes}/flow_sft_shapes.yaml", "model_path={flow}", "output_dir={flow}", code=2,
                                  named=("config error", "output_dir", "already holds a model")),
    "init-tiny-diffusion-flux-head-not-a-multiple-of-8": case("init-tiny-diffusion", "{out}", "arch=flux", "head_dim=12",
                                                              code=2, named=("config error", "head_dim", "multiple of 8")),
    # release layouts (several text encoders): a part missing, or of another width than the transformer's text stream
    "flow-release-text-encoder-2-missing": case(*FLOW, "model.path={flow_release_no_te2}", code=1,
                                                named=("{flow_release_no_te2}", "lists text_encoder_2", "model_index.json",
                                                       "no text_encoder_2/")),
    "flow-release-t5-narrower-than-the-transformer": case(*FLOW, "model.path={flow_release_narrow_t5}", code=1,
                                                          named=("{flow_release_narrow_t5}", "text_encoder_2/ (T5)",
                                                                 "64 wide", "joint_attention_dim=128")),
    "init-tiny-diffusion-release-resolution-not-a-multiple-of-4": case(
        "init-tiny-diffusion", "{out}", "text_encoders=release", "resolution=6", code=2,
        named=("config error", "resolution", "multiple of 4")),
})
# vision-language policies (the tiny Qwen2-VL `tiny_vl`, 16-pixel images: 4 image tokens + 2 slot markers) and
# prompt rows with images: a bad image or row names the file and the global row (exit 1), what a vision policy
# cannot do yet names the config key (exit 2)
VL_FROM_FILE = ["model.path={tiny_vl}", "data.task=null", "run.output_dir={out}"]
VISUAL_TASK = ["data.task=shapes_vqa", "data.task_options={{size: 16}}"]
TOOL_TURNS = ("rollout.function=gcore_rl.agents.tool_turns:tool_turns",)
ENV_TURNS = ("rollout.function=gcore_rl.agents.env_turns:env_turns",)
SFT_FROM_FILE = ["sft", "{recipes}/sft_addition.yaml", "data.task=null", "output_dir={out}", "steps=1", "eval_every=0",
                 "target_accuracy=0"]
MISSING_IMAGE = ("{vl_missing_jsonl}", "row 2", "{vl_images}/gone.png", "does not exist")
IMAGES_FOR_A_TEXT_MODEL = ("{vl_jsonl}", "row 0", "text-only model", "arch=qwen2_vl")
CASES.update({
    "image-file-missing": case(*TRAIN, *VL_FROM_FILE, "data.path={vl_missing_jsonl}", code=1, named=MISSING_IMAGE),
    "sft-image-file-missing": case(*SFT_FROM_FILE, "model.path={tiny_vl}", "data.path={vl_missing_jsonl}", code=1,
                                   named=MISSING_IMAGE),
    "image-bytes-corrupt": case(*TRAIN, *VL_FROM_FILE, "data.path={vl_junk_jsonl}", code=1,
                                named=("{vl_junk_jsonl}", "row 1", "{vl_images}/junk.png", "cannot be decoded as an image")),
    "more-placeholders-than-images": case(*TRAIN, *VL_FROM_FILE, "data.path={vl_placeholders_jsonl}", code=1,
                                          named=("{vl_placeholders_jsonl}", "row 3", "2 <image> placeholders",
                                                 "one image per placeholder")),
    "image-over-max-image-pixels": case(*TRAIN, *VL_FROM_FILE, "data.path={vl_jsonl}", "data.max_image_pixels=100", code=1,
                                        named=("{vl_jsonl}", "row 0", "{vl_images}/0.png", "16×16 = 256 pixels",
                                               "data.max_image_pixels=100")),
    # 7 text tokens + 6 for the image do not fit the 256 - 246 = 10 positions left
    "image-tokens-overflow-the-context": case(*TRAIN, *VL_FROM_FILE, "data.path={vl_jsonl}", "sampling.max_new_tokens=246",
                                              code=1, named=("{vl_jsonl}", "row 0", "13 tokens (its 1 image(s) included)",
                                                             "only 10 fit", "sampling.max_new_tokens=246")),
    # 45 images × 6 tokens + "colour?" + the answer and EOS: 283 tokens for a 256-position model
    "sft-image-tokens-overflow-the-context": case(*SFT_FROM_FILE, "model.path={tiny_vl}", "data.path={vl_crowded_jsonl}",
                                                  code=1, named=("{vl_crowded_jsonl}", "row 1", "283 tokens",
                                                                 "max_position_embeddings")),
    "text-only-policy-given-image-rows": case(*TRAIN, *FROM_FILE, "data.path={vl_jsonl}", code=1,
                                              named=IMAGES_FOR_A_TEXT_MODEL),
    "sft-text-only-policy-given-image-rows": case(*SFT_FROM_FILE, "model.path={tiny}", "data.path={vl_jsonl}", code=1,
                                                  named=IMAGES_FOR_A_TEXT_MODEL),
    "text-only-policy-given-a-visual-task": case(*TRAIN, "model.path={tiny}", *VISUAL_TASK, "run.output_dir={out}", code=1,
                                                 named=("synthetic task 'shapes_vqa'", "row 0", "text-only model")),
    "critic-with-a-vision-policy": case(*TRAIN, "model.path={tiny_vl}", *VISUAL_TASK, "algo.advantage=gae",
                                        "run.output_dir={out}", code=2,
                                        named=("config error", "algo.advantage", "{tiny_vl}", "vision-language model")),
    "interleave-with-a-vision-policy": case(*TRAIN, "model.path={tiny_vl}", *VISUAL_TASK, "runtime.kind=ray",
                                            "placement.strategy=interleave", "runtime.devices_per_controller=2",
                                            "algo.kl_coef=0.1", "reward_model.enabled=true", "reward_model.model_path={tiny}",
                                            "run.output_dir={out}", code=2,
                                            named=("config error", "placement.strategy", "prompts' images")),
    "rm-group-softmax-with-one-sample-per-prompt": case(*TRAIN, "model.path={tiny}", "reward_model.enabled=true",
                                                        "reward_model.model_path={tiny}", "reward_model.transform=group_softmax",
                                                        "sampling.n=1", "algo.advantage=reinforce_pp", "run.output_dir={out}",
                                                        code=2, named=("config error", "reward_model.transform", "sampling.n=1")),
    "rm-group-softmax-with-remax": case(*TRAIN, "model.path={tiny}", "reward_model.enabled=true",
                                        "reward_model.model_path={tiny}", "reward_model.transform=group_softmax",
                                        "algo.advantage=remax", "run.output_dir={out}", code=2,
                                        named=("config error", "reward_model.transform", "remax", "greedy")),
    "vllm-with-a-vision-policy": case(*TRAIN, "model.path={tiny_vl}", *VISUAL_TASK, "engine.backend=vllm",
                                      "run.output_dir={out}", code=2,
                                      named=("config error", "engine.backend", "{tiny_vl}", "without their images",
                                             "builtin")),
    "vision-policy-as-a-reward-model": case(*TRAIN, "model.path={tiny_vl}", *VISUAL_TASK, "reward_model.enabled=true",
                                            "reward_model.model_path={tiny_vl}", "run.output_dir={out}", code=1,
                                            named=("{tiny_vl}", "without a reward head", "gcore-rl rm")),
    "vision-reward-head-of-the-wrong-shape": case(*TRAIN, "model.path={tiny_vl}", *VISUAL_TASK, "reward_model.enabled=true",
                                                  "reward_model.model_path={vl_rm_bad_head}", "run.output_dir={out}",
                                                  code=1, named=("{vl_rm_bad_head}/reward_head.safetensors",
                                                                 "[1, 7]", "needs [1, 32]")),
    "rm-image-pairs-for-a-text-model": case("rm", "{recipes}/rm_addition.yaml", "model.path={tiny}",
                                            "data.task=shapes_preferences", "data.task_options={{size: 16}}",
                                            "data.num_prompts=8", "output_dir={out}",
                                            "steps=1", "eval_pairs=0", code=1,
                                            named=("row 0", "has images", "{tiny}", "text-only model")),
    "rm-keep-best-without-evaluations": case("rm", "{recipes}/rm_addition.yaml", "model.path={tiny}",
                                             "output_dir={out}", "keep_best=true", code=2,
                                             named=("config error", "keep_best", "eval_every > 0")),
    "rm-target-not-reached": case("rm", "{recipes}/rm_addition.yaml", "model.path={tiny}", "output_dir={out}",
                                  "steps=2", "eval_every=1", "eval_pairs=8", "data.num_prompts=64",
                                  "target_accuracy=1.0", code=1,
                                  named=("cap of 2 steps", "target_accuracy=1.0", "saved in {out}")),
    "sft-lr-schedule-unknown": case("sft", "{recipes}/sft_addition.yaml", "model.path={tiny}", "output_dir={out}",
                                    "lr_schedule=exponential", code=2,
                                    named=("config error", "lr_schedule", "exponential", "cosine")),
    "engine-backend-unknown": case(*TRAIN, "engine.backend=vlm", "run.output_dir={earlier}", code=2,
                                   named=("config error", "engine.backend", "'vlm'", "builtin", "package.module:build")),
    "engine-backend-not-importable": case(*TRAIN, "model.path={tiny}", "engine.backend=no_such_module:build",
                                          "run.output_dir={out}", code=2,
                                          named=("config error", "engine.backend", "no_such_module:build")),
    "rollout-function-not-importable": case(*TRAIN, "model.path={tiny}", "rollout.function=no_such_module:turns",
                                            "run.output_dir={out}", code=2,
                                            named=("config error", "rollout.function", "no_such_module:turns")),
    "surplus-age-negative": case(*TRAIN, "dynamic_sampling.max_surplus_age=-1", "run.output_dir={earlier}", code=2,
                                 named=("config error", "dynamic_sampling.max_surplus_age", ">= 0")),
    "health-threshold-negative": case(*TRAIN, "run.health.max_approx_kl=-0.1", "run.output_dir={earlier}", code=2,
                                      named=("config error", "run.health.max_approx_kl", ">= 0")),
    "sft-tool-not-importable": case(*SFT_FROM_FILE, "model.path={tiny}", "data.path={chat_jsonl}", "train_turns=all",
                                    "tools=[no_such_tools:mul]", code=2,
                                    named=("config error", "tools.0", "no_such_tools:mul")),
    "tool-module-not-importable": case(*TRAIN, "model.path={tiny}", *TOOL_TURNS, "rollout.options={{tools: [no_such_tools:mul]}}",
                                       "run.output_dir={out}", code=2,
                                       named=("config error", "rollout.options.tools.0", "no_such_tools:mul")),
    "template-without-tool-support": case(*TRAIN, "model.path={tiny}", *TOOL_TURNS,
                                          "rollout.options={{tools: [gcore_rl.agents.builtin_tools:calculator]}}",
                                          "data.chat_template={no_tool_jinja}", "run.output_dir={out}", code=2,
                                          named=("config error", "data.chat_template", "role 'tool'")),
    "tool-turns-without-tools": case(*TRAIN, "model.path={tiny}", *TOOL_TURNS, "run.output_dir={out}", code=2,
                                     named=("config error", "rollout.options.tools", "names no tool")),
    "textarena-game-unknown": case(*TRAIN, "model.path={tiny}", *ENV_TURNS, "data.task=textarena:GuessTheNumbr-v0",
                                   "data.task_options={{}}", "run.output_dir={out}", code=2,
                                   named=("config error", "data.task", "names no textarena game", "GuessTheNumber-v0")),
    "textarena-game-options-it-does-not-take": case(*TRAIN, "model.path={tiny}", *ENV_TURNS,
                                                    "data.task=textarena:GuessTheNumber-v0", "run.output_dir={out}", code=2,
                                                    named=("config error", "data.task", "GuessTheNumber-v0",
                                                           "cannot be built with the options", "digits")),
    "textarena-game-for-two-players": case(*TRAIN, "model.path={tiny}", *ENV_TURNS, "data.task=textarena:TicTacToe-v0",
                                           "data.task_options={{}}", "run.output_dir={out}", code=2,
                                           named=("config error", "data.task", "cannot be played by one player")),
    "environment-task-without-an-environment-rollout": case(*TRAIN, "model.path={tiny}",
                                                            "data.task=textarena:GuessTheNumber-v0",
                                                            "data.task_options={{}}", "run.output_dir={out}",
                                                            code=2, named=("config error", "rollout.function", "env_turns")),
    "env-column-naming-no-environment": case(*TRAIN, *FROM_FILE, *ENV_TURNS, "data.path={env_bad_jsonl}",
                                             "data.answer_field=null", "reward.rules=[]", "reward.accuracy_fn=null",
                                             code=1, named=("{env_bad_jsonl}", "row 0", "`env` column",
                                                            "no_such_envs:Game", "names no environment")),
    "agent-loop-without-an-agent": case(*TRAIN, "model.path={tiny}", "rollout.function=gcore_rl.agents.agent_loop:agent_loop",
                                        "run.output_dir={out}", code=2,
                                        named=("config error", "rollout.options.agent", "names no agent")),
    "agent-not-importable": case(*TRAIN, "model.path={tiny}", "rollout.function=gcore_rl.agents.agent_loop:agent_loop",
                                 "rollout.options={{agent: no_such_agents:run}}", "run.output_dir={out}", code=2,
                                 named=("config error", "rollout.options.agent", "no_such_agents:run")),
    "no-reward-at-all": case(*TRAIN, "model.path={tiny}", "reward.rules=[]", "run.output_dir={out}", code=2,
                             named=("config error", "reward.rules", "is empty", "no judge, reward model or environment")),
    "init-tiny-vision-image-size-not-a-multiple-of-the-merged-patch": case(
        "init-tiny", "{out}", "arch=qwen2_vl", "vision.image_size=15", code=2, named=("config error", "image_size", "15")),
})
# a misspelt name: the error suggests the nearest valid one(s)
CASES.update({
    "command-misspelt": case("trian", "{recipe}", code=2, named=("'trian' is not a command", "did you mean train?")),
    "override-key-misspelt": case(*TRAIN, "run.stpes=3", "run.output_dir={earlier}", code=2,
                                  named=("config error", "`run.stpes`", "did you mean `run.steps`?")),
    "override-section-misspelt": case(*TRAIN, "rnu.steps=3", "run.output_dir={earlier}", code=2,
                                      named=("config error", "`rnu`", "did you mean `run`?")),
    "recipe-key-misspelt": case("train", "{typo_recipe}", "run.output_dir={earlier}", code=2,
                                named=("config error", "`algo.kl_cof`", "did you mean `algo.kl_coef`?")),
    "sft-override-key-misspelt": case(*SFT_FROM_FILE, "model.path={tiny}", "stpes=1", code=2,
                                      named=("config error", "`stpes`", "did you mean `steps`?")),
    "scenario-override-key-misspelt": case("simulate", "{scenario}", "--out", "{out}", "gpu=16", code=2,
                                           named=("config error", "`gpu`", "did you mean `gpus`?")),
})
NEEDS_NO_CUDA = {"cuda-without-cuda", "cuda-without-cuda-on-ray", "flow-cuda-without-cuda"}
KNOWN_BUGS: dict[str, str] = {}
"""Cases that fail today for a known reason (strict xfail: fixing the bug turns them red, so the mark goes)."""


def write_jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def json_lines(rows: list[dict]) -> list[bytes]:
    return [json.dumps(row).encode() for row in rows]


def latin1_parquet(path: Path) -> Path:
    """A Parquet file whose `prompt` of row 1 holds Latin-1 bytes (Arrow writes string bytes unchecked)."""
    raw = pa.array([b"1+1=", b"caf\xe9+1=", b"2+2=", b"3+3="], pa.binary())
    prompts = pa.StringArray.from_buffers(len(raw), raw.buffers()[1], raw.buffers()[2])
    pq.write_table(pa.table({"prompt": prompts, "answer": ["2", "1", "4", "6"]}), path)
    return path


def checkpoints(root: Path, model_dir: Path) -> dict[str, Path]:
    """Checkpoints of the tiny model: one whose DCP shard was cut short, one whose shard is gone."""
    paths = {name: write_checkpoint(root, step, model_dir)[0]
             for step, name in enumerate(("checkpoint_truncated", "checkpoint_no_shard"), start=1)}
    shard = paths["checkpoint_truncated"] / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (paths["checkpoint_no_shard"] / SHARD).unlink()
    return paths


def training_checkpoints(root: Path) -> dict[str, Path]:
    """A checkpoint that `train` wrote for the model `policy`, damaged copies of it, and then `policy` replaced by
    a model of another shape (the cases that must fail before loading weights do so whatever the model holds)."""
    policy = Path(shutil.copytree(root / "tiny", root / "policy"))
    saved = root / "saved"
    proc = gcore_rl(*[arg.format(recipe=RECIPE) for arg in TRAIN], f"model.path={policy}", f"run.output_dir={saved}",
                    "run.checkpoint_every=1", cwd=root)
    assert proc.returncode == 0, proc.stderr
    good = saved / "checkpoints" / "step-00000001"
    paths = {"policy": policy, "resume_good": good}
    for name in ("resume_truncated", "resume_no_shard"):
        paths[name] = Path(shutil.copytree(good, root / name / good.name))
    shard = paths["resume_truncated"] / SHARD
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    (paths["resume_no_shard"] / SHARD).unlink()
    shutil.rmtree(policy)
    proc = gcore_rl("init-tiny", policy, "hidden_size=48", "num_layers=2", "intermediate_size=64", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return paths


def ppo_checkpoint(root: Path) -> dict[str, Path]:
    """A checkpoint of a PPO job whose critic trained beside the actor (local runtime), and its model."""
    policy = Path(shutil.copytree(root / "tiny", root / "ppo_policy"))
    saved = root / "ppo_saved"
    proc = gcore_rl(*[arg.format(recipe=RECIPE) for arg in TRAIN], *PPO, f"model.path={policy}",
                    f"run.output_dir={saved}", "run.checkpoint_every=1", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return {"ppo_policy": policy, "resume_ppo": saved / "checkpoints" / "step-00000001"}


def lora_checkpoint(root: Path) -> dict[str, Path]:
    """A checkpoint of a LoRA job (its adapters only), its base model, and a folder of adapters without a base."""
    policy = Path(shutil.copytree(root / "tiny", root / "lora_policy"))
    saved = root / "lora_saved"
    proc = gcore_rl(*[arg.format(recipe=RECIPE) for arg in TRAIN], "model.lora.enabled=true", f"model.path={policy}",
                    f"run.output_dir={saved}", "run.checkpoint_every=1", cwd=root)
    assert proc.returncode == 0, proc.stderr
    adapters = root / "adapter_only"
    adapters.mkdir()
    (adapters / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "elsewhere/base", "r": 4}))
    return {"lora_policy": policy, "resume_lora": saved / "checkpoints" / "step-00000001", "adapter_only": adapters}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, Path]:
    """Paths the cases name: a model and damaged copies of it, an earlier run, checkpoints, and prompt files."""
    root = tmp_path_factory.mktemp("bad-inputs")
    tiny = init_tiny(root)
    paths = {"tiny": tiny, "recipe": RECIPE, "recipes": REPO / "recipes", "scenario": REPO / "scenarios" / "gpus8_judge.yaml"}
    paths["typo_recipe"] = root / "typo.yaml"  # the demo recipe with a misspelt key
    paths["typo_recipe"].write_text(RECIPE.read_text().replace("  kl_coef:", "  kl_cof:", 1))
    for name in ("damaged", "no_config", "bad_tokenizer"):
        paths[name] = Path(shutil.copytree(tiny, root / name))
    weights = paths["damaged"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a copy cut short
    (paths["no_config"] / "config.json").unlink()
    (paths["bad_tokenizer"] / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nope"}}')
    earlier = paths["earlier"] = root / "earlier"
    shutil.copytree(tiny, earlier / "final")
    (earlier / "config.yaml").write_text("run:\n  steps: 1\n")
    (earlier / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.5}\n')
    cut = paths["cut_run"] = root / "cut_run"  # a run killed while writing its third metrics line
    cut.mkdir()
    (cut / "metrics.jsonl").write_text('{"step": 1, "reward/mean": 0.25}\n{"step": 2, "reward/mean": 0.5}\n{"step": 3, "rew')
    paths.update(checkpoints(root / "checkpoints", tiny))
    paths.update(training_checkpoints(root))
    paths.update(ppo_checkpoint(root))
    paths.update(lora_checkpoint(root))
    paths["latin1_jsonl"] = write_jsonl(root / "latin1.jsonl", [*json_lines(ADDITION_ROWS[:1]),
                                                              b'{"prompt": "caf\xe9+1=", "answer": "1"}',
                                                              *json_lines(ADDITION_ROWS[1:])])
    paths["latin1_parquet"] = latin1_parquet(root / "latin1.parquet")
    paths["broken_jsonl"] = write_jsonl(root / "broken.jsonl", [*json_lines(ADDITION_ROWS[:2]),
                                                              b'{"prompt": "5+5=, "answer": "10"}',
                                                              *json_lines(ADDITION_ROWS[2:])])
    paths["no_prompt_jsonl"] = write_jsonl(root / "no_prompt.jsonl", json_lines(
        [*ADDITION_ROWS[:2], {"question": "5+5=", "answer": "10"}, *ADDITION_ROWS[2:]]))
    paths["long_jsonl"] = write_jsonl(root / "long.jsonl", json_lines(
        [*ADDITION_ROWS[:3], {"prompt": "9" * 297 + "+1=", "answer": "1" + "0" * 297}, *ADDITION_ROWS[3:]]))
    paths.update(chat_files(root))
    paths.update(flow_models(root))
    paths.update(vision_files(root))
    return paths


def vision_files(root: Path) -> dict[str, Path]:
    """The tiny Qwen2-VL, a copy with a reward head that does not fit it, and JSONL files of colour questions
    about 16-pixel PNGs (paths relative to the file): one good, one each with a missing image file, junk bytes
    in a .png, two placeholders for one image, and a row of 45 images."""
    from PIL import Image
    from safetensors.torch import save_file

    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.models.vision import TinyVisionConfig

    tiny_vl = write_tiny_model(root / "tiny_vl", TinyModelConfig(arch="qwen2_vl", hidden_size=32, num_layers=1,
                                                                  intermediate_size=64, vision=TinyVisionConfig(image_size=16)))
    images = root / "vl_images"
    images.mkdir()
    rows = []
    for index, colour in enumerate(("red", "green", "blue", "yellow")):
        Image.new("RGB", (16, 16), colour).save(images / f"{index}.png")
        rows.append({"prompt": "<image>colour?", "answer": colour, "images": [f"{images.name}/{index}.png"]})
    (images / "junk.png").write_bytes(b"not a PNG at all\x00\x01" * 8)
    bad_rows = {"vl_missing_jsonl": (2, {"images": [f"{images.name}/gone.png"]}),
                "vl_junk_jsonl": (1, {"images": [f"{images.name}/junk.png"]}),
                "vl_placeholders_jsonl": (3, {"prompt": "<image><image>colour?"}),
                "vl_crowded_jsonl": (1, {"prompt": "<image>" * 45 + "colour?", "images": rows[1]["images"] * 45})}
    paths = {"tiny_vl": tiny_vl, "vl_images": images, "vl_jsonl": write_jsonl(root / "vl.jsonl", json_lines(rows))}
    bad_head = paths["vl_rm_bad_head"] = Path(shutil.copytree(tiny_vl, root / "vl_rm_bad_head"))
    save_file({"score.weight": torch.zeros(1, 7)}, str(bad_head / "reward_head.safetensors"))  # hidden size is 32
    for name, (index, change) in bad_rows.items():
        changed = [{**row, **change} if number == index else row for number, row in enumerate(rows)]
        paths[name] = write_jsonl(root / f"{name.removesuffix('_jsonl')}.jsonl", json_lines(changed))
    return paths


def flow_models(root: Path) -> dict[str, Path]:
    """A tiny flow model, a copy whose scheduler is DDPM's, image classifiers with 2 outputs / NaN weights, and
    release-layout folders: an SD3 one without text_encoder_2/, a FLUX one whose T5 is 64 wide (the transformer's
    text stream 128)."""
    from transformers import ViTConfig, ViTForImageClassification

    proc = gcore_rl("init-tiny-diffusion", "flow", "resolution=8", "num_layers=1", cwd=root)
    assert proc.returncode == 0, proc.stderr
    ddpm = Path(shutil.copytree(root / "flow", root / "flow_ddpm"))
    config = ddpm / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "_class_name": "DDPMScheduler"}))
    paths = {"flow": root / "flow", "flow_ddpm": ddpm}
    for name, labels in (("vit_two", 2), ("vit_nan", 1)):
        model = ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                                    num_attention_heads=2, intermediate_size=32, num_labels=labels))
        if name == "vit_nan":
            model.classifier.weight.data.fill_(float("nan"))
        model.save_pretrained(root / name)
        paths[name] = root / name
    return {**paths, **release_flow_models(root)}


def release_flow_models(root: Path) -> dict[str, Path]:
    """Tiny SD3 / FLUX release-layout folders with a part missing or too narrow (see `flow_models`)."""
    from gcore_rl.models.flow import TinyDiffusionConfig, write_tiny_diffusion

    def release(name: str, arch: str, **shape) -> Path:
        return write_tiny_diffusion(root / name, TinyDiffusionConfig(arch=arch, text_encoders="release", resolution=8,
                                                                     num_layers=1, **shape))

    no_te2 = release("flow_release_no_te2", "sd3")
    shutil.rmtree(no_te2 / "text_encoder_2")
    narrow_t5, donor = release("flow_release_narrow_t5", "flux"), release("flow_release_donor", "flux", text_hidden=16)
    shutil.rmtree(narrow_t5 / "text_encoder_2")
    shutil.copytree(donor / "text_encoder_2", narrow_t5 / "text_encoder_2")
    return {"flow_release_no_te2": no_te2, "flow_release_narrow_t5": narrow_t5}


def chat_files(root: Path) -> dict[str, Path]:
    """Chat-format prompt files, each with one bad row, and a template that refuses system turns."""
    chats = [{"messages": [{"role": "user", "content": row["prompt"]}], "answer": row["answer"]} for row in ADDITION_ROWS]
    system = {"messages": [{"role": "system", "content": "Add."}, *chats[0]["messages"]], "answer": "2"}
    tool = {"messages": [{"role": "function", "content": "2"}, *chats[0]["messages"]], "answer": "2"}
    no_user = {"messages": [{"role": "system", "content": "Add."}, {"role": "assistant", "content": "2"}], "answer": "2"}
    no_tool = root / "no_tool.jinja"  # the tiny template without its tool branch: a tool message renders as nothing
    no_tool.write_text("{% for m in messages %}{% if m.role == 'user' %}U:{{ m.content }}\n{% elif m.role == 'assistant' %}"
                       "A:{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    strict = root / "strict.jinja"
    strict.write_text("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system turns here') }}"
                      "{% endif %}{{ m.content }}{% endfor %}")
    return {"strict_jinja": strict, "no_tool_jinja": no_tool,
            "chat_jsonl": write_jsonl(root / "chat.jsonl", json_lines([*chats[:2], system, *chats[2:]])),
            "chat_tool_jsonl": write_jsonl(root / "chat_tool.jsonl", json_lines([chats[0], tool, *chats[1:]])),
            "chat_no_user_jsonl": write_jsonl(root / "chat_no_user.jsonl", json_lines([*chats[:3], no_user, chats[3]])),
            "env_bad_jsonl": write_jsonl(root / "env_bad.jsonl", json_lines(
                [{**chat, "env": {"name": "no_such_envs:Game", "seed": 1}} for chat in chats]))}


def fill(args: Sequence[str], paths: dict[str, Path]) -> list[str]:
    """`args` with each ``{name}`` replaced by ``paths[name]``."""
    return [arg.format(**paths) for arg in args]


def fingerprints(root: Path) -> dict[str, str]:
    """Digest of every file under `root`, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.skipif(name in NEEDS_NO_CUDA and torch.cuda.is_available(),
                                                 reason="this machine has CUDA"),
                              *([pytest.mark.xfail(reason=KNOWN_BUGS[name], strict=True)] if name in KNOWN_BUGS else [])])
    for name in CASES
])
def test_bad_input_is_named_in_one_paragraph_and_damages_nothing(name, world, tmp_path):
    spec = CASES[name]
    paths = {**world, "out": tmp_path / "out"}
    root = world["tiny"].parent
    before = fingerprints(root)
    proc = gcore_rl(*fill(spec.args, paths), cwd=tmp_path)
    assert_user_error(proc, spec.code, *(needle.format(**paths) for needle in spec.named))
    assert proc.stderr.strip().count("\n\n") == 0, proc.stderr  # one paragraph
    assert fingerprints(root) == before, "an earlier run, model or data file was changed"
    assert not (paths["out"] / "metrics.jsonl").exists()


@pytest.mark.parametrize(("blocked", "args", "named"), [
    ("math_verify", ["reward.rules.0.fn=gcore_rl.rewards.ecosystem:math_verify"],
     ("config error", "reward.rules.0.fn", "math-verify", "gcore-rl[tasks]")),
    ("reasoning_gym", ["data.task=reasoning_gym:basic_arithmetic"], ("config error", "data.task", "gcore-rl[tasks]")),
])
def test_a_missing_extra_is_named(blocked, args, named, world, tmp_path):
    """With the package unimportable (a module of its name that raises ImportError, first on the path), the
    job stops before it starts and names the extra to install."""
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / f"{blocked}.py").write_text(f"raise ImportError('no module named {blocked} (blocked by the test)')\n")
    paths = {**world, "out": tmp_path / "out"}
    proc = gcore_rl(*fill([*TRAIN, *args, "run.output_dir={out}"], paths), cwd=tmp_path, extra_pythonpath=blocker)
    assert_user_error(proc, 2, *named)
    assert not (paths["out"] / "metrics.jsonl").exists()


def test_simulate_takes_overrides_between_options(world, tmp_path):
    out = tmp_path / "sim"
    proc = gcore_rl("simulate", world["scenario"], "--out", out, "gpus=16", "--steps", "1", "--strategies", "colocate",
                    cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "results.json").read_text())["scenario"]["gpus"] == 16


def test_overlong_prompts_truncate_runs_and_counts_them(world, tmp_path):
    out = tmp_path / "run"
    proc = gcore_rl(*fill([*TRAIN, *FROM_FILE, "data.path={long_jsonl}"], {**world, "out": out}),
                    "data.overlong_prompts=truncate", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["data/prompts_truncated"] == 1.0
    assert record["data/prompts_dropped"] == 0.0


def test_report_of_a_cut_off_run_shows_what_is_there(world, tmp_path):
    out = tmp_path / "report.html"
    proc = gcore_rl("report", world["cut_run"], "--out", out, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    page = out.read_text()
    assert "Missing data" in page and "its last line could not be read" in page
    assert "the 2 complete line(s)" in page
