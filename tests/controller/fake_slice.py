"""A controller's slice made of fakes behind `WorkerAPI`: the real controller loop, schedules, sampler,
rewards, checkpoints and `SliceClient`, with device workers that only count.

`FakeWorker` plays every role a `WorkerSpec` gives it with a one-number policy: its skill s makes each
generated token "1" with probability sigmoid(s) and "0" otherwise (greedy: "1" when s ≥ 0), its log-probs
are exactly those of that coin, and the trainers of the job move s by the step's advantages on the rows'
share of "1"s (a REINFORCE step on a Bernoulli policy, applied once every trainer has sent its rows, as
FSDP's all-reduce would). Weights travel as they do on devices: a sync or a published bucket carries s,
and an engine generates with the s of the last version it loaded. The judge scores a sample by its share
of "1"s, the reference's log-probs are the initial policy's, and checkpoints are real DCP folders holding
s. Everything a worker does is appended to `FakeWorld.events` as a tuple, so a test counts what happened
(which version generated which step, what was loaded when) instead of timing it.

`run_fake(cfg)` runs a job of one controller through the driver's own checks (`prepare_run_dir`) in this
process, in about a second.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from gcore_rl.checkpoint.layout import TRAINER_DIR
from gcore_rl.config import JobConfig
from gcore_rl.controller.handles import LocalHandle
from gcore_rl.controller.loop import run_controller
from gcore_rl.controller.program import ControllerContext
from gcore_rl.controller.slice import SliceClient
from gcore_rl.controller.token_samples import RunSummary
from gcore_rl.distributed import DistInfo
from gcore_rl.models.loading import load_tokenizer
from gcore_rl.placement.plan import WorkerSpec, worker_specs
from gcore_rl.placement.rebalance import DeviceLoad
from gcore_rl.records import (
    Completion,
    EngineRounds,
    ModelScores,
    RewardInput,
    RolloutWork,
    TokenBatch,
    Verdict,
)
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.runtime.driver import prepare_run_dir

LEARNING_RATE = 2.0
"""How far one update moves the skill per unit of (advantage × share of "1"s), averaged over the step's rows."""


@dataclass
class FakeWorld:
    """What the fake workers of one slice share: the event log and the trainers' common policy (the skill
    every trainer holds after the collectives of an update)."""

    skill: float = -1.0
    events: list[tuple] = field(default_factory=list)
    now: float = 0.0  # the slice's clock: counted work (a token, a judged sample, a trained row: 1 s; whole numbers stay exact)
    trainers: int = 0
    _sent: list[tuple[float, int]] = field(default_factory=list)  # this update's (Σ advantage × ones, rows) per trainer

    def clock(self) -> float:
        """What the controller times its phases with (`ControllerContext.clock`): counted work, not the machine's
        speed, so decisions taken on measured times (dynamic placement) are the same in every run."""
        return self.now

    def contribute(self, signal: float, rows: int) -> None:
        """One trainer's rows of the update; the last trainer's completes it (the all-reduce)."""
        self._sent.append((signal, rows))
        if len(self._sent) == self.trainers:
            self.skill += LEARNING_RATE * sum(s for s, _ in self._sent) / max(1, sum(r for _, r in self._sent))
            self._sent = []


class FakeWorker:
    """The roles of one device, faked (see the module docstring); the same methods as `WorkerAPI`."""

    def __init__(self, spec: WorkerSpec, cfg: JobConfig, world: FakeWorld, one: int, zero: int):
        self.spec = spec
        self.cfg = cfg
        self.world = world
        self.one, self.zero = one, zero
        self.engine: tuple[int, float] | None = (0, world.skill) if "rollout" in spec.roles else None  # (version, skill)
        self._staged: float | None = None  # a published bucket's skill, until the update's final load
        self.step = 0
        self.work: dict[str, float] = {}

    def _log(self, *event) -> None:
        self.world.events.append((self.spec.device, *event))

    # ---- rollout phase ------------------------------------------------------------------

    def _coin(self) -> float:
        return 1.0 / (1.0 + math.exp(-self.engine[1]))

    def generate_stream(self, prompt_ids: list[list[int]], sampling: SamplingConfig,
                        seed: int) -> Iterator[list[Completion]]:
        version, skill = self.engine
        self._log("generate", self.step, version, len(prompt_ids) * sampling.n)
        p = self._coin()
        for i, prompt in enumerate(prompt_ids):
            chunk = []
            for j in range(sampling.n):
                draw = random.Random(f"{seed}/{i}/{j}")
                ones = [(skill >= 0) if sampling.temperature == 0 else draw.random() < p
                        for _ in range(sampling.max_new_tokens)]
                chunk.append(Completion(prompt_index=i, prompt_ids=list(prompt),
                                        token_ids=[self.one if o else self.zero for o in ones],
                                        logprobs=[math.log(p if o else 1.0 - p) for o in ones],
                                        finish_reason="length", policy_version=version, sample_index=j))
                self._count("rollout", tokens=sampling.max_new_tokens, prefill_tokens=len(prompt))
            self.world.now += sampling.n * sampling.max_new_tokens
            yield chunk

    def score_samples(self, samples: list[RewardInput]) -> ModelScores:
        self._log("score", self.step, len(samples))
        self._count("judge", samples=len(samples), tokens=len(samples))
        self.world.now += len(samples)
        shares = [sample.completion.count("1") / max(1, len(sample.completion)) for sample in samples]
        return {"judge": [Verdict(score=10 * s, reward=s, parsed=True, text=f"{10 * s:.0f}", tokens=1) for s in shares]}

    def reference_logprobs(self, completions: list[Completion]) -> list[list[float]]:
        self._log("reference", self.step, len(completions))
        return [[-math.log(2.0)] * len(c.token_ids) for c in completions]  # the initial policy's fair coin

    # ---- update phase -------------------------------------------------------------------

    def train(self, batch: TokenBatch) -> dict[str, float]:
        mask = batch.response_mask.float()
        ones = ((batch.input_ids == self.one).float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        advantages = batch.advantages if batch.advantages.dim() == 1 else \
            (batch.advantages * mask).sum(-1) / mask.sum(-1).clamp(min=1)  # [B]
        signal = float((advantages * ones).sum())
        self._log("train", self.step, batch.size, [int(v) for v in batch.staleness.tolist()])
        self.world.contribute(signal, batch.size)
        self.world.now += batch.size
        return {"train/signal": signal / max(1, batch.size), "train/rows": float(batch.size)}

    def critic_step(self, batch: TokenBatch) -> Iterator[torch.Tensor | dict[str, float]]:
        yield torch.zeros(batch.input_ids.shape)
        yield {"critic/rows": float(batch.size)}

    def sync_weights(self, version: int, load: bool = True) -> None:
        self._log("sync", self.step, version, bool(load and self.engine is not None))
        if load and self.engine is not None:
            self.engine = (version, self.world.skill)

    def publish_weights(self, bucket_bytes: int, version: int = 0, load: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        self._log("publish", self.step, version)
        if load and self.engine is not None:
            self.engine = (version, self.world.skill)
        if self.spec.publishes_weights:
            yield {"skill": torch.tensor([self.world.skill], dtype=torch.float64)}

    def load_weights(self, weights: dict[str, torch.Tensor], version: int, final: bool = True) -> int:
        if "skill" in weights:
            self._staged = float(weights["skill"])
        if final:
            self._log("load", self.step, version)
            self.engine = (version, self._staged)
        return 8 * len(weights)

    # ---- bookkeeping --------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.step = step
        self.work = {}

    def _count(self, role: str, **counts: float) -> None:
        for name, value in counts.items():
            key = f"work/{role}/{name}"
            self.work[key] = self.work.get(key, 0.0) + value

    def device_load(self) -> DeviceLoad:
        """Counted work as seconds, as the clock counts it: a load that does not depend on the machine."""
        return DeviceLoad(generate_s=self.work.get("work/rollout/tokens", 0.0),
                          score_s=self.work.get("work/judge/samples", 0.0))

    def rollout_work(self) -> RolloutWork:
        return RolloutWork(policy_tokens=self.work.get("work/rollout/tokens", 0.0),
                           policy_prefill_tokens=self.work.get("work/rollout/prefill_tokens", 0.0),
                           judge_tokens=self.work.get("work/judge/tokens", 0.0),
                           judged_samples=self.work.get("work/judge/samples", 0.0))

    def engine_rounds(self) -> dict[str, EngineRounds]:
        return {}

    def utilisation(self, step_seconds: float) -> dict[str, float]:
        work, self.work = self.work, {}
        return work

    # ---- checkpoints --------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        if self.spec.group_rank == 0:
            self._log("save", self.step)
            dcp.save({"skill": torch.tensor([self.world.skill], dtype=torch.float64)},
                     checkpoint_id=str(Path(directory) / TRAINER_DIR), no_dist=True)

    def finish_checkpoint(self) -> float:
        return 0.0

    def load_checkpoint(self, directory: str) -> None:
        if self.spec.group_rank == 0:
            state = {"skill": torch.zeros(1, dtype=torch.float64)}
            dcp.load(state, checkpoint_id=str(Path(directory) / TRAINER_DIR), no_dist=True)
            self.world.skill = float(state["skill"])
            self._log("restore", float(state["skill"]))

    def save_policy(self, path: str) -> None:
        self._log("save_policy", path)

    def close(self) -> None:
        self._log("close")


def run_fake(cfg: JobConfig, world: FakeWorld | None = None) -> tuple[RunSummary, FakeWorld]:
    """Run job `cfg` (one controller, `runtime.devices_per_controller` fake devices) in this process, through
    the driver's checks and checkpoint choice; returns its summary and the fakes' world."""
    cfg, job_plan = prepare_run_dir(cfg)
    world = world or FakeWorld()
    specs = worker_specs(job_plan)
    tokenizer = load_tokenizer(cfg.model.path)
    one, zero = tokenizer.convert_tokens_to_ids("1"), tokenizer.convert_tokens_to_ids("0")
    workers = [FakeWorker(spec, cfg, world, one, zero) for spec in specs]
    world.trainers = sum("actor" in spec.roles for spec in specs)
    client = SliceClient([LocalHandle(w) for w in workers], specs, job_plan)
    ctx = replace(ControllerContext.for_job(cfg, client, tokenizer), clock=world.clock)
    with ctx.rewards:
        summary = run_controller(cfg, DistInfo(rank=0, world_size=1, device=torch.device("cpu")), ctx)
    client.close()
    return summary, world
