"""One log-prob pass of a LoRA policy against full fine-tuning: does the backward hold a base-sized tensor?

**Question.** In `benchmarks/memory.py`'s runs (BENCHMARKS.md, "Memory per role and phase") a LoRA trainer's
update phase rose about 1.3 times its frozen base above its prepare pass, with activation checkpointing on.
Is that a live tensor of the pass (a base-sized temporary in the backward of frozen layers) or memory the
heap keeps?

**Setup.** A Qwen2-0.5B-shaped model (hidden 896, MLP 4,864, 14/2 heads, vocabulary 151,936, tied
embeddings, fp32, random weights) cut to `--layers` layers, rank-16 adapters on every linear layer
(`models.lora.apply_lora`) or none, under FSDP2 on one rank (`training.fsdp.shard_model`, activation
checkpointing unless `--no-checkpointing`), in training mode. One pass as the actor's: `token_logprobs` of
16 rows × 38 tokens with the entropy, then `backward()` of the mean log-prob. Each variant runs in a fresh
process: the resident set before the pass, and the peak above it in the forward and in the backward
(`VmHWM` after a reset through `/proc/self/clear_refs`). With `--mmap-threshold N` the children run under
glibc's `MALLOC_MMAP_THRESHOLD_=N`, so freed tensors above N bytes go back to the system and the resident
set follows the live tensors.

    .venv/bin/python benchmarks/lora_pass_memory.py --layers 2 6 --mmap-threshold 65536
    .venv/bin/python benchmarks/lora_pass_memory.py --layers 6
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from logprob_memory import status_kib  # noqa: E402  (the same /proc/self/status reader)

MARKER = "LORA_PASS_MEMORY "


def child(kind: str, layers: int, checkpointing: bool) -> dict:
    """One pass of `kind` ("full" or "lora") in this process; MiB figures."""
    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gcore_rl.models.lora import LoraSettings, apply_lora
    from gcore_rl.training import logprobs
    from gcore_rl.training.fsdp import shard_model

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29631")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        torch.set_num_threads(1)
        torch.manual_seed(0)
        config = Qwen2Config(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                             num_hidden_layers=layers, vocab_size=151936, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(config)
        if kind == "lora":
            model = apply_lora(model, LoraSettings(enabled=True, rank=16, alpha=32))
        model = shard_model(model, activation_checkpointing=checkpointing)
        model.train()
        ids = torch.randint(0, 99, (16, 38), generator=torch.Generator().manual_seed(0))
        before = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
        scores, _ = logprobs.token_logprobs(model, ids, torch.ones_like(ids), temperature=1.0, with_entropy=True)
        forward = status_kib("VmHWM")
        Path("/proc/self/clear_refs").write_text("5")
        scores[:, 1:].mean().backward()
        backward = status_kib("VmHWM")
    finally:
        dist.destroy_process_group()
    return {"kind": kind, "layers": layers, "resident_mib": before / 1024, "forward_mib": (forward - before) / 1024,
            "backward_mib": (backward - before) / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--mmap-threshold", type=int, default=0, help="glibc MALLOC_MMAP_THRESHOLD_ (0 = glibc's default)")
    parser.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(MARKER + json.dumps(child(args.child[0], int(args.child[1]), not args.no_checkpointing)), flush=True)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    print(f"activation checkpointing {'off' if args.no_checkpointing else 'on'}; glibc mmap threshold "
          f"{args.mmap_threshold or 'default'}\n")
    print("| variant | layers | resident before (MiB) | forward peak above it (MiB) | backward peak above it (MiB) |")
    print("|---|---|---|---|---|")
    for layers in args.layers:
        for kind in ("full", "lora"):
            command = [sys.executable, __file__, "--child", kind, str(layers)] + (
                ["--no-checkpointing"] if args.no_checkpointing else [])
            done = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith(MARKER)]
            if done.returncode or not lines:
                raise SystemExit(f"{kind} {layers} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
            row = json.loads(lines[0].removeprefix(MARKER))
            print(f"| {kind} | {layers} | {row['resident_mib']:,.0f} | {row['forward_mib']:,.0f} | {row['backward_mib']:,.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
