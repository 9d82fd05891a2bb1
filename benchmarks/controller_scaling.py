"""Controller scaling (issue 3): K SPMD controllers vs a single data-carrying driver.

Runs, side by side in one invocation and each configuration in a fresh Python subprocess:

* ``gcore K=k``     the real trainer (``runtime.kind=ray``, ``runtime.controllers=k``, one device per
                    controller, colocate placement) on the synthetic addition task whose rows each
                    carry a random uint8 image ``[3, S, S]`` (``data.payload_image_size=S``); the
                    reward function `image_exact_match` below reads every image it is given.
* ``baseline``      a *data-plane* baseline of the single-driver design (one central controller, as
                    in verl/OpenRLHF-style drivers): the driver process loads ALL rows (every image)
                    with ``load_prompt_rows(cfg.data)``, and every step ships that step's rows (with
                    their images) as Ray task arguments to reward-worker actors, which score
                    ``sampling.n`` placeholder completions per row with the same reward function and
                    return the rewards. It does NOT generate, train or sync weights: its step time is
                    data plane + reward only, so its step time / throughput is not comparable
                    to the full trainer's; its memory figures are.

For every configuration it reports the driver's peak RSS (VmHWM of the subprocess after the job; the
value before the job shows the growth), the controllers' and workers' peak RSS (from
``metrics.jsonl``: max over processes), the payload each controller holds, the median step time
over steps 2..N pooled over the repeats (for the trainer also per phase), the data-plane
throughput (payload bytes of the rows processed per second = rows per step × 3·S² B / median step
time) and samples/s (rows × n / median step time).

With ``--vision`` the payload is real images that a model reads: the project's ``shapes_vqa`` task
(colour and count questions about drawn scenes, S × S pixels, ``questions=2``) written once as JSONL +
PNG files (`gcore_rl.data.tasks.write_task_jsonl`), and a tiny random Qwen2-VL policy (hidden 32, 2
layers, its image processor scaling every image to at most 32 × 32 pixels). The trainer reads the file
(``data.path``), each controller decoding the PNGs of its own shard and running the image processor on
them, with ``exact_match`` as the reward. The baseline's driver decodes every PNG
(``load_prompt_rows``), runs the VLM's image processor on every image (``PromptEncoder.encode_rows``:
pixel values and patch grids), keeps both, and ships each step's rows with their images and pixel
values to the reward workers, which read the pixel values and score the rows. The payload is then the
decoded RGB images (3·S² B each, as above); the pixel values the baseline's driver holds are reported
beside it. The payload sweep uses 16-pixel scenes where the text mode uses S=0.

Run from the repository root (the defaults took 408 s on a shared 2-core CPU machine):

    .venv/bin/python benchmarks/controller_scaling.py --out /tmp/bench-work/controller_scaling.json
    .venv/bin/python benchmarks/controller_scaling.py --vision --repeats 1 --steps 3 --prompts-per-step 8 --n 2

This file is also imported by the Ray controllers (``reward.rules.0.fn=controller_scaling:...``):
the parent puts ``benchmarks/`` on PYTHONPATH of every subprocess, so keep module-level imports
to the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULT_MARKER = "CONTROLLER_SCALING_RESULT "
MIB = 2**20


# ----------------------------------------------------------------------------------------------
# The reward function (imported by the Ray controllers and the baseline's reward workers)
# ----------------------------------------------------------------------------------------------


def image_exact_match(prompt: str, completion: str, answer: str = "", image: Any = None, **row: Any) -> float:
    """Exact match of the answer, after really reading the row's image (every byte, via its mean)."""
    if image is not None and not float(image.mean()) >= 0.0:
        raise ValueError("an image with a negative mean cannot be uint8")
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


REWARD_FN = "controller_scaling:image_exact_match"
VISION_REWARD_FN = "gcore_rl.rewards.builtin:exact_match"
VISION_SMALL_SIZE = 16
"""Side of the scenes of the --vision payload sweep's small configuration (the text mode's S=0)."""
PHASES = ("rollout", "rollout/reward", "rollout/wait", "update/train", "update/sync")
"""Phases of `time/<phase>` in metrics.jsonl (means over controllers) reported for the gcore runs."""


# ----------------------------------------------------------------------------------------------
# Helpers shared by the subprocesses
# ----------------------------------------------------------------------------------------------


def _peak_rss_mib() -> float:
    """Peak resident set size of this process so far: VmHWM, the high-water mark of its own address space.

    Not ru_maxrss: Linux carries the peak of the process that started this one over fork and exec, so a
    child's ru_maxrss is at least its parent's peak (this script's parent writes the model and the PNGs).
    """
    hwm = _proc_status_mib("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _current_rss_mib() -> float | None:
    return _proc_status_mib("VmRSS")


def _proc_status_mib(field: str) -> float | None:
    """A memory line of /proc/self/status (kB) in MiB; None where there is no such file."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _overrides(spec: dict) -> list[str]:
    """The job's config overrides (the baseline uses the same data, sampling and reward sections)."""
    if spec.get("data_path"):  # --vision: the shapes_vqa rows and PNGs the parent wrote
        data = ["data.task=null", f"data.path={spec['data_path']}", f"reward.rules.0.fn={VISION_REWARD_FN}"]
    else:
        data = ["data.task=addition", f"data.num_prompts={spec['num_prompts']}",
                f"data.payload_image_size={spec['image_size']}", f"reward.rules.0.fn={REWARD_FN}"]
    return [
        f"model.path={spec['model']}", f"run.output_dir={spec['output_dir']}", f"run.steps={spec['steps']}",
        f"run.prompts_per_step={spec['prompts_per_step']}", "run.eval_every=0", "run.progress=false",
        "run.save_final=false", f"sampling.n={spec['n']}", f"sampling.max_new_tokens={spec['max_new_tokens']}",
        *data, "data.eval_prompts=0", "runtime.kind=ray", f"runtime.controllers={spec.get('controllers', 1)}", "runtime.devices_per_controller=1",
        "runtime.device=cpu", "runtime.threads_per_process=1", "placement.strategy=colocate",
    ]


def _gcore_child(spec: dict) -> dict:
    """One whole gcore-rl job on Ray; this process is the driver."""
    import ray  # noqa: F401 - imported before the "before" reading, as in the baseline

    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.models.loading import quiet_hf_libraries
    from gcore_rl.runtime.driver import run_job

    quiet_hf_libraries()
    cfg = load_config(JobConfig, None, _overrides(spec))
    before_peak, before_current = _peak_rss_mib(), _current_rss_mib()
    started = time.perf_counter()
    run_job(cfg)
    job_seconds = time.perf_counter() - started
    peak = _peak_rss_mib()
    lines = [json.loads(line) for line in (Path(spec["output_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return {
        "driver_rss_before_mib": before_current,
        "driver_peak_before_mib": before_peak,
        "driver_peak_mib": peak,
        "controller_peak_rss_mib": max(line["memory/controller_peak_rss_mib_max"] for line in lines),
        "worker_peak_rss_mib": max(line["memory/worker_peak_rss_mib_max"] for line in lines),
        "step_seconds": [line["time/step"] for line in lines],
        "rollout_seconds": [line["time/rollout"] for line in lines],
        "phase_seconds": {phase: [line.get(f"time/{phase}", 0.0) for line in lines] for phase in PHASES},
        # sampling/generated_groups is summed over the controllers (SUMMED_METRICS): the rows the job drew
        "rows_per_step": [line["sampling/generated_groups"] for line in lines],
        "job_seconds": job_seconds,
    }


class BaselineRewardWorker:
    """Ray actor of the baseline: scores the rows the driver sends it with the job's rule rewards."""

    def __init__(self, reward_cfg: dict):
        from gcore_rl.configlib import from_dict
        from gcore_rl.rewards.rule import RewardConfig, RuleRewards

        self.rewards = RuleRewards(from_dict(RewardConfig, reward_cfg))

    def ready(self) -> bool:
        return True

    def score(self, rows: list[dict], n: int, prompts: list | None = None) -> list[float]:
        """n placeholder completions per row (the answer once, then empty strings); no model runs. With
        `prompts` (--vision: the rows' `VisionPrompt`s) every pixel value is read first, as an engine would."""
        from gcore_rl.records import RewardInput

        for prompt in prompts or []:
            if not bool(prompt.images.pixel_values.isfinite().all()):
                raise ValueError("a preprocessed image has non-finite pixel values")
        inputs = [RewardInput(prompt=row["prompt"], completion=row["answer"] if j == 0 else "", row=row)
                  for row in rows for j in range(n)]
        return self.rewards(inputs).rewards

    def peak_rss_mib(self) -> float:
        return _peak_rss_mib()


def _baseline_child(spec: dict) -> dict:
    """Single-driver data plane: the driver holds every row and ships each step's rows to reward workers."""
    import ray

    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config, to_dict
    from gcore_rl.data.sampler import ShardedPromptSampler
    from gcore_rl.data.sources import load_prompt_rows
    from gcore_rl.models.loading import quiet_hf_libraries

    quiet_hf_libraries()
    cfg = load_config(JobConfig, None, _overrides({**spec, "controllers": 1}))
    before_peak, before_current = _peak_rss_mib(), _current_rss_mib()
    started = time.perf_counter()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True)
    try:
        actor_cls = ray.remote(num_cpus=0)(BaselineRewardWorker)
        workers = [actor_cls.remote(to_dict(cfg.reward)) for _ in range(spec["baseline_workers"])]
        ray.get([w.ready.remote() for w in workers])
        rows = load_prompt_rows(cfg.data)  # the central driver holds every row and every image (decoded)
        prompts = _preprocess_all(cfg.model.path, rows) if spec.get("data_path") else None
        sampler = ShardedPromptSampler(len(rows), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        step_seconds, rows_per_step, reward_means = [], [], []
        for _ in range(cfg.run.steps):
            step_start = time.perf_counter()
            picked = sampler.next_indices(cfg.run.prompts_per_step)
            parts = [picked[w::len(workers)] for w in range(len(workers))]
            # rows with their images (and pixel values) leave the driver as task arguments (into the object store)
            refs = [w.score.remote([rows[i] for i in part], cfg.sampling.n,
                                   None if prompts is None else [prompts[i] for i in part])
                    for w, part in zip(workers, parts, strict=True)]
            rewards = [r for part in ray.get(refs) for r in part]
            reward_means.append(sum(rewards) / len(rewards))
            step_seconds.append(time.perf_counter() - step_start)
            rows_per_step.append(len(picked))
        worker_peak = max(ray.get([w.peak_rss_mib.remote() for w in workers]))
        for w in workers:
            ray.kill(w)
    finally:
        ray.shutdown()
    return {
        "driver_rss_before_mib": before_current,
        "driver_peak_before_mib": before_peak,
        "driver_peak_mib": _peak_rss_mib(),
        "controller_peak_rss_mib": None,  # the driver is the (only) controller
        "worker_peak_rss_mib": worker_peak,
        "step_seconds": step_seconds,
        "rollout_seconds": None,
        "rows_per_step": rows_per_step,
        "reward_mean": statistics.fmean(reward_means),
        "job_seconds": time.perf_counter() - started,
        "pixel_values_held_mib": None if prompts is None else sum(p.images.pixel_values.nbytes for p in prompts) / MIB,
    }


def _preprocess_all(model_path: str, rows: list[dict]) -> list:
    """--vision: every row's images through the VLM's image processor (`VisionPrompt`s: token ids, pixel
    values, patch grids), as a central driver prepares them for the engine."""
    from gcore_rl.data.prompts import policy_prompt_encoder
    from gcore_rl.models.loading import load_tokenizer

    return policy_prompt_encoder(model_path, load_tokenizer(model_path)).encode_rows(rows)


def _child_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    result = _baseline_child(spec) if spec["kind"] == "baseline" else _gcore_child(spec)
    print(RESULT_MARKER + json.dumps(result), flush=True)


# ----------------------------------------------------------------------------------------------
# The parent: configurations, subprocesses, aggregation, report
# ----------------------------------------------------------------------------------------------


def _configurations(args: argparse.Namespace) -> list[dict]:
    image = args.image_size
    small, small_name = (VISION_SMALL_SIZE, f"{VISION_SMALL_SIZE} px images") if args.vision else (0, "no payload")
    configs = [{"name": f"gcore K={k}", "kind": "gcore", "controllers": k, "image_size": image}
               for k in args.controllers]
    if args.payload_sweep:
        k = 2 if 2 in args.controllers else args.controllers[0]
        configs.append({"name": f"gcore K={k}, {small_name}", "kind": "gcore", "controllers": k, "image_size": small})
    if args.baseline_workers > 0:
        configs.append({"name": "single-driver baseline", "kind": "baseline", "controllers": 1, "image_size": image})
        if args.payload_sweep:
            configs.append({"name": f"single-driver baseline, {small_name}", "kind": "baseline", "controllers": 1,
                            "image_size": small})
    return configs


def _write_inputs(work: Path, args: argparse.Namespace, sizes: set[int]) -> tuple[Path, dict[int, str]]:
    """The tiny policy (a Qwen2-VL for --vision) and, for --vision, the shapes_vqa JSONL + PNGs of each
    image side in `sizes`; kept in `work` and reused by later invocations with the same settings."""
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.models.vision import TinyVisionConfig

    shape = {"hidden_size": 32, "num_layers": 2, "intermediate_size": 64}
    model = work / ("tiny-vl" if args.vision else "tiny-model")
    if not (model / "config.json").is_file():
        vision = {"arch": "qwen2_vl", "vision": TinyVisionConfig(image_size=32)} if args.vision else {}
        write_tiny_model(model, TinyModelConfig(**shape, **vision))
    if not args.vision:
        return model, {}
    from gcore_rl.data.tasks import write_task_jsonl

    data = {}
    for size in sorted(sizes):
        path = work / f"shapes-vqa-{size}px-{args.num_prompts}.jsonl"
        if not path.is_file():
            write_task_jsonl("shapes_vqa", path, args.num_prompts, seed=0, size=size, questions=2)
        data[size] = str(path)
    return model, data


def _run_child(spec: dict, timeout: float) -> dict:
    env = dict(os.environ)
    # the reward function lives in this file: the driver and every Ray worker must import it
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=timeout, cwd=spec["workdir"], env=env)
    results = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not results:
        raise RuntimeError(f"{spec['name']} (repeat {spec['repeat']}) failed with exit code {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(results[-1][len(RESULT_MARKER):])


def _median(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _summarise(config: dict, runs: list[dict], args: argparse.Namespace) -> dict:
    """Medians over repeats (memory) and over steps 2..N of all repeats pooled (time)."""
    image_bytes = 3 * config["image_size"] ** 2
    k = config["controllers"]
    later_steps = [s for run in runs for s in run["step_seconds"][1:]]
    rows = _median([r for run in runs for r in run["rows_per_step"][1:]])
    step = _median(later_steps)
    shard_rows = -(-args.num_prompts // k)  # the largest shard
    is_baseline = config["kind"] == "baseline"
    summary = {
        **{key: config[key] for key in ("name", "kind", "controllers", "image_size")},
        "repeats": len(runs),
        "driver_rss_before_mib": _median([run["driver_rss_before_mib"] for run in runs]),
        "driver_peak_mib": _median([run["driver_peak_mib"] for run in runs]),
        "driver_growth_mib": _median([run["driver_peak_mib"] - run["driver_peak_before_mib"] for run in runs]),
        "driver_payload_held_mib": args.num_prompts * image_bytes / MIB if is_baseline else 0.0,
        "controller_payload_held_mib": None if is_baseline else shard_rows * image_bytes / MIB,
        "controller_peak_rss_mib": _median([run["controller_peak_rss_mib"] for run in runs]),
        "worker_peak_rss_mib": _median([run["worker_peak_rss_mib"] for run in runs]),
        "rows_per_step": rows,
        "driver_payload_per_step_mib": rows * image_bytes / MIB if is_baseline else 0.0,
        "median_step_s": step,
        "per_repeat_median_step_s": [_median(run["step_seconds"][1:]) for run in runs],
        "data_plane_mib_per_s": rows * image_bytes / MIB / step,
        "samples_per_s": rows * args.n / step,
        "job_wall_s": _median([run["job_seconds"] for run in runs]),
        "driver_pixel_values_held_mib": _median([run.get("pixel_values_held_mib") for run in runs]),
        "load_average_1min_max": max(max(run["load_average_1min"]) for run in runs),
    }
    if not is_baseline:
        summary["median_phase_s"] = {phase: _median([s for run in runs for s in run["phase_seconds"][phase][1:]])
                                     for phase in PHASES}
    return summary


def _fmt(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _tables(summaries: list[dict]) -> str:
    memory = [
        "| configuration | K | S | driver RSS before job (MiB) | driver peak RSS (MiB) | driver growth (MiB) "
        "| payload held by driver (MiB) | payload held per controller (MiB) | controller peak RSS (MiB) "
        "| worker peak RSS (MiB) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    speed = [
        "| configuration | rows/step | payload through driver per step (MiB) | median step (s) "
        "| per-repeat median step (s) | data plane (MiB/s) | samples/s | job wall (s) |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for s in summaries:
        memory.append(
            f"| {s['name']} | {s['controllers']} | {s['image_size']} | {_fmt(s['driver_rss_before_mib'])} "
            f"| {_fmt(s['driver_peak_mib'])} | {_fmt(s['driver_growth_mib'])} | {_fmt(s['driver_payload_held_mib'])} "
            f"| {_fmt(s['controller_payload_held_mib'])} | {_fmt(s['controller_peak_rss_mib'])} "
            f"| {_fmt(s['worker_peak_rss_mib'])} |")
        per_repeat = ", ".join(_fmt(v, 3) for v in s["per_repeat_median_step_s"])
        speed.append(
            f"| {s['name']} | {_fmt(s['rows_per_step'], 0)} | {_fmt(s['driver_payload_per_step_mib'], 2)} "
            f"| {_fmt(s['median_step_s'], 3)} | {per_repeat} | {_fmt(s['data_plane_mib_per_s'])} "
            f"| {_fmt(s['samples_per_s'])} | {_fmt(s['job_wall_s'])} |")
    phases = ["| configuration | median step (s) | " + " | ".join(f"{p} (s{', within rollout' if p == 'rollout/reward' else ''})" for p in PHASES) + " |",
              "|---|--:|" + "--:|" * len(PHASES)]
    for s in summaries:
        if "median_phase_s" in s:
            phases.append(f"| {s['name']} | {_fmt(s['median_step_s'], 3)} | "
                          + " | ".join(_fmt(s["median_phase_s"][p], 3) for p in PHASES) + " |")
    return "\n\n".join("\n".join(table) for table in (memory, speed, phases))


def _payload_effect(summaries: list[dict]) -> list[str]:
    """Peak RSS with the payload minus with the sweep's smallest one (S=0, or --vision's 16 px), for the
    configurations run both ways."""
    smallest: dict[tuple, dict] = {}
    for s in summaries:
        key = (s["kind"], s["controllers"])
        if key not in smallest or s["image_size"] < smallest[key]["image_size"]:
            smallest[key] = s
    lines = []
    for s in summaries:
        base = smallest[(s["kind"], s["controllers"])]
        if base is s:
            continue
        text = f"{s['name']}: driver peak {s['driver_peak_mib'] - base['driver_peak_mib']:+.1f} MiB"
        if s["controller_peak_rss_mib"] is not None:
            text += f", controller peak {s['controller_peak_rss_mib'] - base['controller_peak_rss_mib']:+.1f} MiB"
        payload = (s["driver_payload_held_mib"] or s["controller_payload_held_mib"]) - (
            base["driver_payload_held_mib"] or base["controller_payload_held_mib"])
        lines.append(f"- {text} (S={s['image_size']} vs S={base['image_size']}; payload held: {payload:+.1f} MiB)")
    return lines


def _versions() -> dict:
    versions = {"python": sys.version.split()[0], "cpu_count": os.cpu_count()}
    for name in ("torch", "ray", "transformers", "numpy"):
        try:
            versions[name] = __import__(name).__version__
        except ImportError:
            versions[name] = None
    return versions


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2,
                        help="fresh subprocess runs per configuration; medians are reported (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=10, help="RL steps per run; step 1 is excluded from step times (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=1000, help="rows in the dataset, data.num_prompts (default: %(default)s)")
    parser.add_argument("--prompts-per-step", type=int, default=32, help="rows per step over all controllers (default: %(default)s)")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt, sampling.n (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="sampling.max_new_tokens (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=256, help="S of the [3, S, S] uint8 image per row (default: %(default)s)")
    parser.add_argument("--controllers", type=lambda text: [int(k) for k in text.split(",")], default=[1, 2, 4],
                        help="comma-separated controller counts K to run (default: 1,2,4)")
    parser.add_argument("--baseline-workers", type=int, default=2,
                        help="reward-worker actors of the single-driver baseline, 0 = skip it (default: %(default)s)")
    parser.add_argument("--vision", action="store_true",
                        help="payload = shapes_vqa scenes (S × S PNG files) read by a tiny Qwen2-VL policy; see the docstring")
    parser.add_argument("--no-payload-sweep", dest="payload_sweep", action="store_false",
                        help="skip the S=0 runs (gcore K=2 and the baseline) that isolate the payload's memory")
    parser.add_argument("--out", type=Path, default=None, help="write raw and summarised results to this JSON file")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="scratch directory for the tiny model and run directories (default: a new temp dir)")
    parser.add_argument("--timeout", type=float, default=400, help="seconds allowed per subprocess (default: %(default)s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is None:
        for k in args.controllers:
            if k < 1 or args.prompts_per_step % k or args.num_prompts < k:
                parser.error(f"K={k}: prompts per step ({args.prompts_per_step}) must split evenly and "
                             f"num prompts ({args.num_prompts}) must be at least K")
        if args.repeats < 1 or args.steps < 2:
            parser.error("need --repeats >= 1 and --steps >= 2 (step 1 is excluded from step times)")
        if args.vision and not 8 <= args.image_size <= 1024:
            parser.error(f"--vision draws shapes_vqa scenes of 8 to 1024 pixels a side, not {args.image_size}")
    return args


def _run_all(args: argparse.Namespace, work: Path, configs: list[dict]) -> dict[str, list[dict]]:
    """Every configuration `args.repeats` times, each run a fresh subprocess; the raw results by name."""
    model, data_paths = _write_inputs(work, args, {c["image_size"] for c in configs})
    raw: dict[str, list[dict]] = {c["name"]: [] for c in configs}
    for repeat in range(args.repeats):
        for config in configs:  # interleaved, so drift on the machine hits every configuration alike
            slug = config["name"].replace(" ", "").replace(",", "-").replace("=", "")
            spec = {**config, "repeat": repeat, "workdir": str(work), "model": str(model),
                    "output_dir": str(work / f"run-{slug}-r{repeat}-{os.getpid()}"), "steps": args.steps,
                    "prompts_per_step": args.prompts_per_step, "n": args.n, "max_new_tokens": args.max_new_tokens,
                    "num_prompts": args.num_prompts, "baseline_workers": args.baseline_workers,
                    "data_path": data_paths.get(config["image_size"])}
            t0, load_before = time.perf_counter(), os.getloadavg()[0]
            result = _run_child(spec, args.timeout)
            result["load_average_1min"] = [load_before, os.getloadavg()[0]]  # other work on the machine skews times
            raw[config["name"]].append(result)
            print(f"[repeat {repeat + 1}/{args.repeats}] {config['name']}: driver peak {result['driver_peak_mib']:.1f} MiB, "
                  f"median step {_median(result['step_seconds'][1:]):.3f} s ({time.perf_counter() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    return raw


def _report(args: argparse.Namespace, summaries: list[dict], raw: dict[str, list[dict]], wall: float) -> None:
    """The tables and notes on stdout."""
    if args.vision:
        print("--vision: shapes_vqa scenes of S × S pixels as PNG files, read by a tiny Qwen2-VL (images scaled to "
              "≤ 32 × 32 by its processor); payload = the decoded RGB images, 3·S² B each\n")
    print(_tables(summaries))
    effect = _payload_effect(summaries)
    if effect:
        print("\nPeak RSS added by the payload:\n" + "\n".join(effect))
    pixels = [f"- {s['name']}: {s['driver_pixel_values_held_mib']:.1f} MiB" for s in summaries
              if s["driver_pixel_values_held_mib"] is not None]
    if pixels:
        print("\nPixel values (the image processor's output) held by the baseline's driver beside the payload:\n"
              + "\n".join(pixels))
    print(f"\n{args.repeats} repeat(s), {args.steps} steps each; step times: median over steps 2..{args.steps} of all "
          f"repeats; memory: median over repeats. 1-min load average seen: "
          f"{min(min(r['load_average_1min']) for rs in raw.values() for r in rs):.1f}–"
          f"{max(s['load_average_1min_max'] for s in summaries):.1f} on {os.cpu_count()} cores. "
          f"Total wall time {wall:.0f} s.")


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.child is not None:
        _child_main(args.child)
        return 0
    started = time.perf_counter()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="controller-scaling-"))
    work.mkdir(parents=True, exist_ok=True)
    configs = _configurations(args)
    raw = _run_all(args, work.resolve(), configs)
    summaries = [_summarise(c, raw[c["name"]], args) for c in configs]
    wall = time.perf_counter() - started
    _report(args, summaries, raw, wall)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "child"}
        args.out.write_text(json.dumps({"settings": settings, "versions": _versions(), "wall_seconds": wall,
                                        "summaries": summaries, "runs": raw}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
