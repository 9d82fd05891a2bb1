"""Issue 49's figures from one `gpu_check.sh OUT generation` run, against the issue's targets.

Reads what the part wrote to OUT (`grpo_vs_trl_*.json`, `flow_engine_graphs_cuda.json`, `roofline_cuda.json`,
`engine_vs_generate_cuda.json`; a missing file is reported as not measured) and prints Markdown tables for
BENCHMARKS.md with the verdicts: our GRPO step at least 1.3× TRL's samples/s at each model size, the image
engine (the SDE sampler Flow-GRPO trains on) at least 1.0× diffusers' images/s at every batch.

    python3 benchmarks/gpu_generation_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GRPO_TARGET, IMAGE_TARGET = 1.3, 1.0


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def grpo_rows(out: Path) -> list[str]:
    lines = ["| model | precision | pairs of runs | ours samples/s | TRL samples/s | ours ÷ TRL (pooled; per pair) "
             f"| our generation s | TRL generate s | ≥ {GRPO_TARGET}× |", "|---|---|--:|--:|--:|--:|--:|--:|---|"]
    for path in sorted(out.glob("grpo_vs_trl_*.json")):
        run = json.loads(path.read_text())
        s, ours, trl = run["settings"], run["summaries"]["gcore-rl"], run["summaries"]["TRL"]
        ratio = run["ratio_samples_per_s"]
        generation = ours["median_phase_s"]["rollout/generate"]
        lines.append(f"| hidden {s['hidden_size']} × {s['num_layers']} layers | {'bf16' if s.get('bf16') else 'fp32'} "
                     f"| {run['pairs_done']} of {s['repeats']} | {ours['samples_per_s']:.1f} | {trl['samples_per_s']:.1f} | {ratio['pooled']:.2f} "
                     f"({', '.join(f'{r:.2f}' for r in ratio['per_pair'])}) | {_num(generation)} "
                     f"| {_num(trl['median_phase_s']['generate (model.generate)'])} "
                     f"| {'met' if ratio['pooled'] >= GRPO_TARGET else 'missed'} |")
    return lines if len(lines) > 2 else ["GRPO step vs TRL: not measured (no grpo_vs_trl_*.json)"]


def image_rows(out: Path) -> list[str]:
    run = _load(out / "flow_engine_graphs_cuda.json")
    if run is None or not run.get("engine"):
        return ["Image engine vs diffusers: not measured (no flow_engine_graphs_cuda.json)"]
    lines = ["| model | arch | B | guidance | peer img/s | ours (SDE) img/s | ours ÷ peer (SDE; ODE; SDE without graphs) |",
             "|---|---|--:|--:|--:|--:|--:|"]
    lowest = min(c["ours_over_peer"]["ours-sde"] for c in run["engine"])
    for c in run["engine"]:
        ips, ratio = c["images_per_s"], c["ours_over_peer"]
        lines.append(f"| {c['shape']} | {c['arch']} | {c['batch']} | {c['guidance']:g} | {ips['peer']:.1f} "
                     f"| {ips['ours-sde']:.1f} | {ratio['ours-sde']:.2f}; {ratio['ours-ode']:.2f}; "
                     f"{ratio.get('ours-sde-eager', float('nan')):.2f} |")
    verdict = "met" if lowest >= IMAGE_TARGET else "missed"
    return [*lines, "", f"Image engine ≥ {IMAGE_TARGET}× diffusers at every batch: {verdict} (lowest {lowest:.2f})."]


def decode_rows(out: Path) -> list[str]:
    lines = []
    roof = _load(out / "roofline_cuda.json")
    if roof is None:
        lines.append("Decode vs the bandwidth roofline: not measured (no roofline_cuda.json)")
    else:
        lines += [f"Decode step, {roof['shape']} ({roof['parameters'] / 1e6:.0f}M parameters, {roof['dtype']}), "
                  f"copy bandwidth {roof['copy_bandwidth_gb_s']:.0f} GB/s:", "",
                  "| engine | batch | step ms | tokens/s | bandwidth roofline ms | fraction of it |",
                  "|---|--:|--:|--:|--:|--:|"]
        lines += [f"| {d['arm']}{_graphs(d)} | {d['batch']} | {d['step_s'] * 1e3:.2f} "
                  f"| {d['tokens_per_s']:.0f} | {d['memory_step_s'] * 1e3:.2f} | {d['fraction_of_bandwidth_roofline']:.0%} |"
                  for d in roof["decode"]]
    gen = _load(out / "engine_vs_generate_cuda.json")
    if gen is None:
        return [*lines, "", "Engine vs generate: not measured (no engine_vs_generate_cuda.json)"]
    model = gen["model"]
    lines += ["", f"Engine vs `generate`, Qwen2 hidden {model['hidden_size']} × {model['num_layers']} layers "
              f"({model['parameters'] / 1e6:.0f}M):", "",
              "| batch | engine | tokens/s | generate tokens/s | ours ÷ generate | host reads | decode steps |",
              "|--:|---|--:|--:|--:|--:|--:|"]
    for r in gen["rows"]:
        for arm, a in r["arms"].items():
            lines.append(f"| {r['batch']} | {arm}{_graphs(a)} | {a['engine_tok_s']:.0f} | {r['generate_tok_s']:.0f} "
                         f"| {a['ratio_median']:.2f} | {a['engine_host_syncs']} | {a['engine_decode_steps']} |")
    return lines


def _graphs(arm: dict) -> str:
    """How an engine arm decoded: under CUDA graphs, eager after a failed capture, or eager by its settings."""
    if not arm["cuda_graphs"]:
        return ""
    return " (graphs)" if arm.get("graphs_captured") else " (capture failed: eager)"


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not Path(argv[0]).is_dir():
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    for block in (grpo_rows(out), image_rows(out), decode_rows(out)):
        print("\n".join(block) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
