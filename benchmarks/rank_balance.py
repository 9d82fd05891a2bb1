"""Cost-balanced rows over data-parallel trainer ranks (issue 21): the update's time on 2 FSDP ranks when a
long-tailed batch is split by `balance_rows` against an equal-count split in arrival order.

**Question.** The runtime splits each step's rows over its trainer ranks with `balance_rows` (equal row
counts, longest-first greedy over `SequenceCost`, `controller/slice.py: start_train`). Against the split
most trainers use by default (equal counts, rows in the order they arrived: rank r takes rows
r·n/m .. (r+1)·n/m - 1), how much shorter is the update when lengths span two orders of magnitude?

**Setup.** The model and batch of `benchmarks/long_tail.py` (init-tiny llama, hidden 256, 4 layers,
3.17M parameters, fp32, SDPA; `--rows` rows, prompts 12..20 tokens, completions log-uniform in 8..512,
advantages ±1), one batch per repeat (seed = `--seed` + repeat, so each repeat is another draw of the
same distribution). Two processes (a gloo group of 2, one torch thread each: on a 2-core machine each
rank has a core), `PolicyTrainer.build` with FSDP2 over both, `micro_batch_size` = `--rows`,
`max_tokens_per_micro_batch=--budget` (the fastest single-process setting of the long-tail benchmark;
ranks run as many passes as the busiest one). Each rank gets its part of the batch (`TokenBatch.select`);
one warm-up update, then one timed `PolicyTrainer.prepare` + `update` (prepare computes nothing here:
one optimiser step takes its old log-probs from the update's forward); a rank's time is its own wall time of the
update (FSDP's collectives make the faster rank wait for the slower, so both read about the step's
time), the arm's time the larger of the two. Arms, in the same processes one after another per
repeat, alternating which goes first: `in-order` and `balanced`, each from the same initial weights
(the model is rebuilt per arm).

Equality: the gradient is the sum over both ranks' rows, so the arms' updates are the same; the weights
after the timed update are compared (max |Δ|, next to the largest change the two updates made).

    .venv/bin/python benchmarks/rank_balance.py --out bench-results/rank_balance.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from long_tail import MODEL, machine, make_batch  # noqa: E402  (the same model and batch)

ARMS = ("in-order", "balanced")


def split(arm: str, tokens: list[int], cost, ranks: int) -> list[list[int]]:
    """Row indices of each rank under `arm`."""
    from gcore_rl.data.balance import balance_rows

    if arm == "balanced":
        return balance_rows([cost(t) for t in tokens], ranks)
    if len(tokens) % ranks:
        raise SystemExit(f"--rows {len(tokens)} does not divide over {ranks} ranks (the runtime refuses it too)")
    per = len(tokens) // ranks
    return [list(range(r * per, (r + 1) * per)) for r in range(ranks)]


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Path) -> None:
    import torch

    torch.set_num_threads(1)
    from gcore_rl.algos.config import AlgoConfig
    from gcore_rl.data.balance import SequenceCost, imbalance
    from gcore_rl.distributed import destroy_process_group, init_process_group
    from gcore_rl.training.actor import TrainConfig
    from gcore_rl.training.optim_step import full_tensor
    from gcore_rl.training.policy_trainer import PolicyTrainer

    cpu = torch.device("cpu")
    init_process_group(rank, world, port, cpu)
    model = Path(args.work_dir) / "model"
    cost = SequenceCost.from_config(json.loads((model / "config.json").read_text()))
    results = []
    try:
        for repeat in range(args.repeats):
            batch, _, _ = make_batch(args.rows, 8, 512, 12, 20, args.seed + repeat)
            tokens = batch.attention_mask.sum(dim=-1).tolist()
            for arm in (ARMS if repeat % 2 == 0 else ARMS[::-1]):
                parts = split(arm, tokens, cost, world)
                mine = batch.select(torch.tensor(parts[rank]))
                torch.manual_seed(0)
                train = TrainConfig(micro_batch_size=args.rows, max_tokens_per_micro_batch=args.budget)
                trainer = PolicyTrainer.build(model, dtype="float32", attn_implementation="sdpa", reference_path=None,
                                              train=train, algo=AlgoConfig(), logprob_temperature=1.0, device=cpu,
                                              bf16=False)
                initial = {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}
                trainer.update(mine, trainer.prepare(mine))  # warm-up
                shapes: list[tuple[int, ...]] = []  # [rows, positions] of every forward of the timed update
                hook = trainer.model.register_forward_pre_hook(
                    lambda _m, _a, kwargs, shapes=shapes: shapes.append(tuple(kwargs["input_ids"].shape)),
                    with_kwargs=True)
                torch.distributed.barrier()
                started = time.perf_counter()
                trainer.update(mine, trainer.prepare(mine))
                seconds = time.perf_counter() - started
                hook.remove()
                weights = {n: full_tensor(p.detach()).clone() for n, p in trainer.model.named_parameters()}
                if rank == 0:
                    torch.save(weights, out / f"weights-{repeat}-{arm}.pt")
                costs = [cost(t) for t in tokens]
                results.append({"repeat": repeat, "arm": arm, "rank": rank, "update_s": seconds,
                                "rank_tokens": int(sum(tokens[i] for i in parts[rank])),
                                "passes": len(shapes), "positions": sum(r * t for r, t in shapes),
                                "attention_positions": sum(r * t * t for r, t in shapes),
                                "cost_imbalance": imbalance(costs, parts), "token_imbalance": imbalance(tokens, parts),
                                "max_weight_change": max(float((weights[n] - initial[n]).abs().max()) for n in weights)})
                del trainer
    finally:
        destroy_process_group()
    (out / f"rank-{rank}.json").write_text(json.dumps(results))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None, help="Write the results as JSON here.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget", type=int, default=2048, help="train.max_tokens_per_micro_batch of both arms.")
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args()
    import subprocess

    import torch
    import torch.multiprocessing as mp

    from gcore_rl.distributed import free_port

    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="rank-balance-"))
    args.work_dir = str(work)
    if not (work / "model" / "config.json").exists():
        subprocess.run([sys.executable, "-m", "gcore_rl.cli", "init-tiny", str(work / "model"), *MODEL],
                       cwd=REPO, check=True, capture_output=True)
    started = time.perf_counter()
    mp.spawn(rank_main, args=(2, free_port(), args, work), nprocs=2, join=True)
    rows = [r for rank in (0, 1) for r in json.loads((work / f"rank-{rank}.json").read_text())]
    per_repeat = {}
    for repeat in range(args.repeats):
        arm_s = {arm: max(r["update_s"] for r in rows if r["repeat"] == repeat and r["arm"] == arm) for arm in ARMS}
        imb = {arm: next(r for r in rows if r["repeat"] == repeat and r["arm"] == arm) for arm in ARMS}
        weights = {arm: torch.load(work / f"weights-{repeat}-{arm}.pt") for arm in ARMS}
        diff = max(float((weights["balanced"][n] - w).abs().max()) for n, w in weights["in-order"].items())
        per_repeat[repeat] = {"update_s": arm_s, "speedup": arm_s["in-order"] / arm_s["balanced"],
                              "cost_imbalance": {a: imb[a]["cost_imbalance"] for a in ARMS},
                              "token_imbalance": {a: imb[a]["token_imbalance"] for a in ARMS},
                              "weights_max_abs_diff": diff, "max_weight_change": imb["balanced"]["max_weight_change"]}
        print(f"repeat {repeat}: in-order {arm_s['in-order']:.3f} s (cost imbalance "
              f"{imb['in-order']['cost_imbalance']:.3f}), balanced {arm_s['balanced']:.3f} s "
              f"({imb['balanced']['cost_imbalance']:.3f}); x{per_repeat[repeat]['speedup']:.2f}; weights differ by "
              f"{diff:.1e} (update moved them by up to {imb['balanced']['max_weight_change']:.1e})", flush=True)
    speedups = [v["speedup"] for v in per_repeat.values()]
    print(f"median speed-up of the update, balanced over in-order: x{statistics.median(speedups):.2f} "
          f"(per repeat {', '.join(f'{s:.2f}' for s in speedups)}); {time.perf_counter() - started:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"settings": vars(args), "machine": machine(), "per_repeat": per_repeat,
                                              "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
