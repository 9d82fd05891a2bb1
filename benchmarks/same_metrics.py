"""Do two versions of the trainer give the same seeded runs? A refactoring check, not a speed benchmark.

`run` trains the demo's GRPO job (`recipes/grpo_addition.yaml`, from a warm start made once with
`recipes/sft_addition.yaml`) for a few steps under four layouts -- local with 1 and 2 controllers, Ray
`colocate` and `disaggregated` on one controller of 2 devices -- with the checkout's own `gcore-rl`, and
keeps each run's `metrics.jsonl`. `compare` reads two such folders and lists every metric that differs (the warm
start's too), leaving out the keys that measure time, memory or the machine (`is_timing_key`). `dynamic` is left out of
the layouts: its default forecast reads measured busy time, so its split may differ between two runs of
one version.

    python benchmarks/same_metrics.py run --out /tmp/before [--steps 3]
    python benchmarks/same_metrics.py compare /tmp/before /tmp/after

`compare` exits 1 when a metric differs, so a script can rely on it. Run `run` twice on one version first:
two runs of the same code must agree before a difference means anything.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

LAYOUTS: dict[str, list[str]] = {
    "local-k1": ["runtime.kind=local", "runtime.controllers=1"],
    "local-k2": ["runtime.kind=local", "runtime.controllers=2"],
    "ray-colocate": ["runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=2",
                     "placement.strategy=colocate"],
    "ray-disaggregated": ["runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=2",
                          "placement.strategy=disaggregated"],
}
"""The layouts `run` trains under, by name (the folder each run's metrics go to)."""

TIMING_SECTIONS = ("time", "util", "memory", "throughput")
"""First parts of the metric names that measure the machine: wall time, utilisation, memory, tokens per second."""


def is_timing_key(key: str) -> bool:
    """Whether metric `key` measures the machine rather than the run (`time` itself, `time/...`, `util/...`,
    `memory/...`, `throughput/...`, and any `.../<name>_s` seconds); counts of work (`work/...`) are compared."""
    return key.split("/")[0] in TIMING_SECTIONS or key.endswith("_s")


def gcore(*args: str, threads: int) -> None:
    # PYTHONPATH: this checkout's package, also in Ray's worker processes (whatever the venv's editable install points at)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "gcore_rl.cli", *args], check=True, env=env, cwd=REPO)


def run(out: Path, steps: int, threads: int, layouts: list[str]) -> None:
    """The warm start (once per `out`), then the GRPO job under each layout; metrics in out/<layout>/."""
    out = out.resolve()
    base, sft = out / "tiny-base", out / "tiny-sft"
    if not (sft / "config.json").exists():
        gcore("init-tiny", str(base), threads=threads)
        gcore("sft", "recipes/sft_addition.yaml", f"model.path={base}", f"output_dir={sft}", threads=threads)
    for name in layouts:
        folder = out / name
        gcore("train", "recipes/grpo_addition.yaml", f"model.path={sft}", f"run.output_dir={folder}",
              f"run.steps={steps}", "run.progress=false", "run.eval_every=2", *LAYOUTS[name], threads=threads)


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def differences(before: list[dict], after: list[dict]) -> list[str]:
    """Every non-timing metric whose value differs between two runs' records, line by line."""
    out = []
    if len(before) != len(after):
        out.append(f"{len(before)} records vs {len(after)}")
    for index, (a, b) in enumerate(zip(before, after, strict=False)):
        for key in sorted(set(a) | set(b)):
            if is_timing_key(key):
                continue
            x, y = a.get(key), b.get(key)
            same = x == y or (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y))
            if not same:
                out.append(f"record {index} ({a.get('step', '?')}): {key}: {x!r} vs {y!r}")
    return out


COMPARED = {"warm-start": "tiny-sft/sft_metrics.jsonl",
            **{name: f"{name}/metrics.jsonl" for name in LAYOUTS}}
"""The records `compare` holds side by side: the warm start's (its held-out evaluations ran on an engine too) and each layout's."""


def compare(first: Path, second: Path) -> int:
    """Print each run's differences; 1 when any differ (or a run is missing), else 0."""
    status = 0
    for name, records in COMPARED.items():
        a, b = first / records, second / records
        if not (a.exists() and b.exists()):
            print(f"{name}: missing ({a.exists()=}, {b.exists()=})")
            status = 1
            continue
        before, after = read_metrics(a), read_metrics(b)
        diff = differences(before, after)
        compared = len({k for r in before for k in r if not is_timing_key(k)})
        print(f"{name}: {len(before)} records, {compared} non-timing keys, {len(diff)} differences")
        for line in diff[:20]:
            print("   ", line)
        status |= bool(diff)
    return status


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--steps", type=int, default=3)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    c = sub.add_parser("compare")
    c.add_argument("first", type=Path)
    c.add_argument("second", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args.out, args.steps, args.threads, args.layouts)
        return 0
    return compare(args.first, args.second)


if __name__ == "__main__":
    sys.exit(main())
