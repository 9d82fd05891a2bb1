"""Peak memory of the trainer's log-prob pass with and without the chunked LM head (issue 46).

**Question.** At a real vocabulary the `[tokens, V]` logits and their gradient are the largest tensors
of a training pass. How much lower is the peak memory of one log-prob pass (forward + backward) when the
head is scored in chunks inside the forward (`gcore_rl.training.chunked_head`) than when the logits are
materialised (`gcore_rl.training.logprobs.CHUNKED_HEAD = False`, the path before issue 46)? The issue's
criterion: at least 4× lower.

**Setup.** A Qwen2-0.5B-shaped model built locally with random weights (`Qwen2ForCausalLM`, hidden 896,
14 heads, 2 key/value heads, MLP 4,864, vocabulary 151,936, tied embeddings, fp32, SDPA attention) but
with `--layers` decoder layers (default 2: the head's memory does not depend on the depth; the layers'
activations are what both variants share). A batch of `--rows` × `--tokens` random token ids (default
8 × 1,024, no padding), every position after the first scored. One pass = `token_logprobs(model, ids,
mask, temperature=0.9, with_entropy=True)` then `backward()` of the mean log-prob (the entropy as the
metric, no entropy bonus), as an actor's micro-batch does, in the variants `full-logits` and `chunked`;
the variant `no-head` runs the decoder alone (`model.model`, same inputs) with a stand-in loss on its last
hidden states, to tell what the head and its scoring add from what the layers need in any case. With
`--activation-checkpointing` each decoder layer keeps only its input and is recomputed in the backward, as
`train.activation_checkpointing` runs the trainer: the layers' share shrinks, the head's stays. Each
variant runs in a fresh process per repeat (variants interleaved within a repeat): build the model and the
batch, read the resident set (`VmRSS`), reset the process's peak (`/proc/self/clear_refs` ← 5), run the
pass, read the peak (`VmHWM`). Reported per variant, medians over `--repeats`: the pass's peak above the
resident set before it (what the pass itself needed), that minus `no-head`'s (what the head added), the
process's peak, and the pass's seconds (information only: the chunked head does one more head matmul in
the backward). The check that both head variants computed the same thing: the mean log-prob and the norm
of the embedding's gradient, per variant.

    .venv/bin/python benchmarks/logprob_memory.py --out bench-results/logprob_memory.json   # ~20 min, ~14 GB
    .venv/bin/python benchmarks/logprob_memory.py --activation-checkpointing                # as train.activation_checkpointing
    .venv/bin/python benchmarks/logprob_memory.py --quick                                   # smoke: V = 32,768
    python3 benchmarks/logprob_memory.py --device cuda --layers 24 --out OUT/logprob_memory_cuda.json

On a GPU (`--device cuda`) the model and batch live on the device and the figures are the CUDA caching
allocator's (`torch.cuda.memory_allocated` before the pass, `max_memory_allocated` after it, peaks reset
between), so "before" is the model and batch and "process peak" is the device's peak; with `--bf16` the pass
runs under bf16 autocast, as `train.bf16` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from long_tail import machine  # noqa: E402  (the same machine record)

VARIANTS = ("full-logits", "chunked", "no-head")
RESULT_MARKER = "LOGPROB_MEMORY_RESULT "
QWEN2_0_5B = dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14, num_key_value_heads=2,
                  vocab_size=151936)


def status_kib(field: str) -> int:
    """A `/proc/self/status` field in KiB (`VmRSS`, `VmHWM`)."""
    line = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith(field + ":"))
    return int(line.split()[1])


def child(args: argparse.Namespace) -> None:
    """One variant's pass in this (fresh) process; prints its figures as one JSON line."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gcore_rl.training import logprobs as lp

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    lp.CHUNKED_HEAD = args.child == "chunked"
    shape = dict(QWEN2_0_5B, vocab_size=args.vocab)
    config = Qwen2Config(**shape, num_hidden_layers=args.layers, max_position_embeddings=max(2048, args.tokens),
                         tie_word_embeddings=True, torch_dtype="float32")
    device = torch.device(args.device)
    model = Qwen2ForCausalLM(config).to(device)
    if args.activation_checkpointing:  # as `train.activation_checkpointing` sets it (gcore_rl.training.fsdp)
        model.activation_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(0, args.vocab, (args.rows, args.tokens), generator=torch.Generator().manual_seed(args.seed))
    ids = ids.to(device)
    mask = torch.ones_like(ids)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before_kib = torch.cuda.memory_allocated() / 1024
    else:
        before_kib = status_kib("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the resident set now
    started = time.perf_counter()
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and args.bf16)
    with autocast:
        loss = _pass(model, ids, mask, args.child, lp)
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    peak_kib = torch.cuda.max_memory_allocated() / 1024 if cuda else status_kib("VmHWM")
    print(RESULT_MARKER + json.dumps({
        "variant": args.child, "before_gib": before_kib / 2**20, "peak_gib": peak_kib / 2**20,
        "pass_peak_gib": (peak_kib - before_kib) / 2**20, "pass_s": seconds, "loss": float(loss),
        "embedding_grad_norm": float(model.get_input_embeddings().weight.grad.norm()),
        "logits_gib": args.rows * args.tokens * args.vocab * 4 / 2**30}), flush=True)


def _pass(model, ids, mask, variant: str, lp):
    """The loss of one pass of `variant` (its forward; the caller runs the backward)."""
    if variant == "no-head":  # the decoder alone, a stand-in loss on its last hidden states
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False,
                             **lp.position_inputs(model, ids, mask)).last_hidden_state
        return hidden[:, :-1].float().mean()
    logprobs, _ = lp.token_logprobs(model, ids, mask, temperature=0.9, with_entropy=True)
    return logprobs[:, 1:].mean()


def run_variant(variant: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", variant, "--rows", str(args.rows), "--tokens", str(args.tokens),
               "--vocab", str(args.vocab), "--layers", str(args.layers), "--threads", str(args.threads),
               "--seed", str(args.seed), "--device", args.device] + (["--bf16"] if args.bf16 else []) + (
                   ["--activation-checkpointing"] if args.activation_checkpointing else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if done.returncode or not lines:
        raise SystemExit(f"{variant} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(lines[0].removeprefix(RESULT_MARKER))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=QWEN2_0_5B["vocab_size"])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="On CUDA: the pass under bf16 autocast.")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="Recompute each decoder layer in the backward (train.activation_checkpointing).")
    parser.add_argument("--quick", action="store_true", help="Smoke run: V = 32,768, 2 rows, 1 repeat.")
    parser.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.vocab, args.rows, args.repeats = 32768, 2, 1
    started = time.perf_counter()
    runs = []
    for repeat in range(args.repeats):
        for variant in VARIANTS:
            result = run_variant(variant, args)
            runs.append({"repeat": repeat, **result})
            print(f"repeat {repeat} {variant:>11}: pass peak {result['pass_peak_gib']:.2f} GiB (process "
                  f"{result['peak_gib']:.2f} GiB), {result['pass_s']:.1f} s, loss {result['loss']:.6f}", flush=True)
    summary = {variant: {key: statistics.median(r[key] for r in runs if r["variant"] == variant)
                         for key in ("pass_peak_gib", "peak_gib", "before_gib", "pass_s")} for variant in VARIANTS}
    body = summary["no-head"]["pass_peak_gib"]
    for row in summary.values():
        row["head_gib"] = row["pass_peak_gib"] - body
    ratio = summary["full-logits"]["pass_peak_gib"] / summary["chunked"]["pass_peak_gib"]
    head_ratio = summary["full-logits"]["head_gib"] / summary["chunked"]["head_gib"]
    print(f"\n{args.rows} rows x {args.tokens} tokens, V = {args.vocab:,}, {args.layers} layers{' (activation checkpointing)' if args.activation_checkpointing else ''}, "
          f"{args.device}, {'bf16 autocast' if args.bf16 else 'fp32'}, "
          f"{args.threads} threads; [tokens, V] fp32 logits = {runs[0]['logits_gib']:.2f} GiB; medians of {args.repeats}")
    print("| variant | pass peak (GiB) | above no-head (GiB) | process peak (GiB) | before the pass (GiB) | pass (s) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for variant, row in summary.items():
        print(f"| {variant} | {row['pass_peak_gib']:.2f} | {row['head_gib']:.2f} | {row['peak_gib']:.2f} | "
              f"{row['before_gib']:.2f} | {row['pass_s']:.1f} |")
    checks = {variant: next(r for r in runs if r["variant"] == variant) for variant in VARIANTS[:2]}
    print(f"pass peak, full-logits / chunked: x{ratio:.2f} (criterion: at least x4); above no-head: x{head_ratio:.1f}; "
          "mean log-prob " + ", ".join(f"{v} {c['loss']:.6f}" for v, c in checks.items()) + "; embedding grad norm "
          + ", ".join(f"{v} {c['embedding_grad_norm']:.6f}" for v, c in checks.items())
          + f"; {time.perf_counter() - started:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "machine": machine(), "summary": summary,
                                              "ratio": ratio, "head_ratio": head_ratio, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
