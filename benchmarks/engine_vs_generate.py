"""Generation throughput: gcore-rl's engine vs `transformers` `generate`, same model, prompts and lengths.

Both sides sample (temperature 1, no top-k/top-p) from one saved Qwen2-shaped random model and
must produce exactly the same number of tokens per request: each request has a target length
drawn from a long-tailed (log-normal, capped) distribution.

- engine: `GenerationEngine(max_num_seqs=B)` with `ignore_eos` and per-request `max_new_tokens`
  (continuous batching: a finished request's slot is refilled at once);
- generate: the requests in consecutive batches of B, left-padded, each `generate` call running
  `max_new_tokens = the batch's longest target` with a logits processor that bans EOS before a
  row's target and forces it at the target (so a row yields exactly `target` tokens, EOS included,
  and then pads until its batch's longest row is done).

Runs alternate engine / generate (A/B/A/B) in one process after a warm-up of each; tokens/s are
medians over repeats and the ratio is the median of the per-pair ratios. `--engine-arms` times several
engine configurations in the same rounds (`ENGINE_ARMS`: `default` = the device's defaults, CUDA graphs
and a read every 8 rounds on a GPU; `eager` = no graphs; `eager-sync` = no graphs and a read every round,
the engine before issue 49), so what each of issue 49's changes buys is measured side by side. `--fixed-length L` also
times `transformers`' own continuous batching (`generate_batch`, paged cache) on equal-length
requests, the candidate the engine was chosen against. `--profile` prints the top operators of one
run of each side under the torch profiler.

    .venv/bin/python benchmarks/engine_vs_generate.py --out /tmp/bench/engine.json
    .venv/bin/python benchmarks/engine_vs_generate.py --quick
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.sampling import SamplingConfig

EOS, PAD = 1, 0

ENGINE_ARMS: dict[str, dict] = {
    "default": {},
    "eager": {"cuda_graphs": False},
    "eager-sync": {"cuda_graphs": False, "finish_check_every": 1},
}
"""Engine configurations by name: `GenerationEngine` keyword arguments over the device's defaults."""


def engine_arm(model, name: str, batch: int, finish_check_every: int = 0) -> GenerationEngine:
    """The engine of arm `name` (`ENGINE_ARMS`) with `batch` slots; `finish_check_every` applies where the arm
    leaves it to the device."""
    kwargs = {"finish_check_every": finish_check_every, **ENGINE_ARMS[name]}
    return GenerationEngine(model, EOS, PAD, max_num_seqs=batch, **kwargs)


@dataclass
class Workload:
    """Requests of one batch size: prompt token ids and each request's exact completion length."""

    prompts: list[list[int]]
    targets: list[int]

    @property
    def tokens(self) -> int:
        return sum(self.targets)


def make_workload(requests: int, vocab: int, seed: int, prompt_len: tuple[int, int], median: float,
                  sigma: float, cap: int) -> Workload:
    """Random prompts (uniform lengths) and log-normal completion lengths `median·e^(σZ)`, in [2, cap]."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(prompt_len[0], prompt_len[1] + 1, (requests,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
    z = torch.randn(requests, generator=g).tolist()
    targets = [min(cap, max(2, round(median * math.exp(sigma * x)))) for x in z]
    return Workload(prompts, targets)


class ExactLength(LogitsProcessor):
    """Row r of a `generate` batch emits EOS exactly as its `targets[r]`-th token and never before."""

    def __init__(self, targets: list[int], prompt_width: int):
        self.targets = torch.tensor(targets)
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_width  # tokens generated so far
        last = (self.targets - 1 == step).to(scores.device)
        scores[~last, EOS] = float("-inf")
        scores[last] = float("-inf")
        scores[last, EOS] = 0.0
        return scores


def run_generate(model, work: Workload, batch: int, seed: int) -> int:
    """`transformers` generate over consecutive batches; returns the tokens generated (EOS included)."""
    torch.manual_seed(seed)
    produced = 0
    for first in range(0, len(work.prompts), batch):
        prompts, targets = work.prompts[first:first + batch], work.targets[first:first + batch]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        ids, mask = ids.to(model.device), mask.to(model.device)
        config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(targets),
                                  eos_token_id=EOS, pad_token_id=PAD)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                 logits_processor=LogitsProcessorList([ExactLength(targets, width)]))
        new = out[:, width:]
        ends = (new == EOS).int().argmax(dim=-1) + 1
        ends = ends.cpu()
        if ends.tolist() != targets:
            raise RuntimeError(f"generate produced lengths {ends.tolist()} instead of {targets}")
        produced += int(ends.sum())
    return produced


def run_engine(engine: GenerationEngine, work: Workload, seed: int) -> int:
    params = SamplingConfig(n=1, temperature=1.0, ignore_eos=True, max_new_tokens=max(work.targets))
    completions = engine.generate(work.prompts, params, seed=seed, max_new_tokens=work.targets)
    lengths = [len(c.token_ids) for c in completions]
    if lengths != work.targets:
        raise RuntimeError("engine produced lengths different from the targets")
    return sum(lengths)


def run_generate_batch(model, work: Workload, seed: int) -> int:
    """`transformers` continuous batching (paged cache); only for equal-length requests."""
    torch.manual_seed(seed)
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=work.targets[0],
                              eos_token_id=EOS, pad_token_id=PAD)
    out = model.generate_batch(inputs=work.prompts, generation_config=config, progress_bar=False)
    return sum(len(o.generated_tokens) for o in out.values())


def timed(fn) -> tuple[float, int]:
    start = time.perf_counter()
    tokens = fn()
    return time.perf_counter() - start, tokens


def profile(label: str, fn, rows: int = 12) -> str:
    """Top operators of one run by self CPU time (torch profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return f"### {label}\n{table}"


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor()) if os.path.exists("/proc/cpuinfo") else platform.processor()
    import transformers
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "threads": torch.get_num_threads(),
            "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="8:32,64:256,256:512",
                    help="BATCH:REQUESTS pairs: concurrent sequences and requests served (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--median-len", type=float, default=24.0, help="median completion length (tokens)")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of completion lengths")
    ap.add_argument("--cap", type=int, default=256, help="longest completion (tokens)")
    ap.add_argument("--prompt-len", default="16:64", help="prompt length range MIN:MAX (tokens)")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--intermediate-size", type=int, default=768)
    ap.add_argument("--vocab-size", type=int, default=32000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="where both sides run (cpu or cuda)")
    ap.add_argument("--finish-check-every", type=int, default=0,
                    help="the engine's finish_check_every (0: by device, 1 on a CPU and 8 on CUDA)")
    ap.add_argument("--engine-arms", default="default",
                    help=f"engine configurations timed side by side, comma-separated, from {sorted(ENGINE_ARMS)}")
    ap.add_argument("--fixed-length", type=int, default=0,
                    help="also time transformers generate_batch on equal-length requests of this many tokens (batch 64)")
    ap.add_argument("--profile", action="store_true", help="print torch-profiler tables of one run per side")
    ap.add_argument("--quick", action="store_true", help="smoke run: batches 8:16,64:64, 1 repeat, cap 64")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--out", default=None, help="write raw results as JSON here")
    args = ap.parse_args(argv)
    if args.quick:
        args.batches, args.repeats, args.cap = "8:16,64:64", 1, 64
    args.engine_arms = args.engine_arms.split(",")
    if unknown := [arm for arm in args.engine_arms if arm not in ENGINE_ARMS]:
        ap.error(f"unknown engine arms {unknown}; choose from {sorted(ENGINE_ARMS)}")
    torch.set_num_threads(args.threads)

    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="engine-bench-"))
    model_dir = work_dir / "model"
    shape = TinyModelConfig(arch="qwen2", hidden_size=args.hidden_size, num_layers=args.num_layers,
                            intermediate_size=args.intermediate_size, vocab_size=args.vocab_size,
                            max_positions=2048, num_heads=4, num_kv_heads=2)
    write_tiny_model(model_dir, shape)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval().to(args.device)
    params = sum(p.numel() for p in model.parameters())
    info = {"machine": machine(), "model": {**asdict(shape), "parameters": params}, "args": vars(args), "rows": []}
    print(f"model: qwen2-shaped, {params / 1e6:.1f}M parameters; {info['machine']}", flush=True)
    lo, hi = (int(x) for x in args.prompt_len.split(":"))

    for pair in args.batches.split(","):
        batch, requests = (int(x) for x in pair.split(":"))
        work = make_workload(requests, args.vocab_size, seed=batch, prompt_len=(lo, hi), median=args.median_len,
                             sigma=args.sigma, cap=args.cap)
        engines = {arm: engine_arm(model, arm, batch, args.finish_check_every) for arm in args.engine_arms}
        warm = Workload(work.prompts[:batch], [4] * min(batch, requests))
        for engine in engines.values():
            run_engine(engine, warm, 0)
        run_generate(model, warm, batch, 0)
        engine_s: dict[str, list[float]] = {arm: [] for arm in engines}
        generate_s = []
        for rep in range(args.repeats):
            for arm, engine in engines.items():
                seconds, _ = timed(lambda e=engine, w=work, r=rep: run_engine(e, w, r))
                engine_s[arm].append(seconds)
            seconds, _ = timed(lambda w=work, b=batch, r=rep: run_generate(model, w, b, r))
            generate_s.append(seconds)
            print(f"  batch {batch} repeat {rep}: "
                  + ", ".join(f"{arm} {work.tokens / times[-1]:.0f}" for arm, times in engine_s.items())
                  + f", generate {work.tokens / generate_s[-1]:.0f} tok/s", flush=True)
        arms = {}
        for arm, engine in engines.items():
            stats = engine.last_stats
            arms[arm] = {"engine_s": engine_s[arm], "engine_tok_s": work.tokens / statistics.median(engine_s[arm]),
                         "ratio_median": statistics.median(g / e for e, g in zip(engine_s[arm], generate_s, strict=True)),
                         "engine_mean_batch": stats.mean_batch, "engine_prefills": stats.prefills,
                         "engine_decode_steps": stats.decode_steps, "engine_host_syncs": stats.host_syncs,
                         "cuda_graphs": engine.cuda_graphs, "graphs_captured": engine.capture.enabled,
                         "finish_check_every": engine.finish_check_every}
        first = arms[args.engine_arms[0]]
        row = {"batch": batch, "requests": requests, "tokens": work.tokens, "mean_len": work.tokens / requests,
               "max_len": max(work.targets), "generate_s": generate_s,
               "generate_tok_s": work.tokens / statistics.median(generate_s), **first, "arms": arms,
               "generate_steps": sum(max(work.targets[i:i + batch]) for i in range(0, requests, batch))}
        info["rows"].append(row)
        save(info, args.out)  # after every batch size: a run cut short keeps the rows it measured
        if args.profile:
            for arm, engine in engines.items():
                print(profile(f"engine ({arm}), batch {batch}", lambda e=engine, w=work: run_engine(e, w, 0)))
            print(profile(f"generate, batch {batch}", lambda w=work, b=batch: run_generate(model, w, b, 0)))

    if args.fixed_length:
        work = make_workload(64, args.vocab_size, seed=7, prompt_len=(lo, hi), median=args.fixed_length, sigma=0.0,
                             cap=args.fixed_length)
        engine = GenerationEngine(model, EOS, PAD, max_num_seqs=64)
        paged = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="paged|sdpa").eval()
        fixed = {}
        for label, fn in (("engine", lambda: run_engine(engine, work, 0)),
                          ("generate", lambda: run_generate(model, work, 64, 0)),
                          ("generate_batch", lambda: run_generate_batch(paged, work, 0))):
            fn()  # warm-up
            seconds, tokens = timed(fn)
            fixed[label] = tokens / seconds
        info["fixed_length"] = {"length": args.fixed_length, "batch": 64, "tok_s": fixed}
        print(f"fixed length {args.fixed_length}, batch 64: "
              + ", ".join(f"{k} {v:.0f} tok/s" for k, v in fixed.items()))

    info["machine"]["load_average_after"] = os.getloadavg()
    print("\n| batch | requests | tokens | mean / max length | engine arm | engine tok/s | generate tok/s "
          "| speed-up (median of pairs) | engine mean batch | host reads | decode steps engine / generate |")
    print("|--:|--:|--:|--:|---|--:|--:|--:|--:|--:|--:|")
    for r in info["rows"]:
        for arm, a in r["arms"].items():
            print(f"| {r['batch']} | {r['requests']} | {r['tokens']} | {r['mean_len']:.1f} / {r['max_len']} | {arm} "
                  f"| {a['engine_tok_s']:.0f} | {r['generate_tok_s']:.0f} | {a['ratio_median']:.2f}× "
                  f"| {a['engine_mean_batch']:.1f} | {a['engine_host_syncs']} "
                  f"| {a['engine_decode_steps']} / {r['generate_steps']} |")
    save(info, args.out)
    return 0


def save(info: dict, out: str | None) -> None:
    """Write the results so far to `out` (if given) as JSON."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    sys.exit(main())
