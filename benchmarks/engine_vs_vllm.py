"""Generation on this CPU: our engine (`engine.backend=builtin`) against vLLM (`engine.backend=vllm`), both
through the `RolloutEngine` contract, on the same saved model, prompts and completion lengths (issue 40).

**Question.** Which backend should a user choose on a CPU, and what does vLLM cost beside generation
(start-up, a weight sync)? On GPUs vLLM is the expected winner (docs/engines.md); here it is measured.

**Setup.** Two models saved by `init-tiny`: `demo` (the demo's shape: llama, hidden 128, 4 layers, the
character tokenizer) and `qwen2-40m` (Qwen2, hidden 512, 8 layers, 8 heads, 2 key/value heads, MLP 1,408,
vocabulary 32,000: 41 M parameters). Requests: random prompts of 8-24 tokens, completion lengths drawn from
a log-normal (median 24, σ 0.8, capped at 160: a long tail), sampled at temperature 1 with `ignore_eos`, so
both sides generate exactly the same number of tokens; batches of 8 and 64 requests, each engine given the
whole batch at once. Each side runs in turn (ours first, then vLLM's server, with `--threads` threads each),
`--repeats` times after one warm-up call; tokens/s and the seconds to the first finished request are
medians. The weight sync is the model's full state as one update (`load_weights`), median of 3, reported
per GB of fp32 weights; vLLM's start-up is the seconds until its server answered. `--grpo-steps N` also
runs `recipes/grpo_addition.yaml` for N steps with each backend from one warm start and reports the median
`time/step` (steps 2..N).

    .venv/bin/python benchmarks/engine_vs_vllm.py --out bench-results/engine_vs_vllm.json    # ~15 min, 2 cores
    .venv/bin/python benchmarks/engine_vs_vllm.py --quick                                    # smoke: demo model, batch 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from engine_vs_generate import machine, make_workload  # noqa: E402  (the same workload and machine record)

from gcore_rl.models.loading import load_tokenizer  # noqa: E402
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model  # noqa: E402
from gcore_rl.rollout.backends import EngineConfig, EngineSource, build_engine  # noqa: E402
from gcore_rl.rollout.sampling import SamplingConfig  # noqa: E402
from gcore_rl.rollout.vllm_server import VllmConfig  # noqa: E402

MODELS = {
    "demo": TinyModelConfig(),
    "qwen2-40m": TinyModelConfig(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=2, intermediate_size=1408,
                                 arch="qwen2", vocab_size=32000, max_positions=512),
}
BACKENDS = ("builtin", "vllm")


def timed_generation(engine, prompts, lengths, repeats: int) -> dict:
    """Tokens/s and seconds to the first finished request over `repeats` calls of the whole batch."""
    params = SamplingConfig(n=1, max_new_tokens=max(lengths), temperature=1.0, ignore_eos=True)
    rates, firsts = [], []
    for repeat in range(repeats + 1):  # the first call warms up
        started = time.perf_counter()
        first, produced = None, 0
        for finished in engine.generate_stream(prompts, params, seed=repeat, max_new_tokens=lengths):
            first = first if first is not None else time.perf_counter() - started
            produced += sum(len(c.token_ids) for c in finished)
        seconds = time.perf_counter() - started
        if produced != sum(lengths):
            raise RuntimeError(f"generated {produced} tokens, expected {sum(lengths)}")
        if repeat:
            rates.append(produced / seconds)
            firsts.append(first)
    return {"tokens_per_s": statistics.median(rates), "first_finished_s": statistics.median(firsts),
            "tokens": sum(lengths)}


def timed_sync(engine, model_dir: Path, repeats: int = 3, warmup: int = 0) -> dict:
    """Seconds of one whole-model update (median of `repeats` after `warmup` untimed ones), and per GB of its fp32
    tensors."""
    from safetensors.torch import load_file

    tensors = [item for file in sorted(model_dir.glob("*.safetensors")) for item in load_file(str(file)).items()]
    gigabytes = sum(t.numel() * t.element_size() for _, t in tensors) / 1e9
    times = []
    for version in range(warmup + repeats):
        started = time.perf_counter()
        engine.load_weights(tensors, final=True, version=version + 1)
        times.append(time.perf_counter() - started)
    seconds = statistics.median(times[warmup:])
    return {"sync_s": seconds, "sync_s_per_gb": seconds / gigabytes, "weights_gb": gigabytes, "all_s": times}


def measure_backend(backend: str, model_dir: Path, batches: list[int], repeats: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    tokenizer = load_tokenizer(model_dir)
    vocab = len(tokenizer)
    source = EngineSource(str(model_dir), torch.device("cpu"), tokenizer.eos_token_id, tokenizer.pad_token_id,
                          "float32", threads=threads)
    started = time.perf_counter()
    engine = build_engine(EngineConfig(backend=backend, max_num_seqs=max(batches), vllm=VllmConfig()), source)
    row = {"backend": backend, "start_s": time.perf_counter() - started, "batches": {}}
    try:
        for batch in batches:
            work = make_workload(batch, vocab, seed=batch, prompt_len=(8, 24), median=24, sigma=0.8, cap=160)
            row["batches"][batch] = timed_generation(engine, work.prompts, work.targets, repeats)
            print(f"  {backend:>7} batch {batch:>3}: {row['batches'][batch]['tokens_per_s']:8.1f} tokens/s, first "
                  f"finished {row['batches'][batch]['first_finished_s']:.2f} s", flush=True)
        row.update(timed_sync(engine, model_dir))
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    return row


def grpo_steps(work: Path, steps: int, threads: int) -> dict:
    """Median `time/step` (steps 2..N) of the demo's GRPO with each backend, from one warm start."""
    def cli(*args: str) -> None:
        subprocess.run([sys.executable, "-m", "gcore_rl.cli", *args], cwd=work, check=True, capture_output=True)

    cli("init-tiny", "base")
    cli("sft", str(REPO / "recipes" / "sft_addition.yaml"), "model.path=base", "output_dir=sft", f"threads={threads}",
        "progress=false")
    out = {}
    for backend in BACKENDS:
        run = work / f"grpo-{backend}"
        cli("train", str(REPO / "recipes" / "grpo_addition.yaml"), "model.path=sft", f"run.output_dir={run}",
            f"run.steps={steps}", "run.eval_every=0", "run.stop_at_eval_accuracy=0", "run.progress=false",
            f"runtime.threads_per_process={threads}", f"engine.backend={backend}")
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        out[backend] = {"median_step_s": statistics.median(line["time/step"] for line in lines[1:]),
                        "median_rollout_s": statistics.median(line["time/rollout"] for line in lines[1:])}
        print(f"  GRPO step, {backend}: {out[backend]['median_step_s']:.2f} s", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grpo-steps", type=int, default=10, help="0 = skip the GRPO step comparison")
    parser.add_argument("--quick", action="store_true", help="Smoke: the demo model, batch 8, one repeat, no GRPO.")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.quick:
        args.models, args.batches, args.repeats, args.grpo_steps = ["demo"], [8], 1, 0
    work = Path(tempfile.mkdtemp(prefix="engine-vs-vllm-"))
    results = {"date": str(date.today()), "machine": machine(), "settings": vars(args), "models": {}}
    for name in args.models:
        model_dir = write_tiny_model(work / name, MODELS[name])
        print(f"{name}:", flush=True)
        results["models"][name] = {backend: measure_backend(backend, model_dir, args.batches, args.repeats, args.threads)
                                   for backend in BACKENDS}
    if args.grpo_steps:
        results["grpo"] = grpo_steps(work, args.grpo_steps, args.threads)
    print("\n| model | batch | ours tokens/s | vLLM tokens/s | vLLM / ours | first finished, ours / vLLM (s) |")
    print("|---|---|---|---|---|---|")
    for name, sides in results["models"].items():
        for batch in args.batches:
            ours, theirs = sides["builtin"]["batches"][batch], sides["vllm"]["batches"][batch]
            print(f"| {name} | {batch} | {ours['tokens_per_s']:.0f} | {theirs['tokens_per_s']:.0f} | "
                  f"{theirs['tokens_per_s'] / ours['tokens_per_s']:.2f} | {ours['first_finished_s']:.2f} / "
                  f"{theirs['first_finished_s']:.2f} |")
    print("\n| model | start-up, ours / vLLM (s) | weight sync, ours / vLLM (s per GB) |\n|---|---|---|")
    for name, sides in results["models"].items():
        print(f"| {name} | {sides['builtin']['start_s']:.1f} / {sides['vllm']['start_s']:.1f} | "
              f"{sides['builtin']['sync_s_per_gb']:.2f} / {sides['vllm']['sync_s_per_gb']:.2f} |")
    if args.grpo_steps:
        grpo = results["grpo"]
        print(f"\nGRPO step (demo, median of steps 2..{args.grpo_steps}): ours {grpo['builtin']['median_step_s']:.2f} s, "
              f"vLLM {grpo['vllm']['median_step_s']:.2f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
