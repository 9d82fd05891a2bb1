"""End-to-end GRPO step: gcore-rl vs TRL's `GRPOTrainer` on CPU or one GPU, same model, data, reward and settings.

Both sides train the same random Qwen2-shaped model folder (written once with our own
``gcore-rl init-tiny DIR arch=qwen2 ...``: random weights + our character-level tokenizer) on the same
prompt rows (our synthetic ``addition`` task, written to ``prompts.jsonl`` with columns prompt/answer),
with the same reward function (``gcore_rl.rewards.builtin:exact_match``; TRL calls it through
`exact_match_reward` below) and the settings listed in `matched_settings` (printed and written to the
JSON): P prompts × n samples per step, one optimiser step per generation batch, one forward/backward
per step, the same sampling, clipping, loss normalisation, learning rate, gradient clip, fp32.

``--device`` picks where both sides run: ``cpu`` (the default) or ``cuda`` (one GPU, the first one the
children see). On ``cuda`` our side gets ``runtime.device=cuda`` and ``train.bf16=false`` (no bf16 autocast,
so fp32 as on CPU) and TRL ``use_cpu=False`` with ``bf16=False, fp16=False``; every other setting is the
same. ``--bf16`` runs both sides under bf16 autocast instead (ours ``train.bf16=true`` with a bf16 engine,
``engine.dtype=bfloat16``; TRL ``bf16=True``, whose autocast wraps ``generate`` too), fp32 weights kept. The TRL timers then synchronise CUDA at the step's (and generation's) ends, so a step's time holds
its own kernels; our ``time/step`` already ends with the update's metrics read back from the GPU. The GPU's
name, memory and the CUDA version are written to the JSON (``device``), with each side's peak allocated
CUDA memory.

* **gcore-rl** (A) runs through its CLI: ``gcore-rl train WORK/gcore_recipe.yaml run.output_dir=...``
  (local runtime, one controller, one device). Step time = ``time/step`` of ``metrics.jsonl``;
  its phases come from the timelines (``timeline/device-0.jsonl``, ``timeline/controller-0.jsonl``).
* **TRL** (B) runs ``GRPOTrainer.train()`` in ``python grpo_vs_trl.py --trl-worker SPEC``. Step time =
  wall time from ``on_step_begin`` to ``on_step_end`` of a `TrainerCallback` (in TRL the generation
  happens inside the step, in ``_prepare_inputs``); generation and scoring are timed by wrapping
  ``_generate_single_turn`` (``model.generate``) and ``_generate_and_score_completions``.

Every run of every side is a fresh subprocess, in the order A, B, A, B, ...; the first step of each
run is dropped as warm-up. Reported per side: median step time over the kept steps of all repeats
pooled, samples/s = P·n / median step, mean completion length (tokens, EOS included, on both sides),
tokens/s, per-repeat medians, and the ratio gcore/TRL of samples/s (pooled, and the median of the
per-repeat ratios). Both sides get the same torch thread count (``--threads``) and the same
``OMP_NUM_THREADS``/``MKL_NUM_THREADS``; nothing is downloaded (``HF_HUB_OFFLINE=1``,
``TRANSFORMERS_OFFLINE=1``, ``HF_DATASETS_OFFLINE=1``).

Needs the benchmark environment with TRL (``bash benchmarks/bench_env.sh``). Run from the
repository root (the defaults took 4 minutes on a 2-core CPU machine):

    .venv-bench/bin/python benchmarks/grpo_vs_trl.py --out /tmp/bench-work/grpo_vs_trl.json

On one GPU (the same, with ``--device cuda``; ``--python`` may also be a name on ``PATH``):

    .venv-bench/bin/python benchmarks/grpo_vs_trl.py --device cuda --out /tmp/bench-work/grpo_vs_trl_cuda.json

The parent process uses only the standard library, so any Python 3.10+ can drive it; the children
run with ``--python`` (default ``.venv-bench/bin/python``) and its ``gcore-rl`` script, or, where there is
no ``gcore-rl`` next to that interpreter, ``PYTHON -m gcore_rl.cli`` (gcore-rl must then be importable,
e.g. through ``PYTHONPATH``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULT_MARKER = "GRPO_VS_TRL_RESULT "
REWARD_FN = "gcore_rl.rewards.builtin:exact_match"

DEFAULTS = {"repeats": 3, "steps": 6, "prompts_per_step": 16, "n": 8, "max_new_tokens": 64, "hidden_size": 256,
            "num_layers": 4, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 768, "max_positions": 512}
QUICK = {"repeats": 1, "steps": 3, "prompts_per_step": 4, "n": 4, "max_new_tokens": 16, "hidden_size": 64,
         "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 192, "max_positions": 128}
OUR_PHASES = {
    "rollout/generate": ("device", ("rollout/generate",)),
    "rollout/reward": ("controller", ("rollout/reward",)),
    "update/prepare": ("device", ("update/prepare",)),
    "update/train": ("device", ("update/train",)),
    "update/sync": ("device", ("update/sync",)),
    "swap (engine sleep/wake)": ("device", ("swap/sleep", "swap/wake")),
}
"""Phases of our step: name → (timeline file, timeline events summed); the rest of `time/step` is `other`."""


# ----------------------------------------------------------------------------------------------
# The reward, in TRL's calling convention (the same function our trainer calls per sample)
# ----------------------------------------------------------------------------------------------


def exact_match_reward(prompts: list[str], completions: list[str], answer: list[str], **kwargs: Any) -> list[float]:
    """TRL reward function: `gcore_rl.rewards.builtin.exact_match(prompt, completion, answer=...)` per sample."""
    from gcore_rl.rewards.builtin import exact_match

    return [exact_match(p, c, answer=a) for p, c, a in zip(prompts, completions, answer, strict=True)]


# ----------------------------------------------------------------------------------------------
# The matched settings (one place, used by both sides and reported)
# ----------------------------------------------------------------------------------------------


def _gcore_recipe(args: argparse.Namespace, model: Path, prompts: Path) -> dict:
    batch = args.prompts_per_step * args.n
    recipe = {
        "run": {"steps": args.steps, "prompts_per_step": args.prompts_per_step, "seed": 0, "eval_every": 0,
                "save_final": False, "progress": False},
        "model": {"path": str(model), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"task": None, "path": str(prompts), "prompt_field": "prompt", "answer_field": "answer",
                 "eval_prompts": 0, "shuffle": True, "seed": 0},
        "sampling": {"n": args.n, "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0},
        # one reward call per sample, as in TRL (no separate accuracy metric, which would score every sample again)
        "reward": {"rules": [{"fn": REWARD_FN, "weight": 1.0}], "accuracy_fn": None},
        "dynamic_sampling": {"enabled": False},
        "algo": {"name": "grpo", "scale_rewards": True, "clip_low": 0.2, "clip_high": 0.2,
                 "loss_aggregation": "token_mean", "kl_coef": 0.0, "entropy_coef": 0.0},
        "train": {"lr": args.lr, "weight_decay": 0.0, "betas": [0.9, 0.999], "warmup_steps": 0, "grad_clip": 1.0,
                  "micro_batch_size": batch, "mini_batches": 1, "ppo_epochs": 1},
        "placement": {"strategy": "colocate"},
        # nothing swaps on either side: TRL generates with the model it trains, and ours keeps its engine resident
        "runtime": {"kind": "local", "controllers": 1, "device": "cpu", "threads_per_process": args.threads,
                    "time_share": False},
    }
    if args.device == "cuda":
        recipe["runtime"]["device"] = "cuda"
    # train.bf16 defaults to true and acts on CUDA only: set it either way (and on a CPU through bf16_cpu)
    recipe["train"]["bf16"] = args.bf16
    if args.bf16:
        recipe["train"]["bf16_cpu"] = args.device == "cpu"
        recipe["engine"] = {"dtype": "bfloat16"}
    return recipe


def _trl_config(args: argparse.Namespace) -> dict:
    """Keyword arguments of `trl.GRPOConfig` (output_dir and max_steps are added per run)."""
    batch = args.prompts_per_step * args.n
    return {
        # one generation batch of P×n samples = one optimiser step = one forward/backward
        "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1, "steps_per_generation": 1,
        "num_generations": args.n, "num_iterations": 1,
        "max_completion_length": args.max_new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None,
        "repetition_penalty": 1.0, "use_vllm": False, "use_transformers_continuous_batching": False,
        "beta": 0.0, "loss_type": "dapo", "scale_rewards": "group", "epsilon": 0.2, "epsilon_high": 0.2,
        "importance_sampling_level": "token", "mask_truncated_completions": False, "top_entropy_quantile": 1.0,
        "entropy_coef": 0.0, "multi_objective_aggregation": "sum_then_normalize",
        "learning_rate": args.lr, "lr_scheduler_type": "constant", "warmup_steps": 0, "optim": "adamw_torch",
        "weight_decay": 0.0, "adam_beta1": 0.9, "adam_beta2": 0.999, "adam_epsilon": 1e-8, "max_grad_norm": 1.0,
        "bf16": args.bf16, "fp16": False, "gradient_checkpointing": False, "use_cpu": args.device != "cuda", "seed": 0,
        "shuffle_dataset": True, "remove_unused_columns": False, "dataloader_num_workers": 0,
        "report_to": "none", "save_strategy": "no", "eval_strategy": "no", "logging_strategy": "no",
        "log_completions": False, "disable_tqdm": True,
    }


NOT_MATCHED = [
    "generation engine: TRL uses transformers' generate (the P·n prompt rows are prefilled and stay in the batch until "
    "all finish); ours uses its own KV-cache engine (one prefill per prompt, finished rows leave the batch)",
    "engine weights: ours keeps a separate engine copy of the policy and copies the updated weights into it "
    "(update/sync); TRL generates with the trained model itself",
    "advantage std: TRL divides by the sample std (n-1) + 1e-4, ours by the population std + 1e-6 (both give 0 "
    "for groups with equal rewards, which with a random model are all groups)",
    "log-prob forward: TRL calls the model with labels and fused_lm_head=True (transformers computes the log-probs "
    "and entropies), ours takes log_softmax of the full logits",
]
"""Differences that the two trainers' designs impose (reported, not tuned)."""


def _precision_row(args: argparse.Namespace) -> tuple[str, str, str]:
    """Device and precision: fp32 on both sides, or (`--bf16`) bf16 autocast on both sides over fp32 weights."""
    where = ("runtime.device=cuda", "use_cpu=False (the GPU)") if args.device == "cuda" else \
        ("runtime.device=cpu", "use_cpu=True")
    if not args.bf16:
        return ("device and precision", f"{where[0]}, model.dtype=float32, train.bf16=false (no bf16 autocast)",
                f"{where[1]}, bf16=False, fp16=False (fp32)")
    return ("device and precision", f"{where[0]}, model.dtype=float32, train.bf16=true (forward and backward under "
            "bf16 autocast, bf16 parameter gathers)" + (", train.bf16_cpu=true" if args.device == "cpu" else "")
            + "; the engine's weights in bf16 (engine.dtype=bfloat16: not matched, see not_matched)",
            f"{where[1]}, bf16=True (accelerate's bf16 autocast around the model's forward, generate included), "
            "fp32 weights")


BF16_NOT_MATCHED = ("generation precision under --bf16: our engine holds bf16 weights (engine.dtype=bfloat16, the "
                    "engine's own choice), TRL's generate runs under bf16 autocast over the fp32 weights it trains")


def matched_settings(args: argparse.Namespace) -> list[dict]:
    """What is held equal, with the gcore-rl key and the TRL parameter that set it."""
    p, n, m, batch = args.prompts_per_step, args.n, args.max_new_tokens, args.prompts_per_step * args.n
    rows = [
        ("model", "model.path=<same folder> (Qwen2, fp32, sdpa)", "model object from the same folder (fp32, sdpa)"),
        ("prompts per step × group size", f"run.prompts_per_step={p}, sampling.n={n}",
         f"generation_batch_size={batch} (per_device_train_batch_size={batch} × steps_per_generation=1), "
         f"num_generations={n}"),
        ("optimiser steps per generation batch", "train.mini_batches=1, train.ppo_epochs=1",
         "steps_per_generation=1, gradient_accumulation_steps=1, num_iterations=1"),
        ("old log-probs (the PPO ratio's denominator)", "the detached log-probs of the update's own forward (the "
         "single-pass update: no no-grad forward, update/prepare ~0 s)", "the detached current log-probs "
         "(grpo_trainer.py, _generate_and_score_completions / _compute_loss)"),
        ("rows per forward/backward", f"train.micro_batch_size={batch}", f"per_device_train_batch_size={batch}"),
        ("max completion length", f"sampling.max_new_tokens={m}", f"max_completion_length={m}"),
        ("sampling", "sampling.temperature=1.0, top_p=1.0, top_k=0",
         "temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0 (transformers generate)"),
        ("KL / reference model", "algo.kl_coef=0 (no reference)", "beta=0.0 (no ref_model)"),
        ("loss normalisation", "algo.loss_aggregation=token_mean (sum / valid tokens of the step)",
         "loss_type='dapo' (sum / num_items_in_batch = valid tokens of the generation batch; equal to 'bnpo' here)"),
        ("advantage scaling", "algo.scale_rewards=true (÷ group std)", "scale_rewards='group'"),
        ("PPO clip", "algo.clip_low=0.2, algo.clip_high=0.2", "epsilon=0.2, epsilon_high=0.2, delta=None"),
        ("truncated completions", "trained on (no masking)", "mask_truncated_completions=False"),
        ("entropy bonus", "algo.entropy_coef=0", "entropy_coef=0.0, top_entropy_quantile=1.0"),
        ("optimiser", f"AdamW (torch.optim.AdamW), train.lr={args.lr}, betas (0.9, 0.999), weight_decay 0",
         f"optim='adamw_torch', learning_rate={args.lr}, adam_beta1=0.9, adam_beta2=0.999, weight_decay=0.0"),
        ("LR schedule", "train.warmup_steps=0 (constant)", "lr_scheduler_type='constant', warmup_steps=0"),
        ("gradient clip", "train.grad_clip=1.0", "max_grad_norm=1.0"),
        _precision_row(args),
        ("activation checkpointing", "none", "gradient_checkpointing=False (TRL's default is True)"),
        ("reward", f"reward.rules=[{REWARD_FN}], reward.accuracy_fn=null",
         "reward_funcs=[exact_match_reward] (calls the same function)"),
        ("logging / saving / eval", "run.progress=false, run.eval_every=0, run.save_final=false",
         "report_to='none', logging_strategy='no', save_strategy='no', eval_strategy='no', disable_tqdm=True, "
         "log_completions=False"),
        ("models on the device", "runtime.time_share=false: the engine stays resident through the update (no "
         "sleep/wake; the sync copies the new weights into it, and its CUDA graphs are captured once)",
         "one model, generating and training (no swap)"),
        ("processes / threads", f"runtime.kind=local, controllers=1, threads_per_process={args.threads}",
         f"one process, torch.set_num_threads({args.threads}), dataloader_num_workers=0"),
        ("data order", "data.shuffle=true, run.seed=0", "shuffle_dataset=True (RepeatSampler), seed=0"),
    ]
    return [{"setting": s, "gcore": g, "trl": t} for s, g, t in rows]


# ----------------------------------------------------------------------------------------------
# TRL side (runs in the benchmark venv, in a fresh process per repeat)
# ----------------------------------------------------------------------------------------------


def _trl_worker(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    cuda = spec.get("device") == "cuda"

    def sync() -> None:
        if cuda:  # the step's (generation's) kernels finish inside its timed span
            torch.cuda.synchronize()

    import accelerate
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.utils.logging.set_verbosity_error()
    datasets.utils.disable_progress_bars()
    tokenizer = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"], local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    dataset = datasets.load_dataset("json", data_files=spec["prompts"], split="train",
                                    cache_dir=str(Path(spec["output_dir"]).parent / "hf-datasets-cache"))
    config = GRPOConfig(output_dir=spec["output_dir"], max_steps=spec["steps"], **spec["trl_config"])

    step_seconds: list[float] = []
    step_ends: list[float] = []
    threads_seen: list[int] = []
    generate_seconds: list[float] = []
    gen_score_seconds: list[float] = []
    completion_lengths: list[float] = []
    generated_tokens: list[float] = []
    old_logps_computed: list[bool] = []

    class StepTimer(TrainerCallback):
        """Wall time of each optimiser step (generation included: TRL generates inside the step)."""

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            end = time.perf_counter()
            step_seconds.append(end - self.start)
            step_ends.append(end)
            threads_seen.append(torch.get_num_threads())

    trainer = GRPOTrainer(model=model, reward_funcs=[exact_match_reward], args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimer()])

    generate = trainer._generate_single_turn
    generate_and_score = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        sync()
        start = time.perf_counter()
        try:
            return generate(*a, **k)
        finally:
            sync()
            generate_seconds.append(time.perf_counter() - start)

    def timed_generate_and_score(*a, **k):
        sync()
        start = time.perf_counter()
        out = generate_and_score(*a, **k)
        sync()
        gen_score_seconds.append(time.perf_counter() - start)
        lengths = out["completion_mask"].sum(dim=1).float()
        completion_lengths.append(float(lengths.mean()))
        generated_tokens.append(float(lengths.sum()))
        old_logps_computed.append("old_per_token_logps" in out)
        return out

    trainer._generate_single_turn = timed_generate
    trainer._generate_and_score_completions = timed_generate_and_score

    sample = spec["sample_prompt"]
    started = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - started
    model_device = str(next(trainer.model.parameters()).device)
    if spec.get("device", "cpu") != model_device.split(":")[0]:
        raise RuntimeError(f"TRL trained on {model_device}, not on {spec.get('device', 'cpu')}")
    a = trainer.args
    effective = {key: getattr(a, key) for key in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
        "num_generations", "num_iterations", "max_completion_length", "temperature", "top_p", "top_k", "beta",
        "loss_type", "scale_rewards", "epsilon", "epsilon_high", "mask_truncated_completions", "learning_rate",
        "lr_scheduler_type", "optim", "max_grad_norm", "bf16", "gradient_checkpointing", "use_cpu", "seed")}
    effective = {k: (v if isinstance(v, (int, float, str, bool, type(None))) else str(v)) for k, v in effective.items()}
    return {
        "step_seconds": step_seconds,
        "loop_period_seconds": [b - a_ for a_, b in zip(step_ends, step_ends[1:], strict=False)],
        "generate_seconds": generate_seconds,
        "generate_and_score_seconds": gen_score_seconds,
        "completion_length_mean": completion_lengths,
        "generated_tokens": generated_tokens,
        "old_logps_forward": old_logps_computed,
        "torch_threads": sorted(set(threads_seen)),
        "train_seconds": train_seconds,
        "effective_args": effective,
        "optimizer": f"{type(trainer.optimizer.optimizer if hasattr(trainer.optimizer, 'optimizer') else trainer.optimizer).__name__}",
        "eos_token_ids": trainer.eos_token_ids,
        "prompt_tokens_match_ours": tokenizer(text=[sample])["input_ids"][0] == tokenizer.encode(sample, add_special_tokens=False),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                     "accelerate": accelerate.__version__, "datasets": datasets.__version__},
        "model_device": model_device,
        **({"cuda_peak_allocated_mib": torch.cuda.max_memory_allocated() / 2**20} if cuda else {}),
    }


# ----------------------------------------------------------------------------------------------
# The parent: preparation, subprocesses, aggregation, report
# ----------------------------------------------------------------------------------------------


def _child_env(threads: int) -> dict:
    env = dict(os.environ)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1"})
    return env


def _check(cmd: list[str], env: dict, timeout: float, cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed with exit code {proc.returncode}:\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def _prepare(args: argparse.Namespace, work: Path, env: dict) -> tuple[Path, Path, str]:
    """The model folder (our init-tiny, Qwen2 shape) and the prompt file, built once in the work dir."""
    shape = {k: getattr(args, k) for k in ("hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                           "intermediate_size", "max_positions", "vocab_size")}
    model = work / ("model-qwen2-" + "-".join(f"{v}" for v in shape.values()))
    if not (model / "config.json").is_file():
        _check([*args.gcore_cli, "init-tiny", str(model), "arch=qwen2", "seed=0",
                *(f"{k}={v}" for k, v in shape.items())], env, 300, work)
    prompts = work / f"prompts-addition-{args.num_prompts}.jsonl"
    code = ("import json, sys\nfrom gcore_rl.data.tasks import addition_rows\n"
            "rows = addition_rows(int(sys.argv[2]), seed=0)\n"
            "open(sys.argv[1], 'w').write(''.join(json.dumps({'prompt': r['prompt'], 'answer': r['answer']}) + '\\n'"
            " for r in rows))\nprint(rows[0]['prompt'])\n")
    sample = _check([str(args.python), "-c", code, str(prompts), str(args.num_prompts)], env, 120, work).stdout.strip()
    return model, prompts, sample


def _cpu_busy_seconds() -> float | None:
    """CPU-seconds all processes of the machine have been busy (``/proc/stat``; None where unavailable)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _wait_for_quiet(threshold: float, max_wait: float) -> tuple[float, float | None]:
    """Wait (at most `max_wait` s) until other processes use < `threshold` cores over 2 s; (waited s, last reading)."""
    start = time.perf_counter()
    reading = None
    while True:
        before = _cpu_busy_seconds()
        time.sleep(2.0)
        after = _cpu_busy_seconds()
        if before is None or after is None:
            return time.perf_counter() - start, None
        reading = (after - before) / 2.0
        if reading < threshold or time.perf_counter() - start >= max_wait:
            return time.perf_counter() - start, reading
        time.sleep(8.0)


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _run_gcore(args: argparse.Namespace, recipe: Path, out_dir: Path, env: dict, work: Path) -> dict:
    _check([*args.gcore_cli, "train", str(recipe), f"run.output_dir={out_dir}", *args.gcore_set], env, args.timeout, work)
    lines = _read_jsonl(out_dir / "metrics.jsonl")
    cuda_peaks = [line.get("memory/cuda_peak_allocated_mib_max") for line in lines]
    if args.device == "cuda" and None in cuda_peaks:  # written by a device worker on CUDA only
        raise RuntimeError(f"gcore-rl did not run on CUDA (no memory/cuda_peak_allocated_mib_max in {out_dir})")
    events: dict[tuple[str, int, str], float] = {}
    for source in ("device", "controller"):
        for event in _read_jsonl(out_dir / "timeline" / f"{source}-0.jsonl"):
            key = (source, event["step"], event["what"])
            events[key] = events.get(key, 0.0) + event["end"] - event["start"]
    steps = [line["step"] for line in lines]
    return {
        "step_seconds": [line["time/step"] for line in lines],
        "loop_period_seconds": [b["time"] - a["time"] for a, b in zip(lines, lines[1:], strict=False)],
        "phase_seconds": {name: [sum(events.get((source, step, what), 0.0) for what in whats) for step in steps]
                          for name, (source, whats) in OUR_PHASES.items()},
        "completion_length_mean": [line["response_length/mean"] for line in lines],
        "generated_tokens": [line["rollout/generated_tokens"] for line in lines],
        "truncated_fraction": [line["response/truncated_fraction"] for line in lines],
        "samples_per_step": [line["reward/count"] for line in lines],
        # only on CUDA: the device worker's peak allocated CUDA memory (max over the steps)
        **({"cuda_peak_allocated_mib": max(cuda_peaks)} if args.device == "cuda" else {}),
    }


def _run_trl(args: argparse.Namespace, spec: dict, env: dict, work: Path) -> dict:
    proc = _check([str(args.python), str(Path(__file__).resolve()), "--trl-worker", json.dumps(spec)], env,
                  args.timeout, work)
    results = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if not results:
        raise RuntimeError(f"TRL worker printed no result:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(results[-1][len(RESULT_MARKER):])


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _summarise(name: str, runs: list[dict], batch: int) -> dict:
    """Step 1 of every run is dropped; medians over the kept steps of all runs pooled."""
    kept = [s for run in runs for s in run["step_seconds"][1:]]
    step = _median(kept)
    tokens = _mean([t for run in runs for t in run["generated_tokens"][1:]])
    summary = {
        "side": name,
        "repeats": len(runs),
        "kept_steps": len(kept),
        "median_step_s": step,
        "samples_per_s": batch / step,
        "mean_completion_length": _mean([x for run in runs for x in run["completion_length_mean"][1:]]),
        "mean_generated_tokens_per_step": tokens,
        "tokens_per_s": tokens / step,
        "per_repeat_median_step_s": [_median(run["step_seconds"][1:]) for run in runs],
        "per_repeat_samples_per_s": [batch / _median(run["step_seconds"][1:]) for run in runs],
        "median_loop_period_s": _median([x for run in runs for x in run["loop_period_seconds"]]),
        "step_s_min_max": [min(kept), max(kept)],
        "other_cpu_cores_per_repeat": [run.get("other_cpu_cores") for run in runs],
    }
    if any("cuda_peak_allocated_mib" in run for run in runs):
        summary["cuda_peak_allocated_mib_per_repeat"] = [run.get("cuda_peak_allocated_mib") for run in runs]
    if name == "gcore-rl":
        phases = {p: _median([x for run in runs for x in run["phase_seconds"][p][1:]]) for p in OUR_PHASES}
        summary["median_phase_s"] = {**phases, "other": step - sum(phases.values())}
        summary["truncated_fraction"] = _mean([x for run in runs for x in run["truncated_fraction"][1:]])
    else:
        generate = _median([x for run in runs for x in run["generate_seconds"][1:]])
        gen_score = _median([x for run in runs for x in run["generate_and_score_seconds"][1:]])
        summary["median_phase_s"] = {"generate (model.generate)": generate,
                                     "decode + reward + advantages": gen_score - generate,
                                     "forward/backward + optimizer + rest": step - gen_score}
        summary["old_logps_forward"] = any(any(run["old_logps_forward"]) for run in runs)
        summary["torch_threads"] = sorted({t for run in runs for t in run["torch_threads"]})
    return summary


def _fmt(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _report(ours: dict, theirs: dict, ratios: dict) -> str:
    lines = [
        "| side | median step (s) | samples/s | mean completion length (tokens) | tokens/s | per-repeat median step (s) "
        "| step min–max (s) | median loop period (s) | other processes' CPU per repeat (cores) |",
        "|---|--:|--:|--:|--:|---|---|--:|---|",
    ]
    for s in (ours, theirs):
        lines.append(
            f"| {s['side']} | {_fmt(s['median_step_s'], 3)} | {_fmt(s['samples_per_s'], 1)} "
            f"| {_fmt(s['mean_completion_length'], 1)} | {_fmt(s['tokens_per_s'], 0)} "
            f"| {', '.join(_fmt(v, 3) for v in s['per_repeat_median_step_s'])} "
            f"| {_fmt(s['step_s_min_max'][0], 3)}–{_fmt(s['step_s_min_max'][1], 3)} "
            f"| {_fmt(s['median_loop_period_s'], 3)} "
            f"| {', '.join(_fmt(v) for v in s['other_cpu_cores_per_repeat'])} |")
    lines.append("")
    lines.append(f"Ratio gcore-rl / TRL of samples/s: **{ratios['pooled']:.2f}×** (pooled medians); median of the "
                 f"per-repeat ratios {ratios['median_of_pairs']:.2f}× (pairs: "
                 f"{', '.join(f'{r:.2f}' for r in ratios['per_pair'])}).")
    lines.append("")
    lines.append("| side | phase | median (s) | share of median step |")
    lines.append("|---|---|--:|--:|")
    for s in (ours, theirs):
        for phase, value in s["median_phase_s"].items():
            lines.append(f"| {s['side']} | {phase} | {_fmt(value, 3)} | {100 * value / s['median_step_s']:.0f}% |")
    return "\n".join(lines)


def _machine() -> dict:
    cpu = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return {"cpu_model": cpu, "cpu_count": os.cpu_count(), "mem_total_gib": mem, "machine": platform.machine(),
            "system": platform.platform(), "python_parent": sys.version.split()[0]}


def _device_info(args: argparse.Namespace, env: dict, work: Path) -> dict:
    """Where both sides ran: {"type": "cpu"}, or the GPU the children see first (name, memory, CUDA version)."""
    if args.device != "cuda":
        return {"type": "cpu"}
    code = ("import json, torch\n"
            "p = torch.cuda.get_device_properties(0)\n"
            "print(json.dumps({'type': 'cuda', 'gpu_name': torch.cuda.get_device_name(0), "
            "'gpu_count_visible': torch.cuda.device_count(), 'gpu_memory_gib': round(p.total_memory / 2**30, 1), "
            "'capability': '.'.join(map(str, torch.cuda.get_device_capability(0))), "
            "'cuda_runtime': torch.version.cuda}))")
    return json.loads(_check([str(args.python), "-c", code], env, 120, work).stdout.strip().splitlines()[-1])


def _versions(python: Path, env: dict, work: Path) -> dict:
    code = ("import json, sys, torch, transformers, trl, accelerate, datasets, tokenizers\n"
            "print(json.dumps({'python': sys.version.split()[0], 'torch': torch.__version__, "
            "'transformers': transformers.__version__, 'trl': trl.__version__, 'accelerate': accelerate.__version__, "
            "'datasets': datasets.__version__, 'tokenizers': tokenizers.__version__}))")
    return json.loads(_check([str(python), "-c", code], env, 120, work).stdout.strip().splitlines()[-1])


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    d = DEFAULTS
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: 1 repeat, 3 steps, 4 prompts × 4, 16 new tokens, a 2-layer width-64 model "
                             "(explicit options still win)")
    parser.add_argument("--repeats", type=int, help=f"fresh runs per side, interleaved A,B,A,B (default: {d['repeats']})")
    parser.add_argument("--steps", type=int, help=f"optimiser steps per run; step 1 is dropped (default: {d['steps']})")
    parser.add_argument("--prompts-per-step", type=int, help=f"prompts P per step (default: {d['prompts_per_step']})")
    parser.add_argument("--n", type=int, help=f"samples per prompt, the group size (default: {d['n']})")
    parser.add_argument("--max-new-tokens", type=int, help=f"max completion length (default: {d['max_new_tokens']})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both sides run: cpu, or cuda (one GPU; fp32 on both sides unless --bf16) "
                             "(default: %(default)s)")
    parser.add_argument("--bf16", action="store_true",
                        help="bf16 autocast on both sides (ours: train.bf16 and a bf16 engine; TRL: bf16=True) instead "
                             "of fp32; meant for a GPU (a CPU without native bf16 emulates it)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-5, help="learning rate on both sides (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=1024, help="rows in the prompt file (default: %(default)s)")
    for key, help_text in (("hidden_size", "model width"), ("num_layers", "decoder layers"),
                           ("num_heads", "attention heads"), ("num_kv_heads", "key/value heads"),
                           ("intermediate_size", "MLP width"), ("max_positions", "max positions")):
        parser.add_argument("--" + key.replace("_", "-"), type=int, help=f"{help_text} (default: {d[key]})")
    parser.add_argument("--gcore-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a gcore-rl config override on top of the matched recipe, for options TRL has no "
                             "counterpart of and that leave the update unchanged (e.g. train.packing=true, "
                             "train.max_tokens_per_micro_batch=N); repeatable, recorded in the JSON")
    parser.add_argument("--vocab-size", type=int, default=0,
                        help="embedding rows, 0 = the character tokenizer's 99 (default: %(default)s)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="scratch directory for the model, prompts and run outputs (default: a new temp dir)")
    parser.add_argument("--out", type=Path, default=None, help="write settings, raw runs and summaries to this JSON")
    parser.add_argument("--python", type=Path, default=REPO / ".venv-bench" / "bin" / "python",
                        help="interpreter with gcore-rl and trl installed; its bin/gcore-rl runs our side "
                             "(default: .venv-bench/bin/python)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per run (default: %(default)s)")
    parser.add_argument("--quiet-threshold", type=float, default=0.3,
                        help="before each run, wait until other processes use fewer than this many cores "
                             "(measured over 2 s from /proc/stat) (default: %(default)s)")
    parser.add_argument("--quiet-wait", type=float, default=300,
                        help="longest wait for a quiet machine before each run, then run anyway; 0 = never wait "
                             "(default: %(default)s)")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_worker is not None:
        return args
    base = QUICK if args.quick else DEFAULTS
    for key, value in base.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.repeats < 1 or args.steps < 2:
        parser.error("need --repeats >= 1 and --steps >= 2 (step 1 of every run is dropped)")
    if args.n < 2:
        parser.error("GRPO needs --n >= 2")
    if not args.python.is_file() and os.sep not in str(args.python) and shutil.which(str(args.python)):
        args.python = Path(shutil.which(str(args.python)))  # a name on PATH, e.g. --python python3
    if not args.python.is_file():
        parser.error(f"{args.python} not found; create the benchmark environment with `bash benchmarks/bench_env.sh`")
    args.python = args.python.absolute()  # keep the venv's bin/ path (do not resolve the interpreter symlink)
    script = args.python.parent / "gcore-rl"
    # the venv's console script, else the CLI module through this interpreter (gcore-rl importable, e.g. PYTHONPATH)
    args.gcore_cli = [str(script)] if script.is_file() else [str(args.python), "-m", "gcore_rl.cli"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.trl_worker is not None:
        print(RESULT_MARKER + json.dumps(_trl_worker(json.loads(args.trl_worker))), flush=True)
        return 0
    started = time.perf_counter()
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="grpo-vs-trl-"))).absolute()
    work.mkdir(parents=True, exist_ok=True)
    env = _child_env(args.threads)
    model, prompts, sample = _prepare(args, work, env)
    device = _device_info(args, env, work)  # fails here, before any run, where the children see no GPU
    recipe = work / "gcore_recipe.yaml"
    recipe.write_text(json.dumps(_gcore_recipe(args, model, prompts), indent=2) + "\n")  # JSON is valid YAML
    trl_config = _trl_config(args)
    batch = args.prompts_per_step * args.n
    raw: dict[str, list[dict]] = {"gcore-rl": [], "TRL": []}
    versions = _versions(args.python, env, work)
    tag = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    for repeat in range(args.repeats):
        for side in ("gcore-rl", "TRL"):  # interleaved, so drift on the machine hits both sides alike
            waited, quiet = _wait_for_quiet(args.quiet_threshold, args.quiet_wait) if args.quiet_wait > 0 else (0.0, None)
            t0, load_before = time.perf_counter(), os.getloadavg()[0]
            busy0, child0 = _cpu_busy_seconds(), _children_cpu_seconds()
            out_dir = work / f"{'gcore' if side == 'gcore-rl' else 'trl'}-r{repeat}-{tag}"
            if side == "gcore-rl":
                result = _run_gcore(args, recipe, out_dir, env, work)
            else:
                spec = {"model": str(model), "prompts": str(prompts), "output_dir": str(out_dir), "steps": args.steps,
                        "threads": args.threads, "trl_config": trl_config, "sample_prompt": sample,
                        "device": args.device}
                result = _run_trl(args, spec, env, work)
            result["run_wall_s"] = time.perf_counter() - t0
            busy1, child1 = _cpu_busy_seconds(), _children_cpu_seconds()
            result["load_average_1min"] = [load_before, os.getloadavg()[0]]
            # CPU used on the machine during the run by everything except this run's own process (cores, mean)
            result["other_cpu_cores"] = (None if busy0 is None or busy1 is None else
                                         max(busy1 - busy0 - (child1 - child0), 0.0) / result["run_wall_s"])
            result["quiet_wait_s"], result["other_cpu_cores_before"] = waited, quiet
            raw[side].append(result)
            print(f"[repeat {repeat + 1}/{args.repeats}] {side}: median step {_median(result['step_seconds'][1:]):.3f} s, "
                  f"mean completion {_mean(result['completion_length_mean'][1:]):.1f} tokens "
                  f"({result['run_wall_s']:.0f} s; other processes {_fmt(result['other_cpu_cores'])} cores during "
                  f"the run, {_fmt(quiet)} before it after waiting {waited:.0f} s)", file=sys.stderr, flush=True)
        # after every pair, so that a run cut short by a time limit leaves the pairs it finished
        ours, theirs, ratios = _compare(raw, batch)
        wall = time.perf_counter() - started
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            settings = {k: (str(v) if isinstance(v, Path) else " ".join(v) if isinstance(v, list) else v)
                        for k, v in vars(args).items() if k != "trl_worker"}
            args.out.write_text(json.dumps({
                "settings": settings, "matched_settings": matched_settings(args),
                "not_matched": NOT_MATCHED + ([BF16_NOT_MATCHED] if args.bf16 else []),
                "gcore_recipe": _gcore_recipe(args, model, prompts), "trl_config": trl_config,
                "trl_effective_args": raw["TRL"][0]["effective_args"], "machine": _machine(), "device": device,
                "versions": versions, "pairs_done": repeat + 1,
                "wall_seconds": wall, "summaries": {"gcore-rl": ours, "TRL": theirs}, "ratio_samples_per_s": ratios,
                "runs": raw}, indent=2))
    loads = [x for runs in raw.values() for r in runs for x in r["load_average_1min"]]
    other = [r["other_cpu_cores"] for runs in raw.values() for r in runs if r["other_cpu_cores"] is not None]
    print(f"GRPO step, {args.prompts_per_step} prompts × {args.n} samples = {batch} samples/step, "
          f"max {args.max_new_tokens} new tokens, Qwen2 shape hidden={args.hidden_size} layers={args.num_layers} "
          f"heads={args.num_heads}/{args.num_kv_heads} mlp={args.intermediate_size}, {args.threads} torch threads, "
          f"device {args.device}"
          f"{' (' + device['gpu_name'] + ')' if device.get('gpu_name') else ''}, {'bf16 autocast' if args.bf16 else 'fp32'}; "
          f"{args.repeats} repeat(s) × {args.steps} steps per side, step 1 of each run dropped.\n")
    print(_report(ours, theirs, ratios))
    print(f"\nTRL computed old log-probs in a separate forward: {theirs['old_logps_forward']} (ours does only when an "
          f"update takes several optimiser steps: update/prepare); TRL torch threads seen: {theirs['torch_threads']}. Versions: "
          + ", ".join(f"{k} {v}" for k, v in versions.items())
          + f". CPU: {_machine()['cpu_model']} ({os.cpu_count()} cores); 1-min load average {min(loads):.1f}–"
          f"{max(loads):.1f}; CPU used by other processes during the runs "
          f"{_fmt(min(other) if other else None)}–{_fmt(max(other) if other else None)} cores. Total wall time {wall:.0f} s.")
    return 0


def _compare(raw: dict[str, list[dict]], batch: int) -> tuple[dict, dict, dict]:
    """Both sides' summaries over the runs so far and the ratios of their samples/s (pooled; per pair; median)."""
    ours, theirs = _summarise("gcore-rl", raw["gcore-rl"], batch), _summarise("TRL", raw["TRL"], batch)
    per_pair = [a / b for a, b in zip(ours["per_repeat_samples_per_s"], theirs["per_repeat_samples_per_s"], strict=True)]
    return ours, theirs, {"pooled": ours["samples_per_s"] / theirs["samples_per_s"], "per_pair": per_pair,
                          "median_of_pairs": statistics.median(per_pair)}


if __name__ == "__main__":
    sys.exit(main())
