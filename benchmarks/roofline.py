"""How far the engine's decode and the trainer's step are from the hardware's limits.

- **Decode vs the memory-bandwidth roofline.** A decode step must read every weight once and the
  keys/values of every live sequence: `bytes = weight bytes + B · context · kv bytes per token`.
  The bandwidth roofline is `bytes ÷ measured copy bandwidth` per step (a device-to-device `copy_`
  of a large buffer, counting the read and the write). The compute bound is the step's FLOPs ÷
  peak; the roofline is the larger of the two (on a GPU at these sizes the bandwidth term, on a
  2-core CPU the compute term). The engine's decode step time is measured as
  `(time of L new tokens − time of 1 new token) ÷ (L − 1)` at batch B, all rows decoding together.
- **Training MFU.** Forward + backward + AdamW step of the trainer's log-prob path
  (`gcore_rl.training.logprobs.token_logprobs`) on `B × T` tokens; model FLOPs per token =
  `6 · N_non-embedding + 6 · N_lm_head + 12 · layers · hidden · T` (attention scores and values,
  forward and backward, causal mask not discounted). MFU = achieved ÷ peak, where the peak is the
  data-sheet dense figure on a known GPU (`--peak-tflops`), else a measured large matmul (on CPU).

The model is built from a config with random weights: `--shape qwen2-0.5b` (hidden 896, 24 layers,
14/2 heads, MLP 4864, vocabulary 151936, the Qwen2-0.5B shape) or `--shape small` (the CPU
benchmark model). GPU runs use bf16, CPU runs fp32.

    .venv/bin/python benchmarks/roofline.py --shape small --out /tmp/bench/roofline.json      # CPU
    python benchmarks/roofline.py --shape qwen2-0.5b --peak-tflops 989 --out roofline.json    # H200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from engine_vs_generate import ENGINE_ARMS, engine_arm  # the engine configurations, by name
from transformers import Qwen2Config, Qwen2ForCausalLM

from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.training.logprobs import token_logprobs

SHAPES = {
    "qwen2-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                       intermediate_size=4864, vocab_size=151936),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=768, vocab_size=32000),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_of(fn, device: torch.device, repeats: int) -> float:
    """Fastest of `repeats` timed calls (after one warm-up), in seconds."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return min(times)


def copy_bandwidth(device: torch.device, mib: int, repeats: int = 5) -> float:
    """Bytes/s of a device-local `copy_` (read + write counted)."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = best_of(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() / seconds


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, repeats: int = 3) -> float:
    """FLOP/s of a square matmul (an achievable peak where no data-sheet figure is given)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / best_of(lambda: a @ b, device, repeats)


def kv_bytes_per_token(config: Qwen2Config, dtype: torch.dtype) -> int:
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * torch.finfo(dtype).bits // 8


def decode_flops_per_token(config: Qwen2Config, context: float) -> float:
    """Forward FLOPs of one decoded token: 2 per dense weight (LM head included) + attention over `context`."""
    return training_flops_per_token(config, 0) / 3 + 4 * config.num_hidden_layers * config.hidden_size * context


def decode_roofline(model, config, device, dtype, batch: int, prompt_len: int, new_tokens: int, bandwidth: float,
                    peak: float, arm: str = "default", repeats: int = 3) -> dict:
    """Measured decode step time of the engine arm `arm` (`ENGINE_ARMS`) vs the roofline at `batch` sequences: the
    larger of the memory time (weights + KV bytes ÷ bandwidth) and the compute time (FLOPs ÷ peak)."""
    engine = engine_arm(model, arm, batch)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(batch)]

    def run(tokens: int):
        return lambda: engine.generate(prompts, SamplingConfig(n=1, max_new_tokens=tokens, ignore_eos=True), seed=0)

    # the longer run first: the short one then decodes in the same KV pool (the static path attends over all of
    # its columns) and with the graphs captured for it
    full = best_of(run(new_tokens), device, repeats)
    one = best_of(run(1), device, repeats)
    step = (full - one) / (new_tokens - 1)
    weight_bytes = engine.weight_bytes()
    mean_context = prompt_len + new_tokens / 2
    kv_bytes = batch * mean_context * kv_bytes_per_token(config, dtype)
    memory_step = (weight_bytes + kv_bytes) / bandwidth
    compute_step = batch * decode_flops_per_token(config, mean_context) / peak
    roofline_step = max(memory_step, compute_step)
    return {"arm": arm, "cuda_graphs": engine.cuda_graphs, "graphs_captured": engine.capture.enabled, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "step_s": step,
            "tokens_per_s": batch / step, "weight_mib": weight_bytes / 2**20, "kv_read_mib": kv_bytes / 2**20,
            "memory_step_s": memory_step, "compute_step_s": compute_step,
            "bound": "memory" if memory_step >= compute_step else "compute",
            "roofline_step_s": roofline_step, "roofline_tokens_per_s": batch / roofline_step,
            "fraction_of_bandwidth_roofline": memory_step / step, "fraction_of_roofline": roofline_step / step}


def training_flops_per_token(config: Qwen2Config, seq_len: int) -> float:
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = h // config.num_attention_heads
    kv = config.num_key_value_heads * head_dim
    per_layer = h * h * 2 + 2 * h * kv + 3 * h * config.intermediate_size  # q, o, k, v, gate/up/down
    dense = layers * per_layer + h * config.vocab_size  # + LM head (the embedding lookup has no FLOPs)
    return 6 * dense + 12 * layers * h * seq_len


def training_mfu(model, config, device, dtype, batch: int, seq_len: int, peak: float, repeats: int) -> dict:
    """Achieved FLOP/s of forward + backward + AdamW over `batch × seq_len` tokens, and MFU."""
    model.train()
    for param in model.parameters():  # the engine froze them
        param.requires_grad_(True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (batch, seq_len), generator=g).to(device)
    mask = torch.ones_like(ids)

    def step():
        logprobs, _ = token_logprobs(model, ids, mask, 1.0)
        (-logprobs.mean()).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    seconds = best_of(step, device, repeats)
    flops = training_flops_per_token(config, seq_len) * batch * seq_len
    model.eval()
    return {"batch": batch, "seq_len": seq_len, "step_s": seconds, "tokens_per_s": batch * seq_len / seconds,
            "achieved_tflops": flops / seconds / 1e12, "peak_tflops": peak / 1e12, "mfu": flops / seconds / peak}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--batches", default="64,256", help="decode batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--train-batch", type=int, default=8)
    ap.add_argument("--train-seq", type=int, default=512)
    ap.add_argument("--peak-tflops", type=float, default=0.0,
                    help="data-sheet dense peak of the device (e.g. 989 for H100/H200 bf16); 0 = measure a matmul")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (CPU runs)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-arms", default="default",
                    help=f"engine configurations measured in turn, comma-separated, from {sorted(ENGINE_ARMS)}")
    ap.add_argument("--skip-train", action="store_true", help="decode only (no training MFU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    arms = args.engine_arms.split(",")
    if unknown := [arm for arm in arms if arm not in ENGINE_ARMS]:
        ap.error(f"unknown engine arms {unknown}; choose from {sorted(ENGINE_ARMS)}")

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.set_num_threads(args.threads)
    config = Qwen2Config(**SHAPES[args.shape], max_position_embeddings=4096, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval()
    params = sum(p.numel() for p in model.parameters())
    bandwidth = copy_bandwidth(device, 1024 if device.type == "cuda" else 256)
    peak = args.peak_tflops * 1e12 or matmul_peak(device, dtype, 8192 if device.type == "cuda" else 2048)
    info = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(), "dtype": str(dtype), "shape": args.shape, "parameters": params,
            "copy_bandwidth_gb_s": bandwidth / 1e9, "peak_tflops": peak / 1e12,
            "peak_source": "data sheet" if args.peak_tflops else "measured matmul",
            "torch": torch.__version__, "decode": [], "train": None}
    print(f"{info['device']}, {dtype}, {params / 1e6:.0f}M parameters; copy bandwidth {bandwidth / 1e9:.1f} GB/s; "
          f"peak {peak / 1e12:.2f} TFLOP/s ({info['peak_source']})", flush=True)
    for batch, arm in ((int(b), arm) for b in args.batches.split(",") for arm in arms):
        row = decode_roofline(model, config, device, dtype, batch, args.prompt_len, args.new_tokens, bandwidth, peak,
                              arm, args.repeats)
        info["decode"].append(row)
        save(info, args.out)  # after every row: a run cut short keeps the rows it measured
        print(f"decode batch {batch}, engine {arm}: {row['tokens_per_s']:.0f} tok/s, step {row['step_s'] * 1e3:.2f} ms; bandwidth "
              f"roofline {row['memory_step_s'] * 1e3:.2f} ms ({row['weight_mib']:.0f} MiB weights + {row['kv_read_mib']:.0f} "
              f"MiB KV) → {row['fraction_of_bandwidth_roofline']:.0%}; compute bound {row['compute_step_s'] * 1e3:.2f} ms; "
              f"{row['bound']}-bound → {row['fraction_of_roofline']:.0%} of roofline", flush=True)
    if not args.skip_train:
        info["train"] = t = training_mfu(model, config, device, dtype, args.train_batch, args.train_seq, peak,
                                         args.repeats)
        print(f"train {t['batch']}×{t['seq_len']} tokens: step {t['step_s']:.3f} s, {t['achieved_tflops']:.3f} TFLOP/s "
              f"→ MFU {t['mfu']:.1%}")
    save(info, args.out)
    return 0


def save(info: dict, out: str | None) -> None:
    """Write the results so far to `out` (if given) as JSON."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    sys.exit(main())
