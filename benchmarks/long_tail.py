"""Long-tailed completion lengths (issue 21): what padding costs the trainer, and what packing, a token
budget and activation checkpointing change.

**Question.** When a step's completion lengths span two orders of magnitude, how much of the trainer's
forward and forward + backward + AdamW goes to padding, how fast are the packed passes
(`train.packing`, `train.max_tokens_per_micro_batch`) in tokens/s of real tokens, how much memory do
they need, and are their log-probs and updated weights the padded ones?

**Setup.** One init-tiny model (`arch=llama hidden_size=256 num_layers=4 num_heads=4 num_kv_heads=2
intermediate_size=768 max_positions=1024`, character vocabulary of 99 tokens, 3.17M parameters, fp32, SDPA
attention), loaded by `PolicyTrainer.build` (FSDP2 over a gloo group of one process, AdamW, lr 1e-4,
grad clip 1.0, GRPO loss with `token_mean` aggregation, no KL, no reference) in one process per arm and
repeat. The batch (`build_token_batch`, as the trainer receives it): `--rows` rows (default 64); prompt
lengths uniform in 12..20 tokens; completion lengths log-uniform between 8 and 512 tokens
(`round(exp(U(ln 8, ln 512)))`); token ids uniform over the vocabulary's characters; advantages
uniformly ±1 per row; all drawn with `numpy.random.default_rng(--seed)` (default seed 0). With the
defaults the batch is 64 × 526 positions (20 prompt columns + the longest completion, 506) holding
8,683 real tokens (26% of the 33,664 positions; 7,618 response tokens; completion median 73.5, mean 119).

Arms (same model folder, same batch, same advantages; `micro_batch_size` / budget / packing in
`TrainConfig`):

* `padded`: `micro_batch_size=8`, no budget, no packing: today's default, 8 passes of 8 rows × the
  batch's full width.
* `padded+budget`: `micro_batch_size=64`, `max_tokens_per_micro_batch=B`, no packing (first-fit
  decreasing with cost rows × longest row), to separate the budget from the packing. Each pass is
  cropped to the columns its rows fill (`TokenBatch.crop`; before b54ea94 it ran at the whole batch's
  width, which this benchmark found): the positions column shows it.
* `packed`: `micro_batch_size=64`, `max_tokens_per_micro_batch=B`, `packing=True`.
* `packed+ac` (with `--activation-checkpointing`): `packed` with `activation_checkpointing=True`.

`B` is `--budget` (default 2048 tokens per pass). Each arm runs, in a fresh subprocess per repeat (so
`ru_maxrss` is the arm's own): build the trainer; `compute_logprobs` once on the initial weights (not
timed: the equality check on identical weights, and the forward's warm-up); one warm-up
`PolicyTrainer.update`; then, timed, `Actor.compute_logprobs` (forward only, no grad) and one
`PolicyTrainer.update` (forward + backward + clip + AdamW). Reported per arm (medians over
`--repeats`, arms interleaved within a repeat): seconds and tokens/s of real (unpadded) tokens of each,
the passes and the positions the model's forward computed (a forward pre-hook counts `input_ids`),
the process's peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) and its RSS peak right after the
build (the difference is what the passes added on top of the loaded trainer). PyTorch has no
peak-memory counter for CPU tensors (`torch.cuda.max_memory_allocated` has no CPU counterpart), so with
`--torch-memory` (default on) repeat 0 of each arm also runs one more update under
`torch.distributed._tools.mem_tracker.MemTracker` (a `TorchDispatchMode` that follows the storages of
every op's outputs, with the model's parameters, gradients and AdamW state tracked as external): its
peak of live tensor bytes, by kind. It does not see allocations inside a kernel (e.g. SDPA's
workspace) nor allocator overhead, and it runs after the RSS figures are read.

Equality checks (against the first arm, `padded`): the max |Δ| of the initial-weight log-probs and of
the timed (post-warm-up) log-probs on the response tokens (must be < 1e-4), and the max |Δ| of every
weight after the warm-up and timed updates (same data, same init), next to the largest weight change
those two updates made, for scale.

Run from the repository root, one benchmark at a time (1 thread per measured process: `--threads`):

    .venv/bin/python benchmarks/long_tail.py --activation-checkpointing --out bench-results/long_tail.json
    .venv/bin/python benchmarks/long_tail.py --quick      # smoke run: 16 rows up to 64 tokens, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import math
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

REPO = Path(__file__).resolve().parents[1]
MODEL = ["arch=llama", "hidden_size=256", "num_layers=4", "num_heads=4", "num_kv_heads=2", "intermediate_size=768",
         "max_positions=1024"]
QUICK_MODEL = ["arch=llama", "hidden_size=64", "num_layers=2", "num_heads=4", "num_kv_heads=2",
               "intermediate_size=128", "max_positions=256"]
RESULT_MARKER = "LONG_TAIL_RESULT "
MIB = 2**20


def arm_config(arm: str, budget: int) -> dict:
    """`TrainConfig` fields of an arm."""
    arms = {
        "padded": {"micro_batch_size": 8},
        "padded+budget": {"micro_batch_size": 64, "max_tokens_per_micro_batch": budget},
        "packed": {"micro_batch_size": 64, "max_tokens_per_micro_batch": budget, "packing": True},
        "packed+ac": {"micro_batch_size": 64, "max_tokens_per_micro_batch": budget, "packing": True,
                      "activation_checkpointing": True},
    }
    return arms[arm]


# ----------------------------------------------------------------------------------------------
# The batch
# ----------------------------------------------------------------------------------------------


def make_batch(rows: int, min_len: int, max_len: int, prompt_min: int, prompt_max: int, seed: int):
    """The benchmark's `TokenBatch` (with advantages) and its completion lengths; see the module docstring."""
    import numpy as np
    import torch

    from gcore_rl.models.tiny import SPECIAL_TOKENS, TOKENIZER_SIZE
    from gcore_rl.records import Completion, build_token_batch

    rng = np.random.default_rng(seed)
    lengths = np.rint(np.exp(rng.uniform(math.log(min_len), math.log(max_len), size=rows))).astype(int)
    prompts = rng.integers(prompt_min, prompt_max + 1, size=rows)
    first = len(SPECIAL_TOKENS)  # ids below are <pad>, <eos>, <unk>
    completions = []
    for row in range(rows):
        prompt = rng.integers(first, TOKENIZER_SIZE, size=int(prompts[row])).tolist()
        tokens = rng.integers(first, TOKENIZER_SIZE, size=int(lengths[row])).tolist()
        completions.append(Completion(row, prompt, tokens, [-1.0] * len(tokens), "length"))
    batch = build_token_batch(completions, 0)
    batch.advantages = torch.from_numpy(rng.choice([-1.0, 1.0], size=rows)).float()
    return batch, lengths.tolist(), prompts.tolist()


# ----------------------------------------------------------------------------------------------
# One arm, one repeat (the child process)
# ----------------------------------------------------------------------------------------------


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    from gcore_rl.algos.config import AlgoConfig
    from gcore_rl.distributed import destroy_process_group, free_port, init_process_group
    from gcore_rl.training.actor import TrainConfig
    from gcore_rl.training.optim_step import full_tensor
    from gcore_rl.training.policy_trainer import PolicyTrainer

    def rss_peak() -> float:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux -> MiB

    work = Path(args.work_dir)
    batch, _, _ = make_batch(args.rows, args.min_len, args.max_len, args.prompt_min, args.prompt_max, args.seed)
    real_tokens = int(batch.attention_mask.sum())
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    cuda = device.type == "cuda"

    def now() -> float:  # a CUDA run's clock waits for the queued kernels
        if cuda:
            torch.cuda.synchronize(device)
        return time.perf_counter()
    init_process_group(0, 1, free_port(), device)
    try:
        torch.manual_seed(0)
        rss_before_build = rss_peak()
        train = TrainConfig(**arm_config(args.child, args.budget), bf16=args.bf16)  # autocast follows train.bf16
        trainer = PolicyTrainer.build(work / "model", dtype="float32", attn_implementation="sdpa", reference_path=None,
                                      train=train, algo=AlgoConfig(), logprob_temperature=1.0, device=device,
                                      bf16=args.bf16)
        rss_after_build = rss_peak()
        initial = {name: full_tensor(p.detach()).clone() for name, p in trainer.model.named_parameters()}

        forwards: list[tuple[int, ...]] = []  # [rows, positions] of every forward of the model

        def count(_module, _args, kwargs):
            forwards.append(tuple(kwargs["input_ids"].shape))
        hook = trainer.model.register_forward_pre_hook(count, with_kwargs=True)

        init_logprobs = trainer.actor.compute_logprobs(batch)  # identical weights in every arm
        forward_passes = list(forwards)
        started = now()
        trainer.update(batch, trainer.prepare(batch))
        warmup_update_s = now() - started
        update_passes = forwards[len(forward_passes):]

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        started = now()
        logprobs = trainer.actor.compute_logprobs(batch)
        forward_s = now() - started
        started = now()
        stats = trainer.update(batch, trainer.prepare(batch))
        update_s = now() - started
        cuda_peak = torch.cuda.max_memory_allocated(device) / MIB if cuda else None
        rss_after = rss_peak()
        hook.remove()

        result = {"arm": args.child, "repeat": args.repeat, "train": arm_config(args.child, args.budget),
                  "real_tokens": real_tokens, "forward_s": forward_s, "update_s": update_s,
                  "warmup_update_s": warmup_update_s, "forward_tokens_per_s": real_tokens / forward_s,
                  "update_tokens_per_s": real_tokens / update_s,
                  "passes": len(forward_passes), "forward_positions": sum(r * t for r, t in forward_passes),
                  "update_passes": len(update_passes), "update_positions": sum(r * t for r, t in update_passes),
                  "pass_shapes": forward_passes,
                  "rss_before_build_mib": rss_before_build, "rss_peak_after_build_mib": rss_after_build,
                  "rss_peak_mib": rss_after, "update_stats": stats, "cuda_peak_allocated_mib": cuda_peak,
                  "parameters": sum(p.numel() for p in initial.values())}
        weights = {name: full_tensor(p.detach()).clone() for name, p in trainer.model.named_parameters()}
        result["max_weight_change"] = max(float((weights[n] - initial[n]).abs().max()) for n in weights)
        if args.repeat == 0:
            torch.save({"init_logprobs": init_logprobs.cpu(), "logprobs": logprobs.cpu(),
                        "weights": {name: w.cpu() for name, w in weights.items()}},
                       work / f"tensors-{args.child}.pt")
            if args.torch_memory and not cuda:
                result["torch_memory"] = tracked_update(trainer, batch)
    finally:
        destroy_process_group()
    print(RESULT_MARKER + json.dumps(result), flush=True)


def tracked_update(trainer, batch) -> dict:
    """One more update under `MemTracker`: peak live tensor bytes (MiB), total and by kind."""
    from torch.distributed._tools.mem_tracker import MemTracker

    root = trainer.model

    class PerPassTracker(MemTracker):
        """MemTracker refuses a second forward of the root module (it takes it for a new iteration):
        forget the per-module statistics before each micro-batch's forward; the global peak stays."""

        def _pre_fw_hook(self, module, inputs):
            if module is root and module in self.memory_tracking and not self._mod_tracker.is_bw:
                self.reset_mod_stats()
            super()._pre_fw_hook(module, inputs)

    tracker = PerPassTracker()
    tracker.track_external(trainer.model, trainer.actor.optimizer)
    with tracker:
        trainer.update(batch, trainer.prepare(batch))
    peak = {}
    for device, snapshot in tracker.get_tracker_snapshot("peak").items():
        peak[str(device)] = {str(getattr(kind, "value", kind)): size / MIB for kind, size in snapshot.items()}
    return peak


# ----------------------------------------------------------------------------------------------
# The parent: model, subprocesses, comparisons, table
# ----------------------------------------------------------------------------------------------


def run_child(args: argparse.Namespace, arm: str, repeat: int, work: Path) -> dict:
    command = [sys.executable, __file__, "--child", arm, "--repeat", str(repeat), "--work-dir", str(work),
               "--threads", str(args.threads), "--rows", str(args.rows), "--min-len", str(args.min_len),
               "--max-len", str(args.max_len), "--prompt-min", str(args.prompt_min), "--prompt-max",
               str(args.prompt_max), "--seed", str(args.seed), "--budget", str(args.budget), "--device", args.device]
    if args.bf16:
        command.append("--bf16")
    if args.torch_memory:
        command.append("--torch-memory")
    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    load_before, started = os.getloadavg()[0], time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - started
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"arm {arm} repeat {repeat} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1][len(RESULT_MARKER):])
    result["process_wall_s"] = wall
    result["load_average_1min"] = [load_before, os.getloadavg()[0]]
    return result


def equality(work: Path, arms: list[str], batch) -> dict:
    """Max |Δ| against the first arm: log-probs on the response tokens, weights after the updates."""
    import torch

    base = torch.load(work / f"tensors-{arms[0]}.pt")
    mask = batch.response_mask.bool()
    out = {}
    for arm in arms[1:]:
        other = torch.load(work / f"tensors-{arm}.pt")
        out[arm] = {
            "init_logprobs_max_abs_diff": float((other["init_logprobs"] - base["init_logprobs"])[mask].abs().max()),
            "logprobs_max_abs_diff": float((other["logprobs"] - base["logprobs"])[mask].abs().max()),
            "weights_max_abs_diff": max(float((other["weights"][n] - w).abs().max()) for n, w in base["weights"].items()),
        }
    return out


def machine() -> dict:
    import torch
    import transformers

    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()
        except OSError:  # no git on the machine
            return ""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": platform.machine(), "cpu": cpu,
            "nproc": os.cpu_count(), "python": sys.version.split()[0], "torch": torch.__version__,
            "transformers": transformers.__version__, "commit": git("rev-parse", "HEAD"),
            "worktree_dirty": bool(git("status", "--porcelain")),
            "gcore_rl_sha256": code_digest()}


def code_digest() -> str:
    """SHA-256 over the package's Python files (paths and contents): which code was measured, in a worktree
    with uncommitted changes."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((REPO / "gcore_rl").rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def table(summary: dict, arms: list[str], checks: dict, ac: bool) -> str:
    lines = ["| arm | passes | positions computed (fwd) | forward s | forward tok/s | update s | update tok/s | "
             "peak RSS MiB | RSS added MiB | torch peak MiB |",
             "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for arm in arms:
        s = summary[arm]
        torch_peak = f"{s['torch_peak_mib']:.0f}" if s.get("torch_peak_mib") is not None else "–"
        lines.append(f"| {arm} | {s['passes']} | {s['forward_positions']} | {s['forward_s']:.3f} | "
                     f"{s['forward_tokens_per_s']:.0f} | {s['update_s']:.3f} | {s['update_tokens_per_s']:.0f} | "
                     f"{s['rss_peak_mib']:.0f} | {s['rss_added_mib']:.0f} | {torch_peak} |")
    base = summary[arms[0]]
    lines += ["", f"Speed-up over {arms[0]} (ratio of medians): " + ", ".join(
        f"{arm} forward ×{base['forward_s'] / summary[arm]['forward_s']:.2f}, update "
        f"×{base['update_s'] / summary[arm]['update_s']:.2f}" for arm in arms[1:])]
    if ac and "packed" in summary and "packed+ac" in summary:
        p, a = summary["packed"], summary["packed+ac"]
        lines.append(f"Activation checkpointing (packed): update {a['update_s'] / p['update_s']:.2f}× the time, "
                     f"RSS added {p['rss_added_mib']:.0f} → {a['rss_added_mib']:.0f} MiB"
                     + (f", torch peak {p['torch_peak_mib']:.0f} → {a['torch_peak_mib']:.0f} MiB"
                        if p.get("torch_peak_mib") is not None and a.get("torch_peak_mib") is not None else ""))
    lines += ["", f"| arm vs {arms[0]} | max abs diff log-probs, initial weights | after warm-up update | "
              "weights after 2 updates |", "|---|--:|--:|--:|"]
    for arm, c in checks.items():
        lines.append(f"| {arm} | {c['init_logprobs_max_abs_diff']:.2e} | {c['logprobs_max_abs_diff']:.2e} | "
                     f"{c['weights_max_abs_diff']:.2e} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=8, help="Shortest completion (log-uniform lower bound).")
    parser.add_argument("--max-len", type=int, default=512, help="Longest completion (log-uniform upper bound).")
    parser.add_argument("--prompt-min", type=int, default=12)
    parser.add_argument("--prompt-max", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=2048, help="max_tokens_per_micro_batch of the budget arms.")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="Add the packed+ac arm: packed with train.activation_checkpointing=true.")
    parser.add_argument("--arms", nargs="*", default=None,
                        help="Arms to run (default: padded padded+budget packed [packed+ac]); the first is the "
                             "reference of the equality checks.")
    parser.add_argument("--no-torch-memory", dest="torch_memory", action="store_false",
                        help="Skip the extra MemTracker update of repeat 0.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each measured process.")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the trainer on CUDA device 0 (an NCCL group of one), timings after "
                             "torch.cuda.synchronize, and the torch peak column is torch.cuda.max_memory_allocated "
                             "over the timed forward + update.")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast in the trainer (CUDA only).")
    parser.add_argument("--model", nargs="*", default=None, help="init-tiny options (default: the docstring's model).")
    parser.add_argument("--work-dir", default=None, help="Scratch folder (default: a new temporary one, removed).")
    parser.add_argument("--timeout", type=int, default=900, help="Seconds allowed to one subprocess.")
    parser.add_argument("--quick", action="store_true", help="Smoke run: 16 rows, lengths 4..64, a small model, 1 repeat.")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--torch-memory", dest="torch_memory", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(torch_memory=True)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.rows, args.min_len, args.max_len, args.repeats, args.budget = 16, 4, 64, 1, 256
        args.model = args.model or QUICK_MODEL
    model = args.model or MODEL
    arms = args.arms or ["padded", "padded+budget", "packed"] + (["packed+ac"] if args.activation_checkpointing else [])
    for arm in arms:
        arm_config(arm, args.budget)  # KeyError: an unknown arm

    started, date, digest = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S %Z"), code_digest()
    own_work = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="long-tail-")) if own_work else Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    try:
        if not (work / "model" / "config.json").exists():
            proc = subprocess.run([sys.executable, "-m", "gcore_rl.cli", "init-tiny", str(work / "model"), *model],
                                  cwd=REPO, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"init-tiny failed:\n{proc.stderr[-3000:]}")
        sys.path.insert(0, str(REPO))
        batch, lengths, prompts = make_batch(args.rows, args.min_len, args.max_len, args.prompt_min, args.prompt_max,
                                             args.seed)
        runs: dict[str, list[dict]] = {arm: [] for arm in arms}
        for repeat in range(args.repeats):
            for arm in arms:
                runs[arm].append(run_child(args, arm, repeat, work))
                r = runs[arm][-1]
                print(f"repeat {repeat} {arm}: forward {r['forward_s']:.3f} s, update {r['update_s']:.3f} s, "
                      f"peak RSS {r['rss_peak_mib']:.0f} MiB", file=sys.stderr, flush=True)
        checks = equality(work, arms, batch)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)

    params = runs[arms[0]][0]["parameters"]
    summary = {}
    for arm in arms:
        rs = runs[arm]
        def med(key: str, rs: list[dict] = rs) -> float:
            return statistics.median(r[key] for r in rs)

        tracked = rs[0].get("torch_memory", {}).get("cpu", {})
        cuda_peak = rs[0].get("cuda_peak_allocated_mib")
        summary[arm] = {
            "train": rs[0]["train"], "passes": rs[0]["passes"], "forward_positions": rs[0]["forward_positions"],
            "update_passes": rs[0]["update_passes"], "update_positions": rs[0]["update_positions"],
            "forward_s": med("forward_s"), "update_s": med("update_s"), "warmup_update_s": med("warmup_update_s"),
            "forward_tokens_per_s": rs[0]["real_tokens"] / med("forward_s"),
            "update_tokens_per_s": rs[0]["real_tokens"] / med("update_s"),
            "rss_peak_mib": med("rss_peak_mib"), "rss_peak_after_build_mib": med("rss_peak_after_build_mib"),
            "rss_added_mib": statistics.median(r["rss_peak_mib"] - r["rss_peak_after_build_mib"] for r in rs),
            "torch_peak_mib": tracked.get("Total") if cuda_peak is None else cuda_peak,
            "torch_peak_by_kind_mib": tracked or None,
            "max_weight_change": rs[0]["max_weight_change"],
            "per_repeat": {key: [r[key] for r in rs] for key in ("forward_s", "update_s", "rss_peak_mib",
                                                                  "process_wall_s", "load_average_1min")},
            "update_stats": rs[0]["update_stats"],
        }
    real = int(batch.attention_mask.sum())
    result = {
        "question": __doc__.split("\n\n")[0], "machine": {**machine(), "date": date, "gcore_rl_sha256_at_start": digest}, "wall_s": time.perf_counter() - started,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "model": model, "parameters": params, "threads": args.threads, "device": args.device, "bf16": args.bf16, "repeats": args.repeats, "arms": arms,
        "batch": {"rows": args.rows, "seed": args.seed, "completion_lengths": lengths, "prompt_lengths": prompts,
                  "completion_distribution": f"round(exp(U(ln {args.min_len}, ln {args.max_len})))",
                  "prompt_distribution": f"uniform integers {args.prompt_min}..{args.prompt_max}",
                  "shape": list(batch.input_ids.shape), "real_tokens": real,
                  "response_tokens": int(batch.response_mask.sum()),
                  "padding_fraction": 1 - real / batch.input_ids.numel()},
        "budget": args.budget, "summary": summary, "equality": checks,
        "equality_ok": all(c["init_logprobs_max_abs_diff"] < 1e-4 and c["logprobs_max_abs_diff"] < 1e-4
                           for c in checks.values()),
        "runs": runs,
    }
    text = table(summary, arms, checks, "packed+ac" in arms)
    print(f"batch {result['batch']['shape']}, {real} real tokens ({result['batch']['padding_fraction']:.0%} padding), "
          f"{args.repeats} repeats, {args.threads} thread(s), medians; wall {result['wall_s']:.0f} s\n")
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
