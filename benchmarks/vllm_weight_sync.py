"""How an update reaches a vLLM server on this CPU: `engine.vllm.weight_sync=file` (safetensors written to /dev/shm,
reloaded by the server) against `group` (broadcast over a gloo process group of the engine's process and the
server's worker, reloaded in place), side by side in one run (issue 40).

**Setup.** The two models of `engine_vs_vllm.py` (`demo`, and the 41 M-parameter `qwen2-40m`), fp32. For each
model and way, one server is started and given the model's full state as one update (`load_weights`, whose
`final` call returns once the server has the weights and has reset its prefix cache) `--repeats` times after one
warm-up update; the median seconds and seconds per GB are printed, with group / file. Then one generation call
checks that the server samples (not timed).

    .venv/bin/python benchmarks/vllm_weight_sync.py --out bench-results/vllm_weight_sync.json   # ~4 min, 2 cores
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from datetime import date
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from engine_vs_generate import machine  # noqa: E402
from engine_vs_vllm import MODELS, timed_sync  # noqa: E402

from gcore_rl.models.loading import load_tokenizer  # noqa: E402
from gcore_rl.models.tiny import write_tiny_model  # noqa: E402
from gcore_rl.rollout.backends import EngineConfig, EngineSource, build_engine  # noqa: E402
from gcore_rl.rollout.sampling import SamplingConfig  # noqa: E402
from gcore_rl.rollout.vllm_server import WEIGHT_SYNCS, VllmConfig  # noqa: E402


def timed_updates(model_dir: Path, weight_sync: str, repeats: int, threads: int) -> dict:
    """Median seconds of a whole-model update through `weight_sync` (`timed_sync`, after one warm-up update)."""
    tokenizer = load_tokenizer(model_dir)
    source = EngineSource(str(model_dir), torch.device("cpu"), tokenizer.eos_token_id, tokenizer.pad_token_id,
                          "float32", threads=threads)
    engine = build_engine(EngineConfig(backend="vllm", vllm=dataclasses.replace(VllmConfig(), weight_sync=weight_sync)),
                          source)
    try:
        result = timed_sync(engine, model_dir, repeats, warmup=1)
        engine.generate([[3, 4, 5]], SamplingConfig(n=2, max_new_tokens=4), seed=0)
    finally:
        engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="vllm-weight-sync-"))
    results = {"date": str(date.today()), "machine": machine(), "settings": vars(args), "models": {}}
    for name in args.models:
        model_dir = write_tiny_model(work / name, MODELS[name])
        results["models"][name] = {way: timed_updates(model_dir, way, args.repeats, args.threads) for way in WEIGHT_SYNCS}
        print(f"{name}: " + ", ".join(f"{way} {r['sync_s']:.3f} s" for way, r in results["models"][name].items()),
              flush=True)
    print("\n| model | weights (GB) | file (s) | group (s) | file (s/GB) | group (s/GB) | group / file |")
    print("|---|---|---|---|---|---|---|")
    for name, ways in results["models"].items():
        file, group = ways["file"], ways["group"]
        print(f"| {name} | {file['weights_gb']:.3f} | {file['sync_s']:.3f} | {group['sync_s']:.3f} | "
              f"{file['sync_s_per_gb']:.2f} | {group['sync_s_per_gb']:.2f} | {group['sync_s'] / file['sync_s']:.2f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
