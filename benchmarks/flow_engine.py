"""The diffusion policy's image engine against a plain diffusers sampling loop, and where a Flow-GRPO step's time goes (issue 19).

**Question.** How many images per second does our image engine (`FlowSampler.sample`) make, with the
SDE that Flow-GRPO trains on (per-step log-probs, whole trajectory kept) and with the deterministic
ODE, against the loop a user would write with diffusers on the same transformer, and how is one
Flow-GRPO step of the demo recipe split between sampling, rewarding and the update?

**Part 1: engine vs peer.** For each model (`--shapes`: ``demo`` = `TinyDiffusionConfig()` as written by
`gcore-rl init-tiny-diffusion`, 16 px, 2 layers; ``large`` = 32 px, 4 layers, 4 heads × 32, text width
64), each architecture (`--archs`: sd3, flux), batch size B (`--batches`) and guidance scale g
(`--guidance`; g != 1 is classifier-free guidance with the empty prompt, two transformer rows per image)
three sides (four with `--eager-arm`) make B images of B prompts (the shapes task's prompts in turn), `--steps`
denoising steps:

* ``peer``: `FlowMatchEulerDiscreteScheduler.set_timesteps(S)`, then for each timestep one
  `transformer(...)` call on the whole batch and `scheduler.step(...)` (diffusers' deterministic Euler
  ODE; no log-probs, no trajectory). FLUX's latents are packed once, as `FluxPipeline` does. The text
  conditioning is computed once, outside the timed region, and is the same tensors ours uses.
* ``ours-sde``: `FlowSampler.sample(prompts, cfg, seed)` with `batch_size=B`, noise level 0.7:
  the training sampler (log-prob of every step, latents ``[B, S+1, C, H, W]`` kept).
* ``ours-ode``: the same with `deterministic=True` (`eval_steps=S`).
* ``ours-sde-eager`` (with `--eager-arm`): ``ours-sde`` without CUDA graphs (`cuda_graphs=False`), to see
  what the replayed denoising steps buy on a GPU (on a CPU both run eagerly).

All of them start from the same noise (`torch.randn` with the same seed), so ``ours-ode`` and ``peer``
compute the same images: their max |Δ| is recorded as a check that the sides do the same work. After
one untimed run of each side per model (on CUDA per case: a new batch shape is captured in its first call),
each case runs `--repeats` rounds of the sides (each round starting one side later); images/s = B ÷ median seconds, and ours/peer is the ratio of those.
Forward hooks on the transformer record how much of each run is spent inside its calls (the rest is
the sampler's own work: the scheduler or SDE step, log-probs, copies, decoding). Every case records
the 1-minute load average and the cores other processes kept busy while it ran (``/proc/stat`` minus
this process), since a shared machine skews the times. The large shape runs at B = 8 and 16 by
default, to keep the run near 10 minutes on 2 CPU cores (`--large-batches 8 32` took 12 minutes there,
`8 32 128` would take about 40).

Threads: `--threads` (default 1). On a 2-core machine where another process holds a core, 2 torch
threads made the demo model about 15 times slower than 1 (OpenMP threads waiting for each other),
so the default measures one core and the JSON records the load; use `--threads 2` on a quiet machine.

**Part 2: a Flow-GRPO step.** The demo recipe (`recipes/flow_grpo_shapes.yaml`: 8 prompts × 8 images,
10 SDE steps, 2 mini-batches of 32 trajectories, `colour_coverage` reward with `colour_accuracy`) on a
random model of the demo shape (sd3), composed in one process from the parts a job's device worker
(`gcore_rl/runtime/image_worker.py`) runs on one device: `FlowSampler.sample` → `RuleRewards` on the decoded
images → `group_advantages` → `FlowGrpoTrainer.train` → `FlowSampler.load_weights(trainer.sync_weights())`
(the sync), timed separately (the job's metrics time the rewards inside the rollout). Seconds of each,
medians over `--train-iters` steps after one warm-up step, once with every denoising step trained and
once with `train.train_steps=5` (denoising reduction). This part runs on the CPU (a diffusion job on
CUDA, `runtime.device=cuda`, is measured by benchmarks/gpu_check.sh).

`--device cuda` runs part 1 on the GPU (the transformer there, the peer's latents there; our engine uploads
the noise of every step and the text conditioning before its first step and keeps the trajectory on the GPU
until the images are decoded, as `FlowSampler.denoise` does). The engine takes its text conditioning from the
model's CPU text encoder, so the script hands it the conditioning on the device (`DeviceText`).

    .venv/bin/python benchmarks/flow_engine.py --out bench-results/flow_engine.json   # ~8 min on 2 busy cores
    .venv/bin/python benchmarks/flow_engine.py --quick --out /tmp/flow_engine_smoke.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from long_tail import machine

from gcore_rl.algos.advantages import group_advantages
from gcore_rl.configlib import load_config
from gcore_rl.data.flow_images import to_arrays
from gcore_rl.data.shape_task import shape_rows
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.models.flow import (
    FlowModel,
    TextCondition,
    TinyDiffusionConfig,
    load_flow_model,
    write_tiny_diffusion,
)
from gcore_rl.records import RewardInput
from gcore_rl.rewards.rule import RuleRewards
from gcore_rl.rollout.flow_sampler import FlowSampler, ImageSamplingConfig
from gcore_rl.training.flow_trainer import FlowGrpoTrainer, ImageBatch, trained_steps

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "flow_grpo_shapes.yaml"
SHAPES = {
    "demo": {},
    "large": {"resolution": 32, "num_layers": 4, "num_heads": 4, "head_dim": 32, "text_hidden": 64},
}
"""`TinyDiffusionConfig` fields of each benchmarked model shape (the rest are the defaults)."""
SIDES = ("peer", "ours-sde", "ours-ode")
SEED = 0


class DeviceText:
    """The model's text encoder (which runs on the CPU) with its conditioning moved to `device`."""

    def __init__(self, text, device: torch.device):
        self.text, self.device = text, device

    def __call__(self, prompts: list[str]) -> TextCondition:
        cond = self.text(prompts)
        return TextCondition(cond.tokens.to(self.device), cond.pooled.to(self.device))


def _flux_ids(height: int, width: int, text_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """FLUX's positions: ``[(H/2)(W/2), 3]`` (0, row, column) of each 2×2 patch, zeros for the text tokens."""
    rows = torch.arange(height // 2, device=device).repeat_interleave(width // 2)
    cols = torch.arange(width // 2, device=device).repeat(height // 2)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1).float(), torch.zeros(text_tokens, 3, device=device)


@torch.no_grad()
def peer_sample(flow: FlowModel, transformer: torch.nn.Module, scheduler, cond: TextCondition,
                uncond: TextCondition | None, noise: torch.Tensor, steps: int, guidance: float) -> torch.Tensor:
    """The plain diffusers loop (ODE, Euler): ``[B, 3, H, W]`` images in [0, 1] on the host from `noise` ``[B, C, H, W]``.

    `cond`/`uncond` hold B rows each (`uncond` None without guidance), on the transformer's device.
    """
    b, c, h, w = noise.shape
    latents = noise
    if flow.arch == "flux":  # FluxPipeline packs once and denoises the patch sequence
        latents = latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)
        image_ids, text_ids = _flux_ids(h, w, cond.tokens.shape[1], noise.device)
    tokens, pooled = cond.tokens, cond.pooled
    if uncond is not None:  # diffusers' order: negative prompt first
        tokens, pooled = torch.cat([uncond.tokens, tokens]), torch.cat([uncond.pooled, pooled])
    scheduler.set_timesteps(steps, device=noise.device)
    for t in scheduler.timesteps:
        model_input = torch.cat([latents, latents]) if uncond is not None else latents
        timestep = t.expand(model_input.shape[0])
        if flow.arch == "sd3":
            velocity = transformer(hidden_states=model_input, timestep=timestep, encoder_hidden_states=tokens,
                                   pooled_projections=pooled, return_dict=False)[0]
        else:
            velocity = transformer(hidden_states=model_input, timestep=timestep / 1000, guidance=None,
                                   encoder_hidden_states=tokens, pooled_projections=pooled, txt_ids=text_ids,
                                   img_ids=image_ids, return_dict=False)[0]
        if uncond is not None:
            v_uncond, v_cond = velocity.chunk(2)
            velocity = v_uncond + guidance * (v_cond - v_uncond)
        latents = scheduler.step(velocity, t, latents, return_dict=False)[0]
    if flow.arch == "flux":
        latents = latents.reshape(b, h // 2, w // 2, c, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, c, h, w)
    return ((latents.clamp(-1.0, 1.0) + 1.0) / 2.0).float().cpu()


def _machine_busy_seconds() -> float | None:
    """CPU-seconds all processes have used since boot (``/proc/stat``; None where it cannot be read)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class LoadMonitor:
    """Load average and the cores other processes kept busy between `start()` and `stop()`."""

    def start(self) -> None:
        self.load_before, self.busy, self.own, self.wall = os.getloadavg()[0], _machine_busy_seconds(), _own_seconds(), time.perf_counter()

    def stop(self) -> dict:
        busy, wall = _machine_busy_seconds(), time.perf_counter() - self.wall
        other = None if busy is None or self.busy is None else max(0.0, (busy - self.busy) - (_own_seconds() - self.own)) / wall
        return {"load_average_1min": [self.load_before, os.getloadavg()[0]], "other_processes_cores": other}


class ForwardClock:
    """Wall seconds spent inside a module's forward calls (hooks; on CUDA without a synchronize, so host time only)."""

    def __init__(self, module: torch.nn.Module):
        self.seconds, self._start = 0.0, 0.0
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._leave)

    def _enter(self, *_) -> None:
        self._start = time.perf_counter()

    def _leave(self, *_) -> None:
        self.seconds += time.perf_counter() - self._start


def _timed(fn, device: torch.device) -> tuple[float, torch.Tensor]:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    images = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, images


def bench_case(flow: FlowModel, engine: FlowSampler, eager: FlowSampler, clock: ForwardClock, peer_scheduler,
               resolution: int, batch: int, guidance: float, args: argparse.Namespace, device: torch.device,
               warm_up: bool) -> dict:
    """One (model, batch, guidance) case: with `warm_up` every side once untimed, then `repeats` timed rounds
    of the three sides, each round starting one side later (so no side is always the first at a new size)."""
    rows = shape_rows()
    prompts = [rows[i % len(rows)]["prompt"] for i in range(batch)]
    cfg = ImageSamplingConfig(n=2, steps=args.steps, eval_steps=args.steps, noise_level=0.7, guidance=guidance,
                              resolution=resolution, batch_size=batch)
    cond = flow.text(prompts)
    uncond = flow.text([""]).repeat(batch) if guidance != 1.0 else None
    channels, height, width = flow.latent_shape(resolution)
    noise = torch.randn(batch, channels, height, width, generator=torch.Generator().manual_seed(SEED)).to(device)
    runs = {
        "peer": lambda: peer_sample(flow, engine.model, peer_scheduler, cond, uncond, noise, args.steps, guidance),
        "ours-sde": lambda: engine.sample(prompts, cfg, SEED).images,
        "ours-ode": lambda: engine.sample(prompts, cfg, SEED, deterministic=True).images,
        "ours-sde-eager": lambda: eager.sample(prompts, cfg, SEED).images,
    }
    sides = args.sides
    if warm_up:
        for side in sides:
            runs[side]()
    seconds: dict[str, list[float]] = {side: [] for side in sides}
    forward: dict[str, list[float]] = {side: [] for side in sides}  # of which inside transformer(...)
    images: dict[str, torch.Tensor] = {}  # each side's first images, for the equality check
    monitor = LoadMonitor()
    monitor.start()
    for repeat in range(args.repeats):
        for side in sides[repeat % len(sides):] + sides[:repeat % len(sides)]:
            clock.seconds = 0.0
            elapsed, out = _timed(runs[side], device)
            seconds[side].append(elapsed)
            forward[side].append(clock.seconds)
            images.setdefault(side, out)
    medians = {side: statistics.median(values) for side, values in seconds.items()}
    return {
        "batch": batch, "guidance": guidance, "transformer_rows_per_step": batch * (2 if guidance != 1.0 else 1),
        "seconds": seconds, "median_seconds": medians, "forward_seconds": forward,
        "forward_share": None if device.type == "cuda" else
        {side: statistics.median(f / t for f, t in zip(forward[side], seconds[side], strict=True)) for side in sides},
        "images_per_s": {side: batch / medians[side] for side in sides},
        "ours_over_peer": {side: medians["peer"] / medians[side] for side in sides[1:]},
        "ode_vs_peer_max_abs_diff": float((images["ours-ode"] - images["peer"]).abs().max()),
        **monitor.stop(),
    }


def bench_model(model_dir: Path, shape: str, arch: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    flow = load_flow_model(model_dir)
    flow.text = DeviceText(flow.text, device)
    engine = FlowSampler(flow, flow.transformer.to(device), device=device)
    eager = FlowSampler(flow, engine.model, device=device, cuda_graphs=False)  # the same module, no CUDA graphs
    clock = ForwardClock(engine.model)  # the peer calls the same module
    peer_scheduler = copy.deepcopy(flow.scheduler)
    resolution = TinyDiffusionConfig(**SHAPES[shape]).resolution
    parameters = sum(p.numel() for p in engine.model.parameters())
    cases = []
    for batch in args.batches if shape == "demo" else args.large_batches:
        for guidance in args.guidance:
            # on CUDA every case warms up: a new batch shape is captured in its first call
            case = bench_case(flow, engine, eager, clock, peer_scheduler, resolution, batch, guidance, args, device,
                              warm_up=not cases or device.type == "cuda")
            cases.append({"shape": shape, "arch": arch, "resolution": resolution, "parameters": parameters, **case})
            ips = case["images_per_s"]
            print(f"{shape} {arch} B={batch} g={guidance}: peer {ips['peer']:.1f}, ours-sde {ips['ours-sde']:.1f}, "
                  f"ours-ode {ips['ours-ode']:.1f} images/s (others used {case['other_processes_cores'] or 0:.2f} cores)",
                  file=sys.stderr, flush=True)
    return cases


def bench_step(model_dir: Path, train_steps: int, args: argparse.Namespace) -> dict:
    """Part 2: seconds of sample / reward / update / sync of Flow-GRPO steps of the demo recipe (CPU)."""
    job = load_config(FlowGrpoJobConfig, RECIPE)
    sampling = replace(job.sampling, n=args.group) if args.group else job.sampling
    prompts_per_step = args.prompts or job.run.prompts_per_step
    flow = load_flow_model(model_dir)
    engine = FlowSampler(flow, copy.deepcopy(flow.transformer))
    trainer = FlowGrpoTrainer(flow, replace(job.train, train_steps=train_steps))
    clocks = {"sample_forward": ForwardClock(engine.model), "update_forward": ForwardClock(trainer.transformer)}
    rows, order = shape_rows(), torch.Generator().manual_seed(SEED)
    seconds: dict[str, list[float]] = {key: [] for key in ("step", *STEP_PHASES, *clocks)}
    monitor = LoadMonitor()
    with RuleRewards(job.reward) as rewards:
        for step in range(1 + args.train_iters):
            if step == 1:  # step 0 is the warm-up
                monitor.start()
            picked = [rows[int(i)] for i in torch.randint(len(rows), (prompts_per_step,), generator=order)]
            for clock in clocks.values():
                clock.seconds = 0.0
            phases = one_step(engine, trainer, rewards, [row for row in picked for _ in range(sampling.n)], sampling, step)
            if step > 0:
                for key, value in {"step": sum(phases.values()), **phases}.items():
                    seconds[key].append(value)
                for key, clock in clocks.items():
                    seconds[key].append(clock.seconds)
    medians = {key: statistics.median(values) for key, values in seconds.items()}
    return {"train_steps": train_steps, "trained_denoising_steps": len(trained_steps(sampling.steps, train_steps, SEED)),
            "images": prompts_per_step * sampling.n, "prompts": prompts_per_step, "n": sampling.n,
            "denoising_steps": sampling.steps, "mini_batches": job.train.mini_batches,
            "micro_batch": job.train.micro_batch, "seconds": seconds, "median_seconds": medians,
            "share": {p: medians[p] / sum(medians[q] for q in STEP_PHASES) for p in STEP_PHASES}, **monitor.stop()}


STEP_PHASES = ("sample", "reward", "update", "sync")


def one_step(engine: FlowSampler, trainer: FlowGrpoTrainer, rewards: RuleRewards, group_rows: list[dict],
             sampling: ImageSamplingConfig, seed: int) -> dict[str, float]:
    """One Flow-GRPO step as a job's `ImageDeviceWorker` runs it on one device; the seconds of each of `STEP_PHASES`."""
    flow, prompts = engine.flow, [row["prompt"] for row in group_rows]
    t = [time.perf_counter()]
    trajectory = engine.sample(prompts, sampling, seed=seed)
    t.append(time.perf_counter())
    scored = rewards([RewardInput(prompt=row["prompt"], completion=image, row=row)
                      for row, image in zip(group_rows, to_arrays(trajectory.images), strict=True)])
    t.append(time.perf_counter())
    batch = ImageBatch(trajectory=trajectory, cond=flow.text(prompts),
                       advantages=group_advantages(torch.tensor(scored.rewards), sampling.n), guidance=sampling.guidance,
                       uncond=flow.text([""]) if sampling.guidance != 1.0 else None, noise_level=sampling.noise_level)
    trainer.train(batch, seed=seed)
    t.append(time.perf_counter())
    engine.load_weights(trainer.sync_weights(), version=trainer.version)
    t.append(time.perf_counter())
    return {phase: end - start for phase, start, end in zip(STEP_PHASES, t[:-1], t[1:], strict=True)}


def _cores(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def engine_table(cases: list[dict]) -> str:
    lines = ["| model | arch | B | g | peer img/s | ours-sde img/s | ours-ode img/s | sde ÷ peer | ode ÷ peer | "
             "in transformer: peer / sde / ode | ode−peer max abs diff | other procs (cores) |",
             "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for c in cases:
        ips, ratio, share = c["images_per_s"], c["ours_over_peer"], c["forward_share"]
        shares = "n/a" if share is None else " / ".join(f"{share[side]:.0%}" for side in SIDES)
        eager = f"; eager SDE ÷ peer {ratio['ours-sde-eager']:.2f}" if "ours-sde-eager" in ratio else ""
        lines.append(f"| {c['shape']} ({c['resolution']} px, {c['parameters'] / 1e6:.2f}M) | {c['arch']} | {c['batch']} | "
                     f"{c['guidance']:g} | {ips['peer']:.1f} | {ips['ours-sde']:.1f} | {ips['ours-ode']:.1f} | "
                     f"{ratio['ours-sde']:.2f}{eager} | {ratio['ours-ode']:.2f} | {shares} | "
                     f"{c['ode_vs_peer_max_abs_diff']:.1e} | {_cores(c['other_processes_cores'])} |")
    return "\n".join(lines)


def step_table(steps: list[dict]) -> str:
    lines = ["| trained denoising steps | step s | sample s (transformer) | reward s | update s (transformer fwd) | "
             "sync s | update share | other procs (cores) |",
             "|---|--:|--:|--:|--:|--:|--:|--:|"]
    for s in steps:
        m = s["median_seconds"]
        lines.append(f"| {s['trained_denoising_steps']} of {s['denoising_steps']} (train_steps={s['train_steps']}) | "
                     f"{m['step']:.3f} | {m['sample']:.3f} ({m['sample_forward']:.3f}) | {m['reward']:.3f} | "
                     f"{m['update']:.3f} ({m['update_forward']:.3f}) | {m['sync']:.3f} | {s['share']['update']:.0%} | "
                     f"{_cores(s['other_processes_cores'])} |")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results/flow_engine.json", help="JSON results (default: %(default)s).")
    parser.add_argument("--device", default="cpu", help="Device of part 1 (cpu or cuda); part 2 runs on the CPU.")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: %(default)s; see the docstring).")
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES), help="Model shapes (default: all).")
    parser.add_argument("--archs", nargs="+", default=["sd3", "flux"], choices=["sd3", "flux"])
    parser.add_argument("--batches", nargs="+", type=int, default=None, help="Images per batch for the demo shape (default: 8 32 128).")
    parser.add_argument("--large-batches", nargs="+", type=int, default=None,
                        help="Images per batch for the large shape (default: 8 16; see the docstring for the cost).")
    parser.add_argument("--guidance", nargs="+", type=float, default=[1.0, 4.5], help="Guidance scales (part 1).")
    parser.add_argument("--steps", type=int, default=10, help="Denoising steps of every side (part 1).")
    parser.add_argument("--repeats", type=int, default=None, help="Timed runs of each side per case (part 1; default: 5).")
    parser.add_argument("--train-steps", nargs="+", type=int, default=[0, 5],
                        help="train.train_steps of each part-2 arm (0 = every denoising step).")
    parser.add_argument("--train-iters", type=int, default=None, help="Timed Flow-GRPO steps per arm after one warm-up (default: 5).")
    parser.add_argument("--prompts", type=int, default=0, help="Prompts per step of part 2 (0 = the recipe's).")
    parser.add_argument("--group", type=int, default=0, help="Images per prompt of part 2 (0 = the recipe's).")
    parser.add_argument("--skip-engine", action="store_true", help="Skip part 1.")
    parser.add_argument("--skip-step", action="store_true", help="Skip part 2.")
    parser.add_argument("--eager-arm", action="store_true",
                        help="Part 1 also times our SDE sampler without CUDA graphs (side ours-sde-eager; the same on a CPU).")
    parser.add_argument("--work-dir", default=None, help="Model folders (default: a new temporary folder, removed).")
    parser.add_argument("--quick", action="store_true",
                        help="Smoke run (<1 min): demo shape, B=8, 2 repeats; part 2 with 2 prompts × 4 images, 2 steps.")
    args = parser.parse_args()
    quick = args.quick  # the smoke sizes fill in only what the command line leaves out
    args.shapes = args.shapes or (["demo"] if quick else list(SHAPES))
    args.batches = args.batches or ([8] if quick else [8, 32, 128])
    args.large_batches = args.large_batches or ([8] if quick else [8, 16])
    args.repeats = args.repeats or (2 if quick else 5)
    args.sides = SIDES + (("ours-sde-eager",) if args.eager_arm else ())
    args.train_iters = args.train_iters or (2 if quick else 5)
    if quick:
        args.prompts, args.group = args.prompts or 2, args.group or 4
    if args.repeats < 1 or args.train_iters < 1:
        parser.error("--repeats and --train-iters must be at least 1")
    return args


def save(info: dict, out: str) -> Path:
    """Write `info` to `out` as JSON; returns the path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=2) + "\n")
    return path


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()[0]
    info = {"question": __doc__.split("\n\n")[1], "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": machine(), "device": str(device), "threads": args.threads, "settings": vars(args),
            "shapes": {name: asdict(TinyDiffusionConfig(**fields)) for name, fields in SHAPES.items()}}
    if device.type == "cuda":
        info["machine"]["gpu"] = torch.cuda.get_device_name(device)
    own_work = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="flow-engine-")) if own_work else Path(args.work_dir)
    cases, steps = [], []
    try:
        if not args.skip_engine:
            for shape in args.shapes:
                for arch in args.archs:
                    model_dir = write_tiny_diffusion(work / f"{shape}-{arch}", TinyDiffusionConfig(arch=arch, **SHAPES[shape]))
                    cases += bench_model(model_dir, shape, arch, args, device)
                    save({**info, "engine": cases, "partial": True}, args.out)  # a run cut short keeps these
        if not args.skip_step:
            model_dir = write_tiny_diffusion(work / "step-demo-sd3", TinyDiffusionConfig())
            for train_steps in args.train_steps:
                steps.append(bench_step(model_dir, train_steps, args))
                print(f"train_steps={train_steps}: {steps[-1]['median_seconds']}", file=sys.stderr, flush=True)
    finally:
        if own_work:
            shutil.rmtree(work, ignore_errors=True)
    info.update(engine=cases, step=steps, wall_s=time.perf_counter() - started,
                load_average_1min=[load_before, os.getloadavg()[0]])
    out = save(info, args.out)
    if cases:
        print(engine_table(cases))
    if steps:
        print("\n" + step_table(steps))
    print(f"\n{info['wall_s']:.0f} s; 1-minute load average {load_before:.2f} before, {info['load_average_1min'][1]:.2f} "
          f"after; results in {out}")


if __name__ == "__main__":
    main()
