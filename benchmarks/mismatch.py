"""Rollout/trainer mismatch on CPU: GRPO from the demo's warm start with a deliberately perturbed engine,
without and with the importance-sampling correction (`algo.mismatch_correction`).

The perturbation (`engine.logit_noise_std=σ`): the engine adds fresh N(0, σ²) noise to every logit
before it samples a token and reports the log-prob of that noisy distribution, so it samples from
μ ≠ π, as a bf16 engine or another kernel does, only much more. The trainer's log-probs are exact.
The uncorrected baseline is what this project does by default (`mismatch_correction=none`): the
PPO ratio of fresh rows is taken against the trainer's recomputed log-probs and the engine's are
ignored, so the policy gradient is taken on μ's samples as if π had drawn them (stale rows, the
surplus groups dynamic sampling keeps for the next step, take it against the engine's). The corrected arms weight each token
by the capped ratio π_old/μ (`tis`) or drop tokens/sequences outside [1/C, C] (`mis`).

Every arm of a seed starts from the same warm start and draws prompts in the same order; evaluation is greedy,
which the noise does not touch, so it measures the trained policy itself.

    .venv/bin/python benchmarks/mismatch.py --warm-start runs/tiny-sft --probe 0 0.25 0.5 1.0   # choose σ
    .venv/bin/python benchmarks/mismatch.py --warm-start runs/tiny-sft --probe 0 --probe-engine-dtype bfloat16
    .venv/bin/python benchmarks/mismatch.py --warm-start runs/tiny-sft --noise-std 0 --arms none --out clean.json
    .venv/bin/python benchmarks/mismatch.py --warm-start runs/tiny-sft --arms none tis mis-sequence \\
        --reference clean.json --out docs/figures/mismatch-correction.json --plot docs/figures/mismatch-correction.png

Without `--warm-start` it builds one first (`init-tiny` + `sft recipes/sft_addition.yaml`, as `make demo`).
A run whose folder under `--work-dir` is complete is reused, not run again. Results: docs/algorithms.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import _run as _gcore_rl  # noqa: E402  (runs `gcore-rl ARGS` in a folder, returns its wall time)

REPO = Path(__file__).resolve().parents[1]
SFT_RECIPE = REPO / "recipes" / "sft_addition.yaml"
GRPO_RECIPE = REPO / "recipes" / "grpo_addition.yaml"
ARMS = {"none": [], "tis": ["algo.mismatch_correction=tis"], "mis-token": ["algo.mismatch_correction=mis"],
        "mis-sequence": ["algo.mismatch_correction=mis", "algo.mismatch_level=sequence"],
        "tis-sequence": ["algo.mismatch_correction=tis", "algo.mismatch_level=sequence"]}
"""Arms by name: their overrides (the cap stays at its default, C = 2, Yao et al.'s value)."""


def build_warm_start(work: Path, threads: int) -> Path:
    """The demo's warm start (`make demo`'s first two commands) in `work`."""
    _gcore_rl(["init-tiny", "base"], work)
    _gcore_rl(["sft", str(SFT_RECIPE), "model.path=base", "output_dir=sft", f"threads={threads}", "progress=false"], work)
    return work / "sft"


MEASURED_WITH = ("train.lr=0.0005", "train.warmup_steps=0")
"""The recipe's optimiser when the figures of docs/algorithms.md were measured (it has a warm-up since 2026-11-28)."""


def _train(arm: str, seed: int, args: argparse.Namespace, warm: Path, out: Path) -> float:
    """`gcore-rl train` of one arm and seed into `out`; returns its wall time."""
    return _gcore_rl(["train", str(GRPO_RECIPE), f"model.path={warm.resolve()}", f"run.output_dir={out}",
                      f"run.seed={seed}", f"run.steps={args.steps}", "run.stop_at_eval_accuracy=0",
                      f"run.eval_every={args.eval_every}", "run.save_final=false", "run.progress=false",
                      f"engine.logit_noise_std={args.noise_std}", f"runtime.threads_per_process={args.threads}",
                      *MEASURED_WITH, *ARMS[arm]], REPO)


def run_arm(arm: str, seed: int, args: argparse.Namespace, warm: Path, work: Path) -> dict:
    """One GRPO run; returns its eval curve, sampled accuracy and mismatch metrics per step."""
    out = work / f"{arm}-seed{seed}"
    timing = out / "bench_seconds.txt"
    if timing.exists():  # finished by an earlier invocation with the same work dir: reuse it
        seconds = float(timing.read_text())
    else:
        seconds = _train(arm, seed, args, warm, out)
        timing.write_text(f"{seconds}\n")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    evals = [(0, summary["eval_accuracy_before"])] + [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]

    def series(key: str) -> list[float]:
        return [r[key] for r in rows if key in r]

    return {"arm": arm, "seed": seed, "eval": evals, "final_eval": evals[-1][1], "seconds": seconds,
            "sampled_accuracy": series("accuracy"), "mismatch_kl_k3": series("mismatch/kl_k3"),
            "mismatch_ratio_max": series("mismatch/ratio_max"), "truncated_fraction": series("mismatch/truncated_fraction"),
            "masked_fraction": series("mismatch/masked_fraction")}


def probe(warm: Path, stds: list[float], engine_dtype: str = "float32") -> None:
    """Generation only, before any training: sampled exact-match accuracy and KL(μ‖π) per token of the warm
    start for each noise std (64 held-out-style prompts × 8 samples), to choose σ. With `engine_dtype`
    bfloat16 the engine runs a bf16 copy of the model against the fp32 trainer (the issue's other
    perturbation; σ = 0 gives its mismatch alone)."""
    import torch

    from gcore_rl.algos.mismatch import mismatch_weights
    from gcore_rl.data.tasks import addition_rows
    from gcore_rl.models.loading import load_causal_lm, load_tokenizer
    from gcore_rl.records import build_token_batch
    from gcore_rl.rollout.engine import GenerationEngine
    from gcore_rl.rollout.sampling import SamplingConfig
    from gcore_rl.training.logprobs import token_logprobs

    tokenizer = load_tokenizer(warm)
    rows = addition_rows(64, seed=123, digits=2, reverse=1)
    prompts = [tokenizer.encode(row["prompt"], add_special_tokens=False) for row in rows]
    for std in stds:
        model = load_causal_lm(warm)
        engine_model = model if engine_dtype == "float32" else load_causal_lm(warm, engine_dtype)
        engine = GenerationEngine(engine_model, tokenizer.eos_token_id, tokenizer.pad_token_id, logit_noise_std=std)
        completions = engine.generate(prompts, SamplingConfig(n=8, max_new_tokens=6), seed=0)
        texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
        right = sum(text.strip() == rows[c.prompt_index]["answer"] for c, text in zip(completions, texts, strict=True))
        batch = build_token_batch(completions, tokenizer.pad_token_id)
        with torch.no_grad():
            trainer, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)
        _, stats = mismatch_weights(trainer, batch.rollout_logprobs, batch.response_mask, "tis", "token", 2.0)
        print(f"σ={std}, {engine_dtype} engine: sampled accuracy {right / len(completions):.3f}, KL k3 {stats.kl_k3:.4f}, "
              f"k1 {stats.kl_k1:.4f}, ratio max {stats.ratio_max:.2f}", flush=True)


def plot(runs: list[dict], path: Path, title: str, reference: list[dict] = ()) -> None:
    """Held-out greedy accuracy against step, one line per run, a colour per arm; mismatch KL beside it.
    `reference` runs (another invocation's, e.g. without noise) are drawn grey and dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps, acc = zip(*run["eval"], strict=True)
        left.plot(steps, acc, color=colours[run["arm"]], marker="o", ms=3, alpha=0.8,
                  label=run["arm"] if run["seed"] == runs[0]["seed"] else None)
        right.plot(range(1, len(run["mismatch_kl_k3"]) + 1), run["mismatch_kl_k3"], color=colours[run["arm"]], alpha=0.6)
    for run in reference:
        steps, acc = zip(*run["eval"], strict=True)
        left.plot(steps, acc, color="grey", ls="--", marker=".", alpha=0.8,
                  label="none, no noise (σ=0)" if run is reference[0] else None)
    left.set(xlabel="GRPO step", ylabel="held-out greedy accuracy (256 prompts)", title=title)
    left.legend(title="correction")
    right.set(xlabel="GRPO step", ylabel="mismatch KL(μ‖π_old), k3 per token", title="engine vs trainer")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def summarise(runs: list[dict], baseline: str = "none") -> dict[str, dict]:
    """Per corrected arm: final accuracy per seed, its gain over the baseline of the same seed, mean and min."""
    final = {(r["arm"], r["seed"]): r["final_eval"] for r in runs}
    out = {}
    for arm in sorted({r["arm"] for r in runs} - {baseline}):
        seeds = sorted(seed for a, seed in final if a == arm and (baseline, seed) in final)
        gains = [final[(arm, s)] - final[(baseline, s)] for s in seeds]
        if gains:
            out[arm] = {"seeds": seeds, "final": [final[(arm, s)] for s in seeds],
                        "baseline_final": [final[(baseline, s)] for s in seeds], "gain": gains,
                        "mean_gain": sum(gains) / len(gains), "min_gain": min(gains)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm-start", default=None, help="SFT model to start from (default: build one, minutes).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=["none", "tis"], choices=list(ARMS))
    parser.add_argument("--steps", type=int, default=40, help="GRPO steps; the comparison is at the last one.")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--noise-std", type=float, default=1.0, help="σ of the engine's logit noise.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run.")
    parser.add_argument("--parallel", type=int, default=2, help="runs at a time.")
    parser.add_argument("--work-dir", default=None, help="Where the runs go (default: a new temporary directory).")
    parser.add_argument("--out", default=None, help="Write the raw figures here as JSON.")
    parser.add_argument("--plot", default=None, help="Write the figure here (PNG).")
    parser.add_argument("--reference", default=None, help="JSON of another invocation (e.g. --noise-std 0 --arms none) "
                        "whose runs the figure shows for comparison.")
    parser.add_argument("--probe", type=float, nargs="+", default=None, metavar="STD",
                        help="Only probe these noise stds on the warm start (no training) and exit.")
    parser.add_argument("--probe-engine-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="--probe: the engine's dtype (the trainer's log-probs are fp32).")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="mismatch-"))
    work.mkdir(parents=True, exist_ok=True)
    warm = Path(args.warm_start) if args.warm_start else build_warm_start(work, args.threads)
    if args.probe:
        probe(warm, args.probe, args.probe_engine_dtype)
        return
    started = datetime.now(timezone.utc)
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        runs = list(pool.map(lambda job: run_arm(job[0], job[1], args, warm, work), jobs))
    for run in runs:
        kl = sum(run["mismatch_kl_k3"]) / len(run["mismatch_kl_k3"])
        print(f"{run['arm']:>13} seed {run['seed']}: eval {run['eval'][0][1]:.3f} -> {run['final_eval']:.3f} "
              f"(step {run['eval'][-1][0]}), mean sampled acc {sum(run['sampled_accuracy']) / len(run['sampled_accuracy']):.3f}, "
              f"mean mismatch KL k3 {kl:.4f}, {run['seconds']:.0f} s", flush=True)
    summary = summarise(runs)
    for arm, s in summary.items():
        print(f"{arm} - none at step {args.steps}: per seed {[round(g, 3) for g in s['gain']]}, "
              f"mean {s['mean_gain']:+.3f}, min {s['min_gain']:+.3f}")
    machine = f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or 'cpu'}, {args.threads} thread(s) per run, {args.parallel} runs at a time"
    print(f"{started:%Y-%m-%d %H:%M} UTC, {machine}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"started": started.isoformat(), "machine": machine, "args": vars(args),
                                              "warm_start": str(warm), "summary": summary, "runs": runs}, indent=2))
    if args.plot:
        reference = json.loads(Path(args.reference).read_text())["runs"] if args.reference else []
        plot(runs, Path(args.plot), f"engine logit noise σ={args.noise_std}, C=2", reference)


if __name__ == "__main__":
    main()
