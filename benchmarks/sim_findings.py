"""The simulator findings of docs/simulator-findings.md: every table and figure there comes from this script.

    .venv/bin/python benchmarks/sim_findings.py --figures docs/figures            # all sections (~1.5 min)
    .venv/bin/python benchmarks/sim_findings.py --only b --figures /tmp/figs      # one section

Sections: (a) 64 GPUs, judge as large as the policy; (b) colocate's swap cost as dynamic sampling
needs more waves; (c) 512 GPUs with multimodal payload, 1 vs 8 vs 64 controllers; (d) where dynamic
placement does not help; (e) dynamic from any start, the convergence sweep (~4 min); (f) where
dynamic gains 1.5x over colocate; (g) re-splitting between waves; (h) moving devices between slices; (p) the figures G-Core publishes; (s) sequence parallelism in the update; (t) the update's split over the trainer ranks; (u) the headline figures over their assumed inputs (~30 s);
(v) verl's published colocate and
fully-async runs against the simulator (~25 min: it fits constants 9 times); (w) agents whose turns wait on tools. Markdown tables go to stdout; PNG figures
to --figures. Nothing here needs a GPU: it only runs `gcore_rl.sim`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from simlab import convergence, published, slice_moves

from gcore_rl.costmodel import cost, phases, replay
from gcore_rl.costmodel.models import MODELS
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.costmodel.work import StepWork
from gcore_rl.sim import SimResult, load_scenario, resolve_job, run_scenario, strategies
from gcore_rl.sim.report import gantt_png, markdown_table
from gcore_rl.sim.simulator import workload_steps

ROOT = Path(__file__).resolve().parents[1]
S64 = ROOT / "scenarios" / "gpus64_judge.yaml"
S512 = ROOT / "scenarios" / "gpus512_multimodal.yaml"
SPUB = ROOT / "scenarios" / "published_gcore_swap32b.yaml"
SGAIN = ROOT / "scenarios" / "gcore_gain32b.yaml"
SAGENT = ROOT / "scenarios" / "agent_tools_8.yaml"


def run(path: Path, *overrides: str) -> list[SimResult]:
    return run_scenario(load_scenario(path, list(overrides)))


def by_strategy(results: Sequence[SimResult]) -> dict[str, SimResult]:
    return {r.strategy: r for r in results}


def mean_rollout(result: SimResult) -> float:
    return float(np.mean([s.rollout_seconds for s in result.steps]))


def best_static_split(path: Path, *overrides: str) -> tuple[int, float]:
    """The `partial` split (rollout devices per slice) with the shortest mean step, and that step."""
    job = resolve_job(load_scenario(path, list(overrides)))
    unit = job.rebalance.unit
    steps = {r: run(path, "strategies=[partial]", *overrides, f"placement.rollout_devices={r}")[0].mean_step_seconds
             for r in range(job.policy_tp, job.slice_devices - job.judge_tp + 1, unit)}
    best = min(steps, key=steps.__getitem__)
    return best, steps[best]


def table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(v: object) -> str:
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def section_a(figures: Path | None) -> None:
    print("## (a) 64 GPUs, judge as large as the policy\n")
    print("`gcore-rl simulate scenarios/gpus64_judge.yaml` (5 strategies, 20 steps):\n")
    results = run(S64)
    print(markdown_table(results))
    split = run(S64, "strategies=[partial, dynamic]", "placement.rollout_devices=6")
    print("Same job, static split 6 rollout + 2 judge devices per slice "
          "(`placement.rollout_devices=6 strategies=[partial,dynamic]`):\n")
    print(markdown_table(split))
    dyn = by_strategy(split)["dynamic"]
    print(f"dynamic's split per step: {[s.rollout_devices for s in dyn.steps]}\n")
    if figures is not None:
        for r in results:
            if r.strategy in ("colocate", "partial", "disaggregated"):
                gantt_png(r, figures / f"gpus64-gantt-{r.strategy}.png", steps=2)


def section_b(figures: Path | None) -> None:
    print("## (b) colocate's swap cost as dynamic sampling needs more waves\n")
    print("`scenarios/gpus64_judge.yaml` with a constant valid fraction v "
          "(`workload.valid_fraction.start=v workload.valid_fraction.end=v workload.response_growth=0 "
          "workload.dynamic_sampling.max_waves=5 strategies=[colocate,partial]`), for engine_wake_s = 5 s "
          "(default) and 30 s (G-Core's reported 32B swap):\n")
    fractions = [1.0, 0.6, 0.4, 0.25, 0.15, 0.1, 0.06]
    rows, curves = [], {}
    for wake in (5.0, 30.0):
        for v in fractions:
            res = by_strategy(run(S64, f"workload.valid_fraction.start={v}", f"workload.valid_fraction.end={v}",
                                  "workload.response_growth=0", "workload.dynamic_sampling.max_waves=5",
                                  "strategies=[colocate, partial]", f"costs.engine_wake_s={wake}"))
            col, par = res["colocate"], res["partial"]
            waves = float(np.mean([s.waves for s in col.steps]))
            swap = col.mean_phases()["swap"]
            rows.append([f"{wake:g}", f"{v:g}", f"{waves:.2f}", swap, f"{100 * swap / col.mean_step_seconds:.1f}%",
                         par.mean_phases()["swap"], col.mean_step_seconds, par.mean_step_seconds,
                         f"{100 * (1 - par.mean_step_seconds / col.mean_step_seconds):.1f}%"])
            curves.setdefault(wake, []).append((waves, swap, col.mean_step_seconds - par.mean_step_seconds))
    print(table(["engine_wake_s", "valid fraction", "waves/step", "colocate swap s/step", "swap share",
                 "partial swap s/step", "colocate step s", "partial step s", "partial saves"], rows))
    if figures is not None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        for wake, points in curves.items():
            w, s, gap = zip(*points, strict=True)
            ax.plot(w, s, "o-", label=f"colocate swap, engine_wake_s={wake:g}")
            ax.plot(w, gap, "s--", label=f"colocate - partial step, engine_wake_s={wake:g}")
        ax.set_xlabel("dynamic-sampling waves per step (mean)")
        ax.set_ylabel("seconds per step")
        ax.set_title("64 x H100, 7B policy + 7B judge", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(figures / "swap-vs-waves.png", dpi=110)
        plt.close(fig)


def section_c(figures: Path | None) -> None:
    print("## (c) 512 GPUs, multimodal payload: 1 vs 8 vs 64 controllers\n")
    print("`gcore-rl simulate scenarios/gpus512_multimodal.yaml` (sweep `controllers: [1, 8, 64]`):\n")
    results = run(S512)
    print(markdown_table(results))
    rows = []
    for r in results:
        if r.strategy != "colocate":
            continue
        ph = r.mean_phases()
        waves = float(np.mean([s.waves for s in r.steps]))
        rows.append([r.controllers, f"{r.gpus // r.controllers}", f"{waves:.2f}", ph["rollout/data"],
                     ph["rollout/data"] / waves, ph["update/data"], r.mean_step_seconds,
                     f"{100 * (ph['rollout/data'] + ph['update/data']) / r.mean_step_seconds:.1f}%"])
    print("colocate, the controller data plane per step:\n")
    print(table(["controllers", "GPUs per slice", "waves/step", "rollout/data s", "per wave s", "update/data s",
                 "step s", "data share"], rows))
    if figures is not None:
        for r in results:
            if r.strategy == "colocate" and r.controllers in (1, 64):
                gantt_png(r, figures / f"gpus512-gantt-colocate-K{r.controllers}.png", steps=2)


def section_d(figures: Path | None) -> None:
    print("## (d) where dynamic placement does not help\n")
    cases = [
        ("balanced (base scenario, 4+4)", S64, []),
        ("static split starves the judge (6+2)", S64, ["placement.rollout_devices=6"]),
        ("static split starves generation (2+6)", S64, ["placement.rollout_devices=2"]),
        ("judge tiny (0.5B) vs 7B policy, 4+4", S64, ["models.judge.preset=Qwen2.5-0.5B",
                                                      "workload.judge_output_tokens.median=64"]),
        ("heavy judge, 16-GPU slices, 8+8", S64, ["controllers=4", "placement.rollout_devices=8",
                                                  "workload.judge_output_tokens.median=1200"]),
        ("6+2 split, only 3 steps", S64, ["placement.rollout_devices=6", "steps=3"]),
    ]
    rows = []
    for label, path, extra in cases:
        res = by_strategy(run(path, "strategies=[colocate, partial, dynamic]", *extra))
        col, par, dyn = res["colocate"], res["partial"], res["dynamic"]
        splits = [s.rollout_devices for s in dyn.steps]
        fixed = [f"{s.generate_fixed_seconds:.0f} / {s.judge_fixed_seconds:.1f}" for s in dyn.steps[:1]][0]
        best, best_s = best_static_split(path, *[o for o in extra if not o.startswith("placement.rollout_devices")])
        rows.append([label, col.mean_step_seconds, par.mean_step_seconds, dyn.mean_step_seconds,
                     f"{100 * (dyn.mean_step_seconds / par.mean_step_seconds - 1):+.1f}%",
                     f"{splits[0]}->{splits[-1]}", fixed, f"{best}: {best_s:.1f}", mean_rollout(par), mean_rollout(dyn)])
    print("`scenarios/gpus64_judge.yaml` with the overrides named in each row "
          "(`strategies=[colocate,partial,dynamic]`); g / s: the fixed parts dynamic fed the rebalancer "
          "after step 0 (seconds per device); best static split: `partial` over every split:\n")
    print(table(["case", "colocate step s", "partial step s", "dynamic step s", "dynamic vs partial",
                 "dynamic split (first->last)", "g / s after step 0", "best static split: step s",
                 "partial rollout s", "dynamic rollout s"], rows))
    heavy = ["controllers=4", "placement.rollout_devices=8", "workload.judge_output_tokens.median=1200"]
    base = by_strategy(run(S64, "strategies=[partial, dynamic]", *heavy))
    print("What the rebalancer sees in the heavy-judge case (per 16-GPU slice, per step; busy in device-seconds, "
          "fixed parts in seconds per device):\n")
    rows = []
    for name in ("partial", "dynamic"):
        for s in base[name].steps[:4]:
            rows.append([name, s.step, s.rollout_devices, s.generate_device_seconds, s.generate_fixed_seconds,
                         s.judge_device_seconds, s.judge_fixed_seconds, s.rollout_seconds])
    print(table(["strategy", "step", "rollout devices", "generate busy device-s", "generate fixed g s",
                 "judge busy device-s", "judge fixed s s", "rollout s"], rows))
    print(f"dynamic, heavy judge, split per step: {[s.rollout_devices for s in base['dynamic'].steps]}\n")
    print(f"dynamic's decisions, heavy judge: {[s.decision for s in base['dynamic'].steps[:4]]}\n")


def section_p(figures: Path | None) -> None:
    print("## (p) G-Core's published figures\n")
    rows = []
    for wake in (5.0, 30.0, 55.0):
        res = by_strategy(run(SPUB, f"costs.engine_wake_s={wake}"))
        col, par, dyn = res["colocate"], res["partial"], res["dynamic"]
        job = resolve_job(load_scenario(SPUB, [f"costs.engine_wake_s={wake}"]))
        swap = phases.policy_offload_seconds(job) + phases.judge_wake_seconds(job)
        rows.append([f"{wake:g}", swap, mean_rollout(col), mean_rollout(par),
                     f"{100 * (1 - mean_rollout(par) / mean_rollout(col)):.1f}%",
                     f"{100 * (1 - mean_rollout(dyn) / mean_rollout(col)):.1f}%",
                     col.mean_step_seconds, par.mean_step_seconds])
    print("`gcore-rl simulate scenarios/published_gcore_swap32b.yaml costs.engine_wake_s=W` "
          "(reported: 32B swap 30-60 s; partial rollout -16.2 % to -24.1 % vs colocate):\n")
    print(table(["engine_wake_s", "32B swap s (policy out + judge in)", "colocate rollout s", "partial rollout s",
                 "partial vs colocate", "dynamic vs colocate", "colocate step s", "partial step s"], rows))


def section_e(figures: Path | None) -> None:
    print("## (e) dynamic from any start: the convergence sweep\n")
    outcomes = convergence.run_sweep()
    print(convergence.markdown_table(outcomes) + "\n")
    worst = max(outcomes, key=lambda o: o.vs_best)
    print(f"cells x starts: {len(outcomes)}; worst end vs best static {worst.vs_best:+.1%} "
          f"({worst.cell.size} GPUs, judge {worst.cell.judge}, tail {worst.cell.tail}, start {worst.start}); "
          f"worst end vs start {max(o.vs_start for o in outcomes):+.1%}; "
          f"settled by step {max(o.settled_step for o in outcomes)}\n")
    if figures is not None:
        convergence_heatmap(outcomes, figures / "dynamic-convergence.png")


def convergence_heatmap(outcomes: Sequence[convergence.Outcome], path: Path) -> None:
    """One row per scenario, one column per start (low / middle / high): dynamic's end vs the best static split."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[str, list[float]] = {}
    for o in outcomes:
        rows.setdefault(f"{o.cell.size} GPUs, judge {o.cell.judge}, {o.cell.tail} tail", []).append(100 * o.vs_best)
    labels = list(rows)
    values = np.array([rows[k] for k in labels])
    fig, ax = plt.subplots(figsize=(5.2, 0.28 * len(labels) + 1.2))
    image = ax.imshow(values, cmap="Reds", vmin=0.0, vmax=3.0, aspect="auto")
    for (i, j), v in np.ndenumerate(values):
        ax.text(j, i, f"{v:+.1f}%", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(values.shape[1]), ["lowest start", "middle start", "highest start"], fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_title("dynamic's last 5 steps vs the best static split", fontsize=9)
    fig.colorbar(image, ax=ax, label="% slower")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def section_f(figures: Path | None) -> None:
    print("## (f) where dynamic placement gains 1.5x over colocate, and where it cannot\n")
    cases = [("the scenario as shipped (start 8+8)", []),
             ("start 12+4 (judge starved)", ["placement.rollout_devices=12"]),
             ("start 4+12 (generation starved)", ["placement.rollout_devices=4"]),
             ("swap 30 s (G-Core's low end)", ["costs.engine_wake_s=30"]),
             ("swap 5 s (vLLM-style sleep mode)", ["costs.engine_wake_s=5"]),
             ("valid fraction ends at 0.4 (fewer waves)", ["workload.valid_fraction.end=0.4"]),
             ("judge verdicts of 1500 tokens", ["workload.judge_output_tokens.median=1500"]),
             ("short-tailed responses (sigma 0.4)", ["workload.response_tokens.sigma=0.4"]),
             ("7B judge (tp 1) for the 32B policy", ["models.judge.preset=Qwen2.5-7B", "models.judge.tp=1"])]
    rows = []
    for label, extra in cases:
        res = by_strategy(run(SGAIN, *extra))
        col, par, dyn = res["colocate"], res["partial"], res["dynamic"]
        waves = float(np.mean([s.waves for s in col.steps]))
        rows.append([label, f"{waves:.2f}", col.mean_step_seconds, col.mean_phases()["swap"], par.mean_step_seconds,
                     dyn.mean_step_seconds, f"{col.mean_step_seconds / dyn.mean_step_seconds:.2f}x",
                     f"{100 * (dyn.mean_step_seconds / par.mean_step_seconds - 1):+.1f}%",
                     f"{dyn.steps[0].rollout_devices}->{dyn.steps[-1].rollout_devices}"])
    print("`scenarios/gcore_gain32b.yaml` with one override at a time (`strategies=[colocate,partial,dynamic]`):\n")
    print(table(["case", "waves/step", "colocate step s", "colocate swap s", "partial step s", "dynamic step s",
                 "colocate / dynamic", "dynamic vs partial", "dynamic split"], rows))


def section_g(figures: Path | None) -> None:
    print("## (g) re-splitting between the waves of a step\n")
    rows = []
    for label, extra in (("64 GPUs, 7B + 7B judge (the scenario)", []),
                         ("heavy judge, 16-GPU slices", ["controllers=4", "workload.judge_output_tokens.median=1200"]),
                         ("0.5B judge, short verdicts", ["models.judge.preset=Qwen2.5-0.5B",
                                                         "workload.judge_output_tokens.median=64"])):
        scenario = load_scenario(S64, list(extra))
        job, works = resolve_job(scenario), workload_steps(scenario)
        splits = replay.feasible(job)
        per_step, oracle, per_step_free, free = 0.0, 0.0, 0.0, 0.0
        for work in works:
            best = min(splits, key=lambda r: wave_split_rollout(job, work, [r] * len(work.waves), True))
            near = [r for r in splits if abs(r - best) <= 2]  # per-wave choices around the step's best split
            combos = list(itertools.product(near, repeat=len(work.waves)))
            per_step += wave_split_rollout(job, work, [best] * len(work.waves), True)
            oracle += min(wave_split_rollout(job, work, c, True) for c in combos)
            per_step_free += min(wave_split_rollout(job, work, [r] * len(work.waves), False) for r in near)
            free += min(wave_split_rollout(job, work, c, False) for c in combos)
        rows.append([label, f"{strategies.wave_move_seconds(job):.1f}", per_step / len(works), oracle / len(works),
                     f"{100 * (oracle / per_step - 1):+.2f}%", f"{100 * (free / per_step_free - 1):+.2f}%"])
    print("`scenarios/gpus64_judge.yaml` (and overrides), 20 steps. Per step: the rollout phase at the step's best "
          "single split, against an oracle that knows every wave's lengths in advance and picks each wave's split "
          "(within 2 devices of the step's best), paying the move between waves, and the same oracle with free moves and wakes (against the best "
          "single split with free wakes):\n")
    print(table(["case", "move s", "best split per step: rollout s", "best per wave: rollout s", "per wave vs per step",
                 "per wave, free moves"], rows))
    online = []
    for label, extra in WAVE_CASES:
        one = by_strategy(run(S64, *extra, "strategies=[dynamic]"))["dynamic"]
        per_wave = by_strategy(run(S64, *extra, "strategies=[dynamic]", "placement.wave_resplit=true"))["dynamic"]
        moves = sum(s.features["placement/wave_moves"] for s in per_wave.steps)
        paid = sum(s.features["placement/wave_move_s"] for s in per_wave.steps) / len(per_wave.steps)
        online.append([label, one.mean_step_seconds, per_wave.mean_step_seconds,
                       f"{100 * (per_wave.mean_step_seconds / one.mean_step_seconds - 1):+.2f}%", int(moves), paid])
    print("\n`dynamic` with `placement.wave_resplit=true` (at each wave boundary the finished wave's counted work, "
          "repeated to the next wave's size, replayed at the splits within one move; a move only if the replayed "
          "saving beats its price) against `dynamic` with one split per step, 20 steps:\n")
    print(table(["case", "one split per step: step s", "re-split between waves: step s", "change", "moves in 20 steps",
                 "moves paid s/step"], online))


REFILL = ("controllers=4", "workload.valid_fraction.start=0.2", "workload.valid_fraction.end=0.2",
          "workload.response_growth=0", "workload.dynamic_sampling.max_waves=5")
#: (g)'s online cases: the shipped job, and refills of another kind (up to 5 waves of 16-GPU slices)
WAVE_CASES = (("64 GPUs, 7B + 7B judge (the scenario)", ()),
              ("refills with 4x longer answers", (*REFILL, "workload.refill_response_scale=4")),
              ("refills with 0.2x the answers, 1200-token verdicts",
               (*REFILL, "workload.refill_response_scale=0.2", "workload.judge_output_tokens.median=1200")),
              ("first wave 256-token answers, refills 8x, up to 16k",
               (*REFILL, "workload.response_tokens.median=256", "workload.response_tokens.max=16384",
                "workload.refill_response_scale=8", "workload.judge_output_tokens.median=1200")))


def wave_split_rollout(job, work, splits, pay_moves: bool) -> float:
    """The slowest slice's rollout phase of `work` with one split per wave (moves free unless `pay_moves`)."""
    if not pay_moves:
        job = dataclasses.replace(job, costs=dataclasses.replace(job.costs, engine_wake_s=0.0),
                                  hardware=job.hardware.with_overrides(host_link_bandwidth=float("inf")))
    end, _, _ = strategies.Partial(job).rollout(work, 0.0, Timeline(job.gpus), splits)
    return float(end.max())


def section_h(figures: Path | None) -> None:
    print("## (h) moving devices between the controllers' slices\n")
    rows = []
    for label, extra in (("64 GPUs, 8 slices of 8 (the scenario)", []),
                         ("heavy judge, 4 slices of 16", ["controllers=4", "workload.judge_output_tokens.median=1200"]),
                         ("long tail (sigma 1.1, up to 16k)", ["workload.response_tokens.sigma=1.1",
                                                               "workload.response_tokens.max=16384"]),
                         ("one shard's answers 1.5x longer", ["workload.heavy_shard_scale=1.5"]),
                         ("one shard's answers 2x longer", ["workload.heavy_shard_scale=2"]),
                         ("one shard 1.5x, 4 slices of 16", ["controllers=4", "workload.heavy_shard_scale=1.5"])):
        scenario = load_scenario(S64, list(extra))
        job = resolve_job(scenario)
        equal = balanced = 0.0
        slowest: list[int] = []
        for work in workload_steps(scenario):
            times = [slice_rollout_by_devices(job, work, k) for k in range(job.controllers)]
            equal += max(t[job.slice_devices] for t in times)
            balanced += balance_devices(times, job.slice_devices)
            slowest.append(max(range(job.controllers), key=lambda k: times[k][job.slice_devices]))
        steps = scenario.steps
        repeats = sum(a == b for a, b in zip(slowest, slowest[1:], strict=False))
        policy = slice_moves.run(scenario)
        moves = [i for i, m in enumerate(policy.moves) if m is not None]
        rows.append([label, equal / steps, balanced / steps, f"{100 * (balanced / equal - 1):+.1f}%",
                     f"{repeats} of {steps - 1} ({job.controllers} slices)", sum(policy.moved_s) / steps,
                     f"{100 * policy.saving:+.1f}%", " ".join(str(i) for i in moves) or "none"])
    print("`scenarios/gpus64_judge.yaml` (and overrides), 20 steps. Per step the slowest slice's rollout phase "
          "(each slice at its own best split), with every slice holding D devices, against an oracle that knows "
          "the step's work and moves whole devices from fast slices to slow ones (up to 2 per slice, free):\n")
    print("\nThe last three columns: the online policy (`simlab.slice_moves`), which after each step "
          "replays every slice's counted work on one device fewer and one more, and moves a device to a slice "
          "that was the slowest in each of the last 4 steps only if the per-step saving over those steps (mean less "
          "one standard error) pays for the move (`move_seconds`) within 5 steps; its rollout phase includes what "
          "its moves cost.\n")
    print(table(["case", "equal slices: rollout s", "devices moved between slices: rollout s", "saving",
                 "slowest slice as in the step before", "online policy: rollout s", "policy saving",
                 "moves after step"], rows))


def slice_rollout_by_devices(job, work, k: int, spread: int = 2) -> dict[int, float]:
    """Slice k's rollout phase at its best split, for every slice size D - spread .. D + spread."""
    return slice_moves.slice_seconds(job, work, k, range(job.slice_devices - spread, job.slice_devices + spread + 1))


def balance_devices(times: Sequence[dict[int, float]], devices: int) -> float:
    """The slowest slice after greedily moving one device at a time from the slice that loses least
    to the slowest slice, while that shortens the step (each slice within its table's sizes)."""
    size = [devices] * len(times)
    while True:
        slowest = max(range(len(times)), key=lambda k: times[k][size[k]])
        now = times[slowest][size[slowest]]
        donors = [k for k in range(len(times)) if k != slowest and size[k] - 1 in times[k]]
        if size[slowest] + 1 not in times[slowest] or not donors:
            return now
        donor = min(donors, key=lambda k: times[k][size[k] - 1])
        size[slowest] += 1
        size[donor] -= 1
        after = max(times[k][size[k]] for k in range(len(times)))
        if after >= now:
            size[slowest] -= 1
            size[donor] += 1
            return now


def section_v(figures: Path | None) -> None:

    print("## Held against published step times: verl's DAPO-7B runs on H20, colocate and fully async\n")
    defaults = published.compare_all()
    print("With the default constants (each run's response length fitted to its `update_actor`):\n")
    print(published.markdown_table(defaults) + "\n")
    fit = published.fit_engine_constants()
    print(f"Engine constants fitted on all six runs: {' '.join(fit.overrides())}; residuals (log pred/rep of "
          f"colocate gen and async step): {', '.join(f'{r:+.3f}' for r in fit.residuals)}\n")
    fitted = published.compare_all(extra=fit.overrides())
    print(published.markdown_table(fitted) + "\n")
    if figures is not None:
        published_chart(defaults, fitted, figures / "published-verl-runs.png")
        streaming_gantts(fit, figures)
    rows = [(g, f"{rep:.2f}", f"{pred:.2f}") for g, rep, pred in published.speedups(fitted)]
    print(table(["GPUs", "colocate / async step, reported", "predicted"], rows))
    print("Leave one GPU count out (constants fitted on the other two counts' four runs):\n")
    rows = []
    for cv_fit, held in published.cross_validate():
        for c in held:
            rows.append((c.run.label, f"{cv_fit.decode_mfu:.3f} / {cv_fit.step_overhead_s * 1e3:.2f} ms / "
                         f"{cv_fit.logprob_mfu:.3f}", c.run.reported["step"], c.predicted["step"],
                         f"{c.ratio('step'):.2f}"))
    print(table(["held-out run", "decode_mfu / step_overhead / logprob_mfu (fit)", "step reported",
                 "step predicted", "pred/rep"], rows))
    print("Assumed inputs swept (constants refitted for each; step pred/rep per run):\n")
    sweeps = {"response sigma 0.6": ["workload.response_tokens.sigma=0.6"],
              "response sigma 1.0": ["workload.response_tokens.sigma=1.0"],
              "train_mfu 0.3": ["costs.train_mfu=0.3"], "train_mfu 0.5": ["costs.train_mfu=0.5"],
              "engine_wake_s 20": ["costs.engine_wake_s=20"]}
    ratios = {c.run.label: [c.ratio("step")] for c in fitted}
    for name, extra in sweeps.items():
        refit = published.fit_engine_constants(extra=extra)
        for c in published.compare_all(extra=[*extra, *refit.overrides()]):
            ratios[c.run.label].append(c.ratio("step"))
        print(f"- {name}: {' '.join(refit.overrides())}")
    print()
    print(table(["run", "pred/rep as fitted", "range over the sweeps"],
                [(label, f"{r[0]:.2f}", f"{min(r):.2f} - {max(r):.2f}") for label, r in ratios.items()]))
    schedules(fit)


def published_chart(defaults, fitted, path: Path) -> None:
    """Reported vs predicted step time of every published run, with the default and the fitted engine constants."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [c.run.label.replace("colocate sync, ", "colocate ").replace("fully_async", "async") for c in fitted]
    x = np.arange(len(labels))
    fig, ax = plt.subplots(figsize=(7.5, 3.4))
    ax.bar(x - 0.27, [c.run.reported["step"] for c in fitted], 0.27, label="reported (verl)", color="0.35")
    ax.bar(x, [c.predicted["step"] for c in defaults], 0.27, label="predicted, default constants", color="#9ecae1")
    ax.bar(x + 0.27, [c.predicted["step"] for c in fitted], 0.27, label="predicted, fitted engine constants",
           color="#3182bd")
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("seconds per step")
    ax.set_title("verl DAPO Qwen2.5-Math-7B on H20: colocate vs fully async", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def streaming_gantts(fit, figures: Path) -> None:
    """One-step-off vs streaming (partial rollout) on the 64-GPU async setup: where the tail goes."""
    from gcore_rl.sim.report import gantt_png

    run = next(r for r in published.VERL_DAPO7B_H20 if r.label == "fully_async 32:32")
    length = f"workload.response_tokens.median={published.fit_response_median(run)}"
    for strategy in ("disaggregated", "streaming"):
        scenario = run.scenario(extra=[length, *fit.overrides(), f"strategies=[{strategy}]", "steps=4"])
        result = published.simulate(scenario, strategy)
        gantt_png(result, figures / f"published-verl-32-32-{strategy}.png", steps=4, max_devices=64)


def schedules(fit) -> None:
    """colocate / one-step-off / streaming(k) on the published setup, at each GPU count's colocate-fitted length."""

    print("Schedules on the published setup (seconds per step; the response length of the colocate run at each "
          "GPU count; the async settings otherwise as verl's):\n")
    variants = {"colocate": ("colocate", []), "one-step-off (disaggregated)": ("disaggregated", []),
                "streaming k=1, drain at sync": ("streaming", ["placement.max_staleness=1", "placement.partial_rollout=false"]),
                "streaming k=0.5, partial": ("streaming", ["placement.max_staleness=0.5"]),
                "streaming k=1, partial": ("streaming", ["placement.max_staleness=1"]),
                "streaming k=2, partial": ("streaming", ["placement.max_staleness=2"])}
    rows = []
    for run in (r for r in published.VERL_DAPO7B_H20 if r.strategy == "colocate"):
        length = f"workload.response_tokens.median={published.fit_response_median(run)}"
        row: list[object] = [run.gpus]
        for strategy, extra in variants.values():
            base = published.PublishedRun(run.label, strategy, run.gpus, run.reported,
                                          () if strategy == "colocate" else (f"placement.train_devices={run.gpus // 2}",
                                                                             *published.ASYNC_SETTINGS))
            scenario = base.scenario(extra=[length, *fit.overrides(), *extra])
            row.append(published.verl_figures(published.simulate(scenario, strategy), strategy)["step"])
        rows.append(row)
    print(table(["GPUs", *variants], rows))


#: the inputs the findings assume rather than measure, each swept to a low and a high value ("x": a factor
#: on each scenario's own value)
ASSUMED_INPUTS = {
    "response median x0.5 / x2": ("workload.response_tokens.median", "x", 0.5, 2.0),
    "decode_mfu 0.25 / 0.75": ("costs.decode_mfu", "=", 0.25, 0.75),
    "train_mfu 0.3 / 0.5": ("costs.train_mfu", "=", 0.3, 0.5),
    "engine_wake_s 1 / 30": ("costs.engine_wake_s", "=", 1.0, 30.0),
}


def headline_figures(key: str | None = None, how: str = "=", value: float = 0.0) -> dict[str, float]:
    """The findings' headline figures, with `key` set to `value` (how "=") or multiplied by it (how "x")."""
    def runs(path: Path, *overrides: str) -> dict[str, SimResult]:
        if key is not None:
            own = load_scenario(path, list(overrides))
            current = float(functools.reduce(getattr, key.split("."), own))
            overrides = (*overrides, f"{key}={current * value if how == 'x' else value}")
        return by_strategy(run(path, *overrides))

    a = runs(S64, "strategies=[colocate,partial]")
    f = runs(SGAIN, "strategies=[colocate,dynamic]")
    p = runs(SPUB, "strategies=[colocate,partial]", "costs.engine_wake_s=30")
    return {"(a) colocate / partial step, 64 GPUs": a["colocate"].mean_step_seconds / a["partial"].mean_step_seconds,
            "(f) colocate / dynamic step, gcore_gain32b": f["colocate"].mean_step_seconds / f["dynamic"].mean_step_seconds,
            "(p) partial's rollout saving vs colocate, 32B, wake 30 s": 1 - mean_rollout(p["partial"]) / mean_rollout(p["colocate"])}


def section_u(figures: Path | None) -> None:
    print("## (u) The findings' headline figures over their assumed inputs\n")
    base = headline_figures()
    swept = {label: [headline_figures(key, how, low), headline_figures(key, how, high)]
             for label, (key, how, low, high) in ASSUMED_INPUTS.items()}
    rows = []
    for name, value in base.items():
        ends = [pair[i][name] for pair in swept.values() for i in (0, 1)]
        rows.append([name, f"{value:.3f}", *(f"{lo[name]:.3f} / {hi[name]:.3f}" for lo, hi in swept.values()),
                     f"{min(ends + [value]):.3f} - {max(ends + [value]):.3f}"])
    print(table(["headline", "as shipped", *ASSUMED_INPUTS, "range"], rows))


def section_t(figures: Path | None) -> None:
    print("## (t) The update's split over the trainer ranks\n")
    print("Rows of `scenarios/gpus64_judge.yaml`'s lengths (prompt + response, drawn with seed 0) split over 8 "
          "trainer ranks of a Qwen2.5-7B policy in each of 64 slices (`phases.split_rows`):\n")
    workload = load_scenario(S64).workload
    cost = MODELS["Qwen2.5-7B"].sequence_cost
    rng = np.random.default_rng(0)
    rows = []
    for per_rank in (1, 2, 4, 8, 32, 128):
        shape = (64, 8 * per_rank)
        drawn = workload.prompt_tokens.sample(rng, shape) + workload.response_tokens.sample(rng, shape)
        split = phases.split_rows(drawn, 8, cost)
        even = drawn.sum(axis=1).max() / 8  # the update's tokens if every slice split its tokens evenly
        rows.append([per_rank, f"{split.cost_imbalance.mean():.3f}", f"{split.token_imbalance.mean():.3f}",
                     f"{split.slowest_rank_tokens / even:.3f}"])
    print(table(["rows per rank", "cost imbalance (mean of slices)", "token imbalance (mean of slices)",
                 "update vs an even split"], rows))


def section_s(figures: Path | None) -> None:
    print("## (s) Sequence parallelism in the update\n")
    print("Reasoning-length rows (prompt median 400; response median 8,000 tokens, sigma 0.8, up to 32,768; "
          "drawn with seed 0) trained by 64 slices of 8 devices, each like one of `scenarios/gpus64_judge.yaml`'s "
          "(Qwen2.5-7B, H100, NVLink inside the node), one training pass: `phases.update_seconds` with "
          "`workload.sequence_parallel` N = 1, 2, 4 (the 7B's 28 query and 4 key/value heads allow no more). "
          "Each cell: seconds of the slowest device (the update waits for it), the mean cost imbalance of the "
          "data-parallel groups, the all-to-alls' share of the seconds, and the most tokens one device holds "
          "of one row (what bounds its activation memory):\n")
    rng = np.random.default_rng(0)
    base = load_scenario(S64, ["strategies=[colocate]", "workload.response_tokens.median=8000",
                               "workload.response_tokens.max=32768"])
    rows = []
    for per_device in (1, 2, 4, 8):
        shape = (64, 8 * per_device)
        drawn = base.workload.prompt_tokens.sample(rng, shape) + base.workload.response_tokens.sample(rng, shape)
        work = StepWork(step=0, valid_fraction=1.0, waves=(), trained_groups=shape[1] // base.workload.group_size,
                        valid_groups=shape[1] // base.workload.group_size, trained_lengths=drawn)
        cells = []
        for sp in (1, 2, 4):
            job = resolve_job(dataclasses.replace(base, workload=dataclasses.replace(base.workload,
                                                                                     sequence_parallel=sp)))
            _, train = phases.update_seconds(job, work, devices=8, passes=1)
            split = phases.trainer_split(job, work, 8 // sp)
            exchange = float(cost.ulysses_seconds(split.largest_rank_tokens, job.policy, job.hardware, sp, passes=2))
            cells.append(f"{train:.2f} s, x{split.cost_imbalance.mean():.2f}, {exchange / train:.1%}, "
                         f"{int(drawn.max()) // sp:,}")
        rows.append([per_device, *cells])
    print(table(["rows per device", "N = 1", "N = 2", "N = 4"], rows))


def section_w(figures: Path | None) -> None:
    print("## (w) Agents whose turns wait on tools\n")
    print("`gcore-rl simulate scenarios/agent_tools_8.yaml --steps 10` (Qwen2.5-7B on 8 x H100, one controller; "
          "64 prompts x 8 trajectories of 2-6 turns of ~300 tokens, ~200-token answers; the tool latency "
          "log-normal, sigma 1.5, 60 s timeout, its median swept). Step seconds, means over 10 steps; "
          "`waits` is the part of a step the answers alone force (turn-synchronous: the sum over turns of the "
          "slowest answer of each engine's turn; asynchronous: the slowest trajectory's own answers), mean over "
          "steps and colocate's engines:\n")
    rows = []
    for median in (0.0, 2.0, 8.0):
        for synchronous in (True, False):
            scenario = load_scenario(SAGENT, ["sweep={}", "steps=10", f"workload.agent.tool_seconds.median_s={median}",
                                              f"workload.agent.synchronous_turns={str(synchronous).lower()}"])
            results = by_strategy(run_scenario(scenario))
            engines = resolve_job(scenario).slice_devices // resolve_job(scenario).policy_tp
            waits = float(np.mean([agent_waits(w, engines, synchronous) for w in workload_steps(scenario)]))
            best_sync = min(results["colocate"].mean_step_seconds, results["disaggregated"].mean_step_seconds)
            rows.append([f"{median:.0f} s", "turn-synchronous" if synchronous else "asynchronous", f"{waits:.1f}",
                         results["colocate"].mean_step_seconds, results["disaggregated"].mean_step_seconds,
                         results["streaming"].mean_step_seconds,
                         f"{100 * results['colocate'].utilisation()['idle']:.0f}",
                         f"{results['streaming'].mean_step_seconds / best_sync:.2f}"])
    print(table(["tool median", "turns", "waits s", "colocate s", "disaggregated s", "streaming s",
                 "colocate idle %", "streaming / best other"], rows))


def agent_waits(work: StepWork, engines: int, synchronous: bool) -> float:
    """Seconds the answers alone hold a step's rollout on `engines` engines per slice, each holding whole prompts
    (see section (w)), over the step's waves: the slowest engine's."""
    total = 0.0
    for wave in work.waves:
        latency = wave.turns.tool_seconds  # [K, P, G, T - 1]
        per_engine = [latency[:, part] for part in np.array_split(np.arange(wave.prompts), engines) if len(part)]
        if synchronous:  # each turn, the slowest answer of the engine's trajectories
            total += max(float(part.max(axis=(1, 2)).sum(axis=-1).max()) for part in per_engine)
        else:  # the slowest trajectory's own answers
            total += float(latency.sum(axis=-1).max())
    return total


SECTIONS = {"a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": section_e, "f": section_f, "g": section_g, "h": section_h, "p": section_p, "s": section_s, "t": section_t, "u": section_u, "v": section_v, "w": section_w}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="abcdefghpstuvw", help="Sections to run, e.g. 'ab' (default: all).")
    parser.add_argument("--figures", type=Path, default=None, help="Directory for the PNG figures (none if omitted).")
    args = parser.parse_args()
    if args.figures is not None:
        args.figures.mkdir(parents=True, exist_ok=True)
    for key in args.only:
        started = time.perf_counter()
        SECTIONS[key](args.figures)
        print(f"<!-- section {key}: {time.perf_counter() - started:.1f} s -->\n")


if __name__ == "__main__":
    main()
