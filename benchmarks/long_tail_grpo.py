"""GRPO on a long-tailed task (issue 21): the real `gcore-rl train` loop with fixed-count passes, token-budget
passes and packed passes, same model, same steps, and the same rewards.

**Question.** `benchmarks/long_tail.py` times one update on a synthetic batch. Does the same hold in a run
of the whole loop, where the engine produces the lengths and the update follows them, and do the options
leave the run itself unchanged?

**Setup.** One init-tiny model (`long_tail.MODEL` with 1,100 positions: hidden 256, 4 layers, fp32, SDPA).
Task `reversal` with strings of 8..512 characters (uniform), so prompts span two orders of magnitude; the
random model stops at its end-of-sequence token about once in a hundred tokens, so completions are
long-tailed up to `sampling.max_new_tokens=512` (mean about 80). Reward: the fraction of characters in
place (`digit_accuracy`, 0.5) plus exact match (0.5); 16 prompts × 4 samples a step, no dynamic sampling,
one optimiser step per step (`mini_batches=1`), lr 1e-4, seed 0, local runtime, `--threads` torch threads.
Arms (each a fresh `gcore-rl train` process per repeat, arms interleaved):

* `fixed8`: `train.micro_batch_size=8` (runs of 8 rows, each cropped to its rows' columns);
* `budget`: `train.micro_batch_size=64 train.max_tokens_per_micro_batch=--budget` (first-fit decreasing);
* `packed`: `budget` plus `train.packing=true`.

Per arm: the update's seconds per step (timeline event `update/train`, the trainer's forward, backward and
optimiser step; `update/prepare` is 0: one optimiser step per batch takes its old log-probs from the
update's own forward), trained tokens per second of it (`work/actor/tokens`, the prompt + completion
tokens of the step's rows, over the update's seconds, median over steps), the rollout's seconds, and the worker's peak RSS
(`memory/worker_peak_rss_mib_max`). Step 1 is dropped from the timings (warm-up). Equality: every step's
`reward/mean` and `response_length/mean` must be the same in every arm (the engine's samples depend on the
weights, so equal rewards at every step say the updates agreed to the last bit that sampling can see), and
the last step's policy loss, approximate KL, entropy and gradient norm are listed side by side.

    .venv/bin/python benchmarks/long_tail_grpo.py --out bench-results/long_tail_grpo.json     # ~6 min
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from long_tail import MODEL, machine  # noqa: E402  (the same model shape)

ARMS = {"fixed8": ["train.micro_batch_size=8"],
        "budget": ["train.micro_batch_size=64", "train.max_tokens_per_micro_batch={budget}"],
        "packed": ["train.micro_batch_size=64", "train.max_tokens_per_micro_batch={budget}", "train.packing=true"]}


def recipe(args: argparse.Namespace, model: Path) -> dict:
    return {
        "run": {"steps": args.steps, "prompts_per_step": 16, "seed": 0, "eval_every": 0, "save_final": False,
                "progress": False, "stop_at_eval_accuracy": 0},
        "model": {"path": str(model), "dtype": "float32", "attn_implementation": "sdpa"},
        "data": {"task": "reversal", "task_options": {"min_len": 8, "max_len": 512}, "num_prompts": 512,
                 "eval_prompts": 0},
        "sampling": {"n": 4, "max_new_tokens": 512, "temperature": 1.0},
        "reward": {"rules": [{"fn": "gcore_rl.rewards.builtin:digit_accuracy", "weight": 0.5},
                             {"fn": "gcore_rl.rewards.builtin:exact_match", "weight": 0.5}]},
        "dynamic_sampling": {"enabled": False},
        "train": {"lr": 1e-4, "mini_batches": 1},
        "runtime": {"kind": "local", "threads_per_process": args.threads},
    }


def run_arm(args: argparse.Namespace, arm: str, repeat: int, work: Path) -> dict:
    out = work / f"{arm}-{repeat}"
    if out.exists():  # a scratch run of an earlier invocation with the same --work-dir
        shutil.rmtree(out)
    overrides = [o.format(budget=args.budget) for o in ARMS[arm]]
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gcore_rl.cli", "train", str(work / "recipe.yaml"),
                           f"run.output_dir={out}", *overrides], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} repeat {repeat} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    events: dict[tuple[int, str], float] = {}
    for line in (out / "timeline" / "device-0.jsonl").read_text().splitlines():
        event = json.loads(line)
        events[(event["step"], event["what"])] = events.get((event["step"], event["what"]), 0.0) + event["end"] - event["start"]
    steps = [line["step"] for line in lines]
    return {"arm": arm, "repeat": repeat, "overrides": overrides, "wall_s": time.perf_counter() - started,
            "reward_mean": [line["reward/mean"] for line in lines],
            "response_length_mean": [line["response_length/mean"] for line in lines],
            "rows": [line["reward/count"] for line in lines],
            "update_s": [events.get((s, "update/train"), 0.0) for s in steps],
            "prepare_s": [events.get((s, "update/prepare"), 0.0) for s in steps],
            "rollout_s": [events.get((s, "rollout/generate"), 0.0) for s in steps],
            "step_s": [line["time/step"] for line in lines],
            "peak_rss_mib": max(line.get("memory/worker_peak_rss_mib_max", 0.0) for line in lines),
            "trained_tokens": [line["work/actor/tokens"] for line in lines],
            "last": {k: lines[-1].get(k) for k in ("pg_loss", "approx_kl", "entropy", "grad_norm")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget", type=int, default=4096, help="train.max_tokens_per_micro_batch of budget and packed")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--arms", nargs="*", default=list(ARMS))
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="long-tail-grpo-"))
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "config.json").exists():
        shape = [m for m in MODEL if not m.startswith("max_positions=")] + ["max_positions=1100"]
        subprocess.run([sys.executable, "-m", "gcore_rl.cli", "init-tiny", str(model), *shape], cwd=REPO, check=True,
                       capture_output=True)
    (work / "recipe.yaml").write_text(json.dumps(recipe(args, model), indent=2) + "\n")  # JSON is valid YAML
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    for repeat in range(args.repeats):
        for arm in args.arms:
            r = run_arm(args, arm, repeat, work)
            runs[arm].append(r)
            print(f"repeat {repeat} {arm}: update {statistics.median(r['update_s'][1:]):.2f} s/step, rewards "
                  f"{[round(x, 4) for x in r['reward_mean']]}, peak RSS {r['peak_rss_mib']:.0f} MiB", flush=True)
    base = runs[args.arms[0]][0]
    same = {arm: all(r["reward_mean"] == base["reward_mean"] and r["response_length_mean"] == base["response_length_mean"]
                     for r in rs) for arm, rs in runs.items()}
    print("\n| arm | update s/step (median) | trained tok/s | update × fixed8 | rollout s/step | peak RSS MiB | "
          "same rewards and lengths every step | last step's pg loss / approx KL / entropy / grad norm |")
    print("|---|--:|--:|--:|--:|--:|---|---|")
    summary = {}
    for arm, rs in runs.items():
        update = statistics.median(u for r in rs for u in r["update_s"][1:])
        tokens = statistics.median(t / u for r in rs for t, u in zip(r["trained_tokens"][1:], r["update_s"][1:], strict=True))
        summary[arm] = {"update_s": update, "rollout_s": statistics.median(u for r in rs for u in r["rollout_s"][1:]),
                        "peak_rss_mib": statistics.median(r["peak_rss_mib"] for r in rs), "same": same[arm],
                        "trained_tokens_per_s": tokens, "last": rs[0]["last"]}
    for arm, s in summary.items():
        last = s["last"]
        print(f"| {arm} | {s['update_s']:.2f} | {s['trained_tokens_per_s']:,.0f} | "
              f"{summary[args.arms[0]]['update_s'] / s['update_s']:.2f} | {s['rollout_s']:.2f} | {s['peak_rss_mib']:.0f} | "
              f"{'yes' if s['same'] else 'NO'} | {last['pg_loss']:.6f} / {last['approx_kl']:.2e} / {last['entropy']:.4f} / "
              f"{last['grad_norm']:.4f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "machine": machine(), "recipe": recipe(args, model),
                                              "summary": summary, "runs": runs}, indent=2))
    if not all(same.values()):
        raise SystemExit("the arms' rewards or completion lengths differ: the options changed the run, not only its speed")


if __name__ == "__main__":
    main()
