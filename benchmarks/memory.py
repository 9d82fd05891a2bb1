"""Peak resident memory per role and step phase of a Qwen2-0.5B-shaped policy on CPU (issue 46).

**Question.** What does each device process hold at its peak in each phase of a GRPO step (generate,
prepare, update, sync) for a real model shape, and how much do LoRA, bf16 mixed precision and the chunked
LM head change the trainer's update-phase peak? The issue's criterion: LoRA cuts the actor process's
update-phase peak by at least 2.5× against full fine-tuning.

**Setup.** `gcore-rl init-tiny` at Qwen2-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 key/value heads,
MLP 4,864, vocabulary 151,936, tied embeddings, fp32, random weights: 494 M parameters) with the character
tokenizer (99 tokens; the engine samples from all 151,936 ids and the tokenizer drops unknown ids when
decoding, so the reward is the digit fraction of the completion, `DIGITS_REWARD`, which tolerates any
text). Then `recipes/grpo_addition.yaml` for `--steps` steps with `--prompts` prompts × `--samples`
samples of `--new-tokens` tokens, no dynamic sampling, no evaluation, no checkpoints, on the Ray runtime
with two CPU devices under `placement.strategy=disaggregated`: device 0 trains, device 1 generates, so each
phase's `memory/rss_peak_mib/<phase>_max` (the max over the devices of the phase's high-water mark, reset
between phases through /proc/self/clear_refs) belongs to one process; the run's timelines say which device
ran which phase, and the table says it too. The weight sync has a phase on each side: `update/sync` on the
trainer (gather, merge LoRA, send) and `rollout/load_weights` on the engine. Each variant runs in a fresh
run directory:

- `full`: every parameter trained, fp32, chunked LM head for log-probs (the default);
- `full-logits`: the same with the full-logits head (`gcore_rl.training.logprobs.CHUNKED_HEAD = False`,
  set in the workers through a `sitecustomize` module on PYTHONPATH);
- `lora`: `model.lora.enabled=true model.lora.rank=16 model.lora.alpha=32` (all linear layers);
- `lora-bf16`: the same with the frozen base in bf16 (`model.dtype=bfloat16`; peft keeps the adapters and their
  AdamW state in fp32);
- `bf16`: `train.bf16_cpu=true` (bf16 autocast and bf16 parameter gathers, fp32 master weights).

Offload (`train.offload`) is not measured: on a CPU device host and device are the same memory, and it
needs a strategy where the trainer shares its device, which this layout does not have.

**On a GPU** (`--device cuda`): one CUDA device in the local runtime under `placement.strategy=colocate`, so the
engine sleeps through the update and the trainer stays resident through generation unless `train.offload`
moves it out; the peaks are the device's allocated bytes per phase (`memory/cuda_peak_mib/<phase>_max`,
`torch.cuda.max_memory_allocated` reset between phases), not the CUDA context. The variants: `full`
(`train.bf16=true`, the default on CUDA: bf16 autocast, fp32 master weights), `full-fp32`, `full-logits`,
`lora`, `offload-optimizer`, `offload-all` and `lora-offload-all`. The generate column then shows what the
trainer keeps on the device during rollout.

`--policy 1.5b` runs the Qwen2-1.5B shape (hidden 1,536, 28 layers, 12 heads, 2 key/value heads, MLP
8,960) with LoRA only, 16 prompts × 64 tokens by default; its full fine-tuning (weights, gradients and
AdamW moments ~25 GB in fp32) does not fit a 24 GiB machine.

    .venv/bin/python benchmarks/memory.py --steps 2 --out bench-results/memory.json      # ~45 min, ~13 GB free RAM
    .venv/bin/python benchmarks/memory.py --policy 1.5b --variants lora-bf16 --micro-batch 4 --threads 2 --steps 3 \
        --out bench-results/memory-1.5b.json engine.dtype=bfloat16   # ~25 min on 2 cores, ~21 GB RAM at its peak
    python3 benchmarks/memory.py --device cuda --policy 1.5b --out OUT/memory-cuda-1.5b.json   # every CUDA variant
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import yaml

from gcore_rl.costmodel.memory import TrainerSetup, placement_fit, trainer_memory
from gcore_rl.costmodel.models import MODELS, ModelSpec

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_addition.yaml"
MINI_BATCHES = int(yaml.safe_load(RECIPE.read_text())["train"]["mini_batches"])
MIB = 2**20

SHAPES = {
    "0.5b": ["hidden_size=896", "num_layers=24", "num_heads=14", "num_kv_heads=2", "intermediate_size=4864"],
    "1.5b": ["hidden_size=1536", "num_layers=28", "num_heads=12", "num_kv_heads=2", "intermediate_size=8960"],
}
"""`init-tiny` shape of each `--policy` (vocabulary 151,936 and arch qwen2 for both)."""

LORA = ["model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32"]
VARIANTS = {
    "full": [],
    "full-logits": [],  # the workers' CHUNKED_HEAD is turned off through SITECUSTOMIZE
    "lora": LORA,
    "lora-bf16": [*LORA, "model.dtype=bfloat16"],  # the frozen base in bf16, the adapters and AdamW in fp32
    "bf16": ["train.bf16_cpu=true"],
}
"""Variant → its overrides (CPU)."""

CUDA_VARIANTS = {
    "full": [],
    "full-fp32": ["train.bf16=false"],
    "full-logits": [],
    "lora": LORA,
    "offload-optimizer": ["train.offload=optimizer"],
    "offload-all": ["train.offload=all"],
    "lora-offload-all": [*LORA, "train.offload=all"],
}
"""Variant → its overrides on one CUDA device (colocated; `train.bf16=true`, the default there, unless named)."""

PHASES = {"generate": "rollout_generate", "load": "rollout_load_weights", "prepare": "update_prepare",
          "update": "update_train", "sync": "update_sync"}
"""Column → the phase whose `memory/rss_peak_mib/<phase>_max` it shows."""

DIGITS_REWARD = "def fraction(prompt, completion, **row):\n    return sum(c.isdigit() for c in completion) / max(len(completion), 1)\n"
"""The reward: the digit fraction of the completion, whatever ids the random policy samples."""

SITECUSTOMIZE = '''"""Set gcore_rl.training.logprobs.CHUNKED_HEAD = False in every process, as the module is imported."""
import importlib.abc
import sys


class _Off(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "gcore_rl.training.logprobs":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.CHUNKED_HEAD = False
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Off())
'''


def variants(args: argparse.Namespace) -> dict[str, list[str]]:
    return CUDA_VARIANTS if args.device == "cuda" else VARIANTS


def job(args: argparse.Namespace) -> list[str]:
    """The overrides every variant shares: two CPU devices under Ray, disaggregated, or one CUDA device in the
    local runtime, colocated (the engine sleeps through the update; the trainer stays unless offloaded)."""
    where = (["runtime.kind=local", "runtime.device=cuda", "placement.strategy=colocate"] if args.device == "cuda"
             else ["runtime.kind=ray", "runtime.devices_per_controller=2", "placement.strategy=disaggregated"])
    return [f"run.steps={args.steps}", f"run.prompts_per_step={args.prompts}", f"sampling.n={args.samples}",
            f"sampling.max_new_tokens={args.new_tokens}", "dynamic_sampling.enabled=false", "run.eval_every=0",
            "run.stop_at_eval_accuracy=0", "data.eval_prompts=8", "run.checkpoint_every=0", "run.save_final=false",
            "run.progress=false", "reward.rules.0.fn=digits:fraction", "reward.accuracy_fn=digits:fraction",
            *where, f"runtime.threads_per_process={args.threads}", f"train.micro_batch_size={args.micro_batch}",
            *args.extra]


def run_gcore(argv: list[str], cwd: Path, pythonpath: list[Path], log: Path, mmap_threshold: int = 0) -> float:
    """`gcore-rl ARGV` in `cwd` with `pythonpath` importable (and glibc's `MALLOC_MMAP_THRESHOLD_` when
    `mmap_threshold` > 0); its wall seconds. Raises with the log's tail."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", PYTHONPATH=os.pathsep.join(
        [str(p) for p in pythonpath] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    if mmap_threshold > 0:
        env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)  # the Ray workers inherit it
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.run([sys.executable, "-m", "gcore_rl.cli", *argv], cwd=cwd, env=env, stdout=out,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"gcore-rl {shlex.join(argv)} exited {proc.returncode}:\n{log.read_text()[-4000:]}")
    return time.perf_counter() - started


def phase_devices(run_dir: Path) -> dict[str, list[int]]:
    """Phase (metrics spelling, '/' as '_') → the devices whose timeline recorded it."""
    devices: dict[str, set[int]] = {}
    for path in sorted((run_dir / "timeline").glob("device-*.jsonl")):
        for line in path.read_text().splitlines():
            event = json.loads(line)
            devices.setdefault(event["what"].replace("/", "_"), set()).add(int(event["device"]))
    return {phase: sorted(found) for phase, found in devices.items()}


def measure_variant(work: Path, model: Path, name: str, overrides: list[str], args: argparse.Namespace) -> dict:
    """One run of `name` in a fresh directory; its peaks per phase (max over the steps) and the devices of each."""
    run_dir = work / f"run-{name}{'-mmap' if args.mmap_threshold else ''}"
    pythonpath = [work] + ([work / "chunked-off"] if name == "full-logits" else [])
    argv = ["train", str(RECIPE), f"model.path={model}", f"run.output_dir={run_dir}", *job(args), *overrides]
    seconds = run_gcore(argv, work, pythonpath, work / f"{name}.log", args.mmap_threshold)
    return read_run(run_dir, name, seconds, memory=args.device)


def read_run(run_dir: Path, name: str, seconds: float, steps: int = 0, memory: str = "cpu") -> dict:
    """A run's row: its peaks per phase (max over its first `steps` steps, 0 = all), per step, and the devices
    that ran each phase; `memory` "cpu" reads resident memory (`memory/rss_peak_mib/*`), "cuda" the device's
    allocated bytes (`memory/cuda_peak_mib/*`)."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = metrics[:steps] if steps else metrics
    where = phase_devices(run_dir)
    row = {"variant": name, "run_dir": str(run_dir), "overrides": (CUDA_VARIANTS if memory == "cuda" else VARIANTS)[name], "steps": len(metrics), "seconds": round(seconds, 1),
           "tokens_per_step": max(m.get("work/actor/tokens", 0.0) for m in metrics), "peak_mib": {}, "devices": {},
           "per_step_mib": {}}
    for column, phase in PHASES.items():
        key = f"memory/{'cuda_peak_mib' if memory == 'cuda' else 'rss_peak_mib'}/{phase}_max"
        values = [round(m[key], 1) for m in metrics if key in m]
        row["peak_mib"][column] = max(values) if values else None
        row["per_step_mib"][column] = values
        row["devices"][column] = where.get(phase, [])
    peak_key = "memory/cuda_peak_allocated_mib_max" if memory == "cuda" else "memory/worker_peak_rss_mib_max"
    row["process_peak_mib"] = round(max(m[peak_key] for m in metrics), 1)
    row["controller_peak_mib"] = round(max(m.get("memory/controller_peak_rss_mib_max", 0.0) for m in metrics), 1)
    return row


def table(rows: list[dict], device: str = "cpu") -> str:
    """The Markdown table of peaks (MiB) per variant and phase, with the device of each phase."""
    cols = list(PHASES)
    head = " | ".join(f"{c} ({PHASES[c]})" for c in cols)
    lines = [f"| variant | {head} | update, step 1 | any phase, any device | wall |", "|---|" + "---|" * (len(cols) + 3)]
    for r in rows:
        cells = []
        for c in cols:
            peak, devices = r["peak_mib"][c], r["devices"][c]
            cells.append("—" if peak is None else f"{peak:,.0f} (dev {','.join(map(str, devices)) or '?'})")
        lines.append(f"| {r['variant']} | {' | '.join(cells)} | {r['per_step_mib']['update'][0]:,.0f} | "
                     f"{r['process_peak_mib']:,.0f} | {r['seconds']:.0f} s |")
    if device == "cpu":
        lines.append("| offload | not measured on CPU (host = device; disaggregated trainers never share their device) |"
                     + " |" * (len(cols) + 2))
    by_name = {r["variant"]: r for r in rows}
    for name in ("lora", "lora-bf16"):
        if "full" in by_name and name in by_name:
            full, lora = by_name["full"], by_name[name]
            lines.append(f"\n{name} cuts the trainer's update-phase peak by "
                         f"{full['peak_mib']['update'] / lora['peak_mib']['update']:.2f}× (step 1: "
                         f"{full['per_step_mib']['update'][0] / lora['per_step_mib']['update'][0]:.2f}×); "
                         "the issue asks for at least 2.5×.")
    return "\n".join(lines)


CPU_PROCESS_MIB = 600.0
"""A Ray device worker's own resident memory on CPU (Python, torch, transformers, peft, Ray's core worker): the
imports alone take 414 MiB in a plain process (2026-11-28), and the engine device's generate peak less its
fp32 weights is 663 MiB (with its KV cache and one step's logits)."""


def modelled(row: dict, model_dir: Path, args: argparse.Namespace) -> float:
    """The trainer memory model's update-phase peak (MiB) for the measured run of `row`, set up from the run's
    own `config.yaml` (LoRA and its rank, the model's dtype, bf16 mixed precision, activation checkpointing)."""
    model = ModelSpec.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    config = yaml.safe_load((Path(row["run_dir"]) / "config.yaml").read_text())
    lora, train = config["model"]["lora"], config["train"]
    sequences = args.prompts * args.samples
    rows = min(args.micro_batch, sequences // MINI_BATCHES)
    length = round(row["tokens_per_step"] / sequences)
    cuda = args.device == "cuda"
    bf16_base = config["model"]["dtype"] == "bfloat16"
    bf16 = (train["bf16"] if cuda else train["bf16_cpu"]) or bf16_base
    setup = TrainerSetup(micro_batch_tokens=rows * length, head_tokens=rows * (args.new_tokens + 1),
                         lora_rank=lora["rank"] if lora["enabled"] else 0, frozen_bytes=2 if bf16_base else 4,
                         chunked_head=row["variant"] != "full-logits", activation_bytes=2 if bf16 else 4,
                         gather_bytes=2 if bf16 else 4, activation_checkpointing=train["activation_checkpointing"],
                         process_bytes=0 if cuda else CPU_PROCESS_MIB * MIB)
    return trainer_memory(model, setup).update_peak / MIB


def check_table(rows: list[dict], model_dir: Path, args: argparse.Namespace) -> str:
    """Measured against modelled update-phase peaks. Step 1's update comes before the first weight sync, whose
    peak (LoRA: merged copies of the weights) the allocator keeps resident in the later steps."""
    lines = ["| variant | update peak, measured: all steps / step 1 (MiB) | modelled (MiB) | modelled / measured |",
             "|---|---|---|---|"]
    for r in rows:
        guess, peak, first = modelled(r, model_dir, args), r["peak_mib"]["update"], r["per_step_mib"]["update"][0]
        lines.append(f"| {r['variant']} | {peak:,.0f} / {first:,.0f} | {guess:,.0f} | {guess / peak:.2f} / {guess / first:.2f} |")
    return "\n".join(lines)


GPU_SETUP = dict(micro_batch_tokens=16_384, activation_checkpointing=True, activation_bytes=2, gather_bytes=2,
                 foreach_optimizer=True, process_bytes=3e9)
"""The GPU trainer priced by `price_table`: bf16 mixed precision (fp32 master weights, gradients and moments),
activation checkpointing, the chunked head, a foreach AdamW, 16,384 tokens per micro-batch, and 3 GB for the
CUDA context, NCCL buffers and allocator slack."""

TRAINERS = {"full": (0, "none"), "full, offload optimizer": (0, "optimizer"), "full, offload all": (0, "all"),
            "LoRA r16": (16, "none"), "LoRA r16, offload all": (16, "all")}
"""Trainer kind → (LoRA rank, train.offload)."""


def price_table(devices: int = 8, device_gb: float = 80.0) -> str:
    """Which placements fit on `devices` GPUs of `device_gb` for 7B and 32B, per trainer kind (the model)."""
    lines = ["| model | trainer | placement | update peak / GPU | trainer during rollout / GPU | KV tokens per engine "
             "| fits |", "|---|---|---|---|---|---|---|"]
    for name, engine_tp in (("Qwen2.5-7B", 1), ("Qwen2.5-32B", 2)):
        model = MODELS[name]
        for trainer, (rank, offload) in TRAINERS.items():
            for placement, shards, colocated in (("colocate 8", devices, True),
                                                 (f"disaggregated {devices // 2}+{devices // 2}", devices // 2, False)):
                if offload != "none" and not colocated:
                    continue  # offload means nothing where the trainer has its devices to itself
                setup = TrainerSetup(shards=shards, lora_rank=rank, **GPU_SETUP)
                fit = placement_fit(model, device_gb * 1e9, setup, engine_tp=engine_tp, colocated=colocated,
                                    offload=offload)
                verdict = "yes" if fit.fits else ("no: update" if not fit.update_fits else "no: KV")
                lines.append(f"| {name} (engine TP {engine_tp}) | {trainer} | {placement} | {fit.update_peak / 1e9:.1f} GB "
                             f"| {fit.rollout_trainer / 1e9:.1f} GB | {fit.kv_tokens / 1e3:,.0f} k | {verdict} |")
    return "\n".join(lines)


def machine(device: str = "cpu") -> str:
    if device == "cuda":
        import torch

        gpu = torch.cuda.get_device_properties(0)
        gpu_text = f"{gpu.name} ({gpu.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    else:
        gpu_text = "no GPU"
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{platform.machine()} {os.cpu_count()} cores ({cpu}), {mem_gib:.0f} GiB RAM, {gpu_text}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cpu: two CPU devices under Ray (peaks of resident memory); cuda: one GPU, local "
                             "runtime, colocated (peaks of allocated device memory), with the offload variants")
    parser.add_argument("--variants", nargs="+", choices=sorted({*VARIANTS, *CUDA_VARIANTS}), default=None,
                        help="default: all for 0.5b and on CUDA, lora for 1.5b on CPU")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=None, help="default: 8 (0.5b), 16 (1.5b)")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 32 (0.5b), 64 (1.5b)")
    parser.add_argument("--micro-batch", type=int, default=16, help="train.micro_batch_size (rows)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--mmap-threshold", type=int, default=0,
                        help="glibc MALLOC_MMAP_THRESHOLD_ for the runs: 131072 gives every allocation of 128 KiB or "
                             "more a mapping of its own, returned when freed, so the resident set follows the live "
                             "tensors; 0 = glibc's default, whose threshold grows to 32 MiB and keeps freed tensors")
    parser.add_argument("--price", action="store_true", help="print the model's 7B/32B placement table and exit")
    parser.add_argument("--report", nargs="+", default=None, metavar="VARIANT=RUN_DIR[:SECONDS]",
                        help="re-read finished runs (with --steps as the steps to read) instead of running")
    parser.add_argument("extra", nargs="*", help="more overrides for every variant (key=value)")
    args = parser.parse_args()
    if args.price:
        print(price_table())
        return
    big = args.policy == "1.5b"
    args.prompts = args.prompts or (16 if big else 8)
    args.new_tokens = args.new_tokens or (64 if big else 32)
    cuda = args.device == "cuda"
    names = args.variants or (list(CUDA_VARIANTS) if cuda else ["lora"] if big else list(VARIANTS))
    unknown = sorted(set(names) - set(variants(args)))
    if unknown:
        parser.error(f"variants {unknown} are not measured on {args.device}")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix=f"memory-{args.policy}-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "digits.py").write_text(DIGITS_REWARD)
    (work / "chunked-off").mkdir(exist_ok=True)
    (work / "chunked-off" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    model = work / f"qwen2-{args.policy}"
    if not (model / "config.json").is_file():
        run_gcore(["init-tiny", str(model), *SHAPES[args.policy], "vocab_size=151936", "arch=qwen2",
                   f"max_positions={max(256, 2 * args.new_tokens + 64)}"], work, [], work / "init.log")
    started = datetime.now(timezone.utc)
    rows = []
    for name in names if not args.report else []:
        rows.append(measure_variant(work, model, name, variants(args)[name], args))
        print(json.dumps(rows[-1]), flush=True)
    for item in args.report or []:
        name, run_dir = item.split("=", 1)
        run_dir, _, seconds = run_dir.partition(":")
        rows.append(read_run(Path(run_dir), name, float(seconds or 0), args.steps, memory=args.device))
    command = shlex.join([sys.executable, *sys.argv])
    header = (f"{started:%Y-%m-%d %H:%M} UTC, {machine(args.device)}; policy {args.policy}, {args.steps} steps of "
              f"{args.prompts} prompts × {args.samples} samples × {args.new_tokens} new tokens, micro-batch "
              f"{args.micro_batch} rows, {args.threads} thread(s) per process; "
              + ("one GPU, colocated: the engine sleeps through the update" if cuda
                 else "device 0 trains, device 1 generates"))
    print(f"\n{command}\n{header}\n\n{table(rows, args.device)}\n\n{check_table(rows, model, args)}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"command": command, "date": f"{started:%Y-%m-%d}", "machine": machine(args.device),
                                              "setup": header, "job": job(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
