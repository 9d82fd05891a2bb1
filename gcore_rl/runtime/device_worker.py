"""The worker process of one device: hosts the roles the plan puts there and serves the controller.

One `DeviceWorker` per device (a Ray actor, or a plain object inside the controller's process in
the local runtime). Depending on its `WorkerSpec` it holds

- a trainer worker: a `PolicyTrainer` (the FSDP shard of the actor + the frozen reference) in the
  trainer group that spans every training device of every slice;
- a critic worker (`placement.critic_devices` > 0): a `CriticTrainer`, the FSDP shard of PPO's value
  model in the critic group, which spans every critic device of every slice;
- a rollout engine: a full copy of the policy for generation;
- the model rewards of its reward roles, one `RewardScorer` per kind (`gcore_rl.rewards.kinds`): the
  judge's engine (a generative reward model), a scalar reward model's sequence-classification head;
- under `interleave`, a whole frozen reference (`ReferenceScorer`) for log-probs in the rollout phase.

Time sharing (`spec.time_share`, unless `runtime.time_share=false` keeps every model resident): the device
is used by one role at a time (the reward models,
which score the same samples, count as one). Before a role runs, the
models of the other roles release their memory (`sleep`): the policy engine keeps a host copy
between waves and discards its weights for the update (the sync after training refills them);
the reward models always keep a host copy. Swaps are timed as role `swap`.

Every call records what the device did in `timeline/device-<d>.jsonl` and in the per-step
utilisation the controller collects with `utilisation`, together with how much work each role
did (`work/<role>/<count>`: decode steps, prefilled and generated tokens, trained tokens, synced
bytes, swaps), which is what `gcore-rl simulate --calibrate` fits the simulator's costs to.
"""

from __future__ import annotations

import functools
import inspect
import os
import random
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from gcore_rl.checkpoint.layout import CRITIC_DIR, CRITIC_STATE, TRAINER_DIR, TRAINER_STATE
from gcore_rl.config import JobConfig, engine_context
from gcore_rl.configlib import from_dict
from gcore_rl.controller.seeds import seed_global_rngs
from gcore_rl.data.chat import resolve_chat_template
from gcore_rl.disk import writing
from gcore_rl.distributed import destroy_process_group, init_process_group, resolve_device
from gcore_rl.faults import maybe_fail
from gcore_rl.models.loading import (
    load_causal_lm,
    load_tokenizer,
    quiet_hf_libraries,
    save_beside_weights,
)
from gcore_rl.oom import naming
from gcore_rl.placement.plan import STRATEGY_TRAITS, WorkerSpec
from gcore_rl.placement.rebalance import DeviceLoad
from gcore_rl.records import Completion, EngineRounds, ModelScores, RewardInput, RolloutWork, TokenBatch
from gcore_rl.rewards.kinds import RewardScorer, reward_kinds
from gcore_rl.rollout.backends import EngineSource, build_engine, engine_dtype
from gcore_rl.rollout.functions import RolloutRequest, checked_rollout, load_rollout_function
from gcore_rl.rollout.protocol import RolloutEngine
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.rollout.stats import EngineStats, counted_stats, probe_rounds
from gcore_rl.telemetry.heartbeat import Heartbeat
from gcore_rl.telemetry.metrics import PhasePeaks, PhaseTimer, peak_rss_mib
from gcore_rl.telemetry.timeline import TimelineRecorder, device_roles
from gcore_rl.training.critic_trainer import CriticTrainer
from gcore_rl.training.offload import TrainerOffload
from gcore_rl.training.policy_trainer import PolicyTrainer
from gcore_rl.training.reference import ReferenceScorer
from gcore_rl.training.shapes import update_shape
from gcore_rl.training.trainer_checkpoint import TrainerCheckpointer

MIB = 1024 * 1024
DEVICE_PROCESS_OFFSET = 100_000
"""Added to a device's index to number its process apart from the controllers' for `seed_global_rngs`."""


def names_oom(role: str, phase: str):
    """Decorate a worker method so that a failed allocation in it becomes `OutOfMemory` naming `role`, `phase`,
    this device and the step (`DeviceWorker.naming_oom`); generator methods too."""
    def wrap(method):
        def where(worker: DeviceWorker):
            return worker.naming_oom(role, phase)

        if inspect.isgeneratorfunction(method):
            @functools.wraps(method)
            def stream(self, *args, **kwargs):
                with where(self):
                    yield from method(self, *args, **kwargs)
            return stream

        @functools.wraps(method)
        def call(self, *args, **kwargs):
            with where(self):
                return method(self, *args, **kwargs)
        return call
    return wrap


class DeviceWorker:
    """Roles of one device (see the module docstring).

    Args:
        spec: what this device hosts.
        cfg_dict: the job config as a plain dict (`configlib.to_dict`).
        trainer_group: (address, port) of rank 0 of the group this device trains in (the trainer
            group, or the critic group of a critic device) to join, or None when the caller already
            initialised `torch.distributed` for this process (local runtime).
        workdir: directory to resolve the config's relative paths against (Ray workers).
        cuda_index: CUDA device of this worker on its node (default: the global device index).
    """

    config_type: type = JobConfig
    """The job config this worker reads (`ImageDeviceWorker`: a diffusion job's)."""

    def __init__(self, spec: WorkerSpec, cfg_dict: dict, trainer_group: tuple[str, int] | None = None,
                 workdir: str | None = None, cuda_index: int | None = None):
        if workdir is not None:
            os.chdir(workdir)
        quiet_hf_libraries()
        cfg = from_dict(self.config_type, cfg_dict)
        torch.set_num_threads(cfg.runtime.threads_per_process or max(1, (os.cpu_count() or 1) // cfg.runtime.devices))
        self.spec = spec
        self.cfg = cfg
        self.device = resolve_device(cfg.runtime.device, local_rank=spec.device if cuda_index is None else cuda_index)
        self._owns_group = trainer_group is not None and spec.group_rank is not None
        if self._owns_group:
            init_process_group(spec.group_rank, spec.group_world, trainer_group[1], self.device, trainer_group[0])
        torch.manual_seed(cfg.run.seed)
        self.checkpointer = TrainerCheckpointer(cfg.run.checkpoint_write)
        self.step = 0
        self._build_roles()
        path = Path(cfg.run.output_dir) / "timeline" / f"device-{spec.device}.jsonl"
        self.timeline = TimelineRecorder(spec.device, path, device_roles(self.scorers))
        # the watchdog of hang detection (runtime/healing.py) reads when this device last finished a phase
        self.heartbeat = (Heartbeat(cfg.run.output_dir, f"device-{spec.device}") if cfg.runtime.phase_timeout_s > 0
                          else None)
        self.memory = PhasePeaks(self.device)  # before the timer: its spans report to it
        self.timer = PhaseTimer(on_span=self._on_span)
        self.released_bytes = 0
        self.cuda_freed_bytes = 0
        self.work: dict[str, float] = {}
        self.fixed: dict[str, float] = {}  # `<role>/fixed_s` of the step (see `device_load`)
        self.rounds: dict[str, EngineRounds] = {}  # each engine's decode rounds of the step (see `engine_rounds`)
        self.probes = self._probe_engines()

    def _build_roles(self) -> None:
        """The models of the roles the plan puts on this device (a language or vision-language policy's): the
        tokenizer, the trainer (and critic), the engine and its rollout function, the reward models by kind, and the
        reference of `interleave`."""
        cfg, spec = self.cfg, self.spec
        self.tokenizer = load_tokenizer(cfg.model.path)
        self.context = engine_context(cfg)  # what a rollout function may generate up to
        if cfg.data.chat_template is not None:  # a rollout function renders turns as the prompts were rendered
            self.tokenizer.chat_template = resolve_chat_template(self.tokenizer, cfg.data.chat_template, cfg.model.path)
        self.trainer = self._build_trainer() if "actor" in spec.roles else None
        self.critic = self._build_critic() if spec.critic_rank is not None else None
        self.offload = TrainerOffload(cfg.train.offload, self.device)
        self.engine = self._build_engine() if "rollout" in spec.roles else None
        self.rollout_fn = load_rollout_function(cfg.rollout) if "rollout" in spec.roles else None
        # the model rewards this device hosts, by kind (a kind's name is its role)
        self.scorers: dict[str, RewardScorer] = {name: kind.build(cfg, self.device, cfg.run.seed)
                                                 for name, kind in reward_kinds().items() if name in spec.roles}
        self.reference = self._build_reference() if spec.reference_phase == "rollout" else None

    # ---- construction -------------------------------------------------------------------

    def _build_trainer(self) -> PolicyTrainer:
        cfg = self.cfg
        return PolicyTrainer.build(cfg.model.path, dtype=cfg.model.dtype, attn_implementation=cfg.model.attn_implementation,
                                   reference_path=cfg.reference_path, train=cfg.train,
                                   algo=cfg.algo.resolved(cfg.sampling.max_new_tokens),
                                   logprob_temperature=cfg.sampling.logprob_temperature, device=self.device,
                                   bf16=cfg.train.bf16_on(self.device),
                                   critic=cfg.critic,
                                   with_reference=self.spec.reference_phase == "update",
                                   with_critic=self.spec.critic_world == 0, lora=cfg.model.lora)

    def _build_critic(self) -> CriticTrainer:
        cfg = self.cfg
        return CriticTrainer.build(cfg.model.path, cfg.critic, dtype=cfg.model.dtype,
                                   attn_implementation=cfg.model.attn_implementation, train=cfg.train,
                                   algo=cfg.algo.resolved(cfg.sampling.max_new_tokens), device=self.device,
                                   bf16=cfg.train.bf16_on(self.device))

    def _build_reference(self) -> ReferenceScorer:
        cfg = self.cfg
        model = load_causal_lm(cfg.reference_path or cfg.model.path, cfg.model.dtype, cfg.model.attn_implementation,
                               self.device)
        return ReferenceScorer(model, temperature=cfg.sampling.logprob_temperature,
                               batching=cfg.train.batching, pad_id=self.tokenizer.pad_token_id,
                               device=self.device, bf16=cfg.train.bf16_on(self.device))

    @property
    def _syncs_adapters(self) -> bool:
        """The weight sync sends LoRA adapters alone, which the engine applies to the base it keeps."""
        return self.cfg.model.lora.enabled and self.cfg.model.lora.sync == "adapters"

    def _build_engine(self) -> RolloutEngine:
        cfg = self.cfg
        return build_engine(cfg.engine, EngineSource(cfg.model.path, self.device, self.tokenizer.eos_token_id,
                                                     self.tokenizer.pad_token_id, engine_dtype(cfg.engine, cfg.model.dtype),
                                                     cfg.model.attn_implementation,
                                                     cfg.model.lora if self._syncs_adapters else None,
                                                     seed=cfg.run.seed, log_dir=str(Path(cfg.run.output_dir) / "engines"),
                                                     threads=torch.get_num_threads()))

    def _probe_engines(self) -> dict[str, EngineRounds]:
        """Decode rounds of each generation engine at several batch sizes (`probe_rounds`), timed once at the
        start, for the forecast's engine fit (`fits_engines`): rounds of one batch size cannot separate its two terms."""
        if not fits_engines(self.cfg):
            return {}
        engines = {"rollout": (self.engine, self.tokenizer.pad_token_id if self.engine else None),
                   **{name: (scorer.engine, scorer.pad_id) for name, scorer in self.scorers.items()}}
        return {role: EngineRounds.of_call(*probe_rounds(engine, pad_id), 0, 0, 0, 0)
                for role, (engine, pad_id) in engines.items() if engine is not None}

    def _on_span(self, phase: str, start: float, end: float) -> None:
        self.timeline.record(phase, start, end)
        self.memory.close(phase)
        if self.heartbeat is not None:
            self.heartbeat.record(phase, start, end)

    # ---- time sharing -------------------------------------------------------------------

    def _engines(self) -> dict[str, Any]:
        """The models that sleep and wake on a time-shared device, by role (engines, reward models, the reference)."""
        engines = {"rollout": self.engine, **{name: scorer.resident for name, scorer in self.scorers.items()},
                   "reference": self.reference}
        return {role: engine for role, engine in engines.items() if engine is not None}

    def _use(self, *roles: str, keep_trainer: bool = False) -> None:
        """Give the device to `roles`: the other roles' models sleep, theirs wake. The trainer's state leaves
        the device (`train.offload`) unless a trainer role is among `roles` or `keep_trainer` (a weight sync
        gathers from it)."""
        if not (self.spec.time_share and self.cfg.runtime.time_share):
            return
        engines = self._engines()
        # for training, the policy engine's weights are stale anyway: drop them, even a host copy (unless the sync
        # refills only LoRA adapters: the engine's base must stay)
        training = "actor" in roles or "critic" in roles
        drops = training and not self._syncs_adapters
        others = {r: e for r, e in engines.items()
                  if r not in roles and (e.state == "awake" or (r == "rollout" and drops and e.state == "offloaded"))}
        if others:
            with self.timer.phase("swap/sleep"):
                for other, engine in others.items():
                    self._sleep(engine, "discard" if other == "rollout" and drops else "offload")
        self._place_trainer(resident=training or keep_trainer)
        waking = [engines[r] for r in roles if r in engines and engines[r].state != "awake"]
        if waking:
            with self.timer.phase("swap/wake"):
                for engine in waking:
                    engine.wake()
            self._count("swap", wakes=len(waking))

    def _place_trainer(self, resident: bool) -> None:
        """Move this device's trainer state back (`resident`) or off the device (`train.offload`), timed as a swap."""
        trainer = self.trainer or self.critic
        if trainer is None or self.offload.level == "none" or self.offload.offloaded != resident:
            return
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        with self.timer.phase("swap/wake" if resident else "swap/sleep"):
            parts = trainer.offload_parts()
            moved = self.offload.reload(parts) if resident else self.offload.offload(parts)
        if not resident:
            self._count("swap", trainer_offloaded_bytes=moved)
            if self.device.type == "cuda":
                self.cuda_freed_bytes += max(before - torch.cuda.memory_allocated(self.device), 0)

    def _count(self, role: str, **counts: float) -> None:
        for name, value in counts.items():
            key = f"work/{role}/{name}"
            self.work[key] = self.work.get(key, 0.0) + float(value)

    def _count_engine(self, role: str, stats: EngineStats) -> None:
        """Add one rollout's (or a generating reward model's call's) engine statistics to the step's work
        counters and rounds."""
        self._count(role, calls=1, decode_steps=stats.decode_steps, prefills=stats.prefills,
                    prefill_tokens=stats.prefill_tokens, cached_tokens=stats.cached_tokens,
                    tokens=stats.generated_tokens)
        call = EngineRounds.of_call(stats.round_batches, stats.round_seconds, stats.decode_steps,
                                    stats.generated_tokens, stats.prefills, stats.prefill_tokens)
        self.rounds[role] = self.rounds.get(role, EngineRounds()) + call
        # the time no smaller share would have saved: all of it for the policy's call, one batch's for a judge
        key = f"{role}/fixed_s"
        fixed = stats.fixed_seconds
        self.fixed[key] = self.fixed.get(key, 0.0) + fixed if role == "rollout" else max(self.fixed.get(key, 0.0), fixed)

    def _sleep(self, engine: Any, level: str) -> None:
        before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        released = engine.sleep(level)
        self.released_bytes += released
        self._count("swap", sleeps=1, released_bytes=released)
        if self.device.type == "cuda":
            self.cuda_freed_bytes += max(before - torch.cuda.memory_allocated(self.device), 0)

    # ---- rollout phase ------------------------------------------------------------------

    @names_oom("rollout", "generation")
    def generate_stream(self, prompt_ids: list[list[int]], sampling: SamplingConfig, seed: int) -> Iterator[list[Completion]]:
        """Completions as they finish, made by the job's rollout function (`rollout.function`, by default one
        engine call per sample) beside this device's engine, each held to the function's contract.

        Only the time spent generating counts as busy, not the time the consumer holds a chunk. The engine's
        statistics (or, for a backend that keeps none, what the completions tell) go to the work counters.
        """
        self._use("rollout")
        cfg = self.cfg
        request = RolloutRequest(self.engine, prompt_ids, sampling, seed, self.tokenizer, cfg.rollout.options,
                                 context=self.context)
        self.engine.take_stats()  # what earlier calls (a probe) did is not this rollout's
        stream = checked_rollout(self.rollout_fn(request), len(prompt_ids), sampling.n, cfg.rollout.function)
        received: list[Completion] = []
        while True:
            with self.timer.phase("rollout/generate"):
                chunk = next(stream, None)
                if chunk is None and cfg.engine.added_seconds_tail > 0:  # an injected long tail (experiments)
                    time.sleep(cfg.engine.added_seconds_tail * random.Random(seed).paretovariate(1.5))
            if chunk is None:
                stats = self.engine.take_stats()
                self._count_engine("rollout", stats if stats is not None else counted_stats(received))
                return
            maybe_fail("generate", self.step)
            received.extend(chunk)
            yield chunk

    def naming_oom(self, role: str, phase: str):
        """A block in which a failed allocation becomes `OutOfMemory` naming `role`, `phase`, this device and the step."""
        return naming(role, phase, f"{self.device} (device {self.spec.device})", self.step)

    def score_samples(self, samples: list[RewardInput]) -> ModelScores:
        """The model rewards of `samples` (input order): each hosted kind's verdicts, by kind."""
        with self.naming_oom(", ".join(self.scorers), "wake-up"):
            self._use(*self.scorers)
        maybe_fail("score", self.step)
        out: ModelScores = {}
        for name, scorer in self.scorers.items():
            with self.naming_oom(name, "scoring"), self.timer.phase(f"rollout/{name}"):
                out[name] = scorer.score(samples)
            stats = scorer.take_stats()
            if stats is not None:  # a generating kind: its engine's work, priced as a judge's
                self._count_engine(name, stats)
                self._count(name, samples=len(samples))
        return out

    @names_oom("reference", "log-probs")
    def reference_logprobs(self, completions: list[Completion]) -> list[list[float]]:
        """The frozen reference's log-probs of each completion's tokens (input order), in the rollout phase."""
        self._use("reference")
        with self.timer.phase("rollout/reference"):
            out = self.reference.logprobs(completions)
        self._count("reference", samples=len(completions), tokens=sum(len(c.token_ids) for c in completions))
        return out

    # ---- update phase -------------------------------------------------------------------

    @names_oom("actor", "update")
    def train(self, batch: TokenBatch) -> dict[str, float]:
        """Prepare (old / reference log-probs) and train on this worker's rows of the step.

        Every trainer worker of every slice calls this once per step with the same number of rows
        (the FSDP collectives pair up micro-batch by micro-batch).
        """
        self._use("actor")
        lengths = batch.attention_mask.sum(dim=-1).tolist()
        tokens = float(sum(lengths))
        passes = self.trainer.prepare_passes
        train = self.cfg.train
        optimiser_steps, _ = update_shape(batch.size, train.micro_batch_size, train.mini_batches, train.ppo_epochs)
        # the passes this rank plans (by row count, or by the token budget), not the row-count micro-batches
        micro_batches = train.batching.update_passes(lengths, train.mini_batches, train.ppo_epochs)
        trains_actor = not self.trainer.actor_frozen  # a warming-up critic trains alone
        self._count("actor", rows=batch.size, tokens=tokens, optimiser_steps=optimiser_steps * trains_actor,
                    micro_batches=micro_batches * trains_actor, prepare_tokens=tokens * passes,
                    prepare_micro_batches=passes * train.batching.planned(lengths))
        if self.trainer.critic is not None:  # its value pass is among the prepare passes above
            self._count_critic(lengths, values_pass=False)
        with self.timer.phase("update/prepare"):
            trainer_logprobs = self.trainer.prepare(batch)
        maybe_fail("train", self.step)
        with self.timer.phase("update/train"):
            stats = self.trainer.update(batch, trainer_logprobs)
            time.sleep(train.added_seconds_per_update)  # an injected slower update (tests and demonstrations)
            return stats

    @names_oom("critic", "update")
    def critic_step(self, batch: TokenBatch) -> Iterator[torch.Tensor | dict[str, float]]:
        """A critic device's part of the update: first the values `[B, T]` of its rows (which the
        actor's devices need for GAE), then, once the controller has taken them, the critic's update
        on the returns of the same values (`CriticTrainer`), whose statistics are the second item.

        Every critic device of every slice calls this once per step with the same number of rows.
        """
        self._use("critic")
        self._count_critic(batch.attention_mask.sum(dim=-1).tolist(), values_pass=True)
        with self.timer.phase("update/critic_values"):
            values = self.critic.values(batch)
        yield values
        maybe_fail("train", self.step)
        with self.timer.phase("update/critic"):
            stats = self.critic.update(batch, values)
            time.sleep(self.cfg.train.added_seconds_per_update)  # an injected slower update, as for the actor
        yield stats

    def _count_critic(self, lengths: list[int], values_pass: bool) -> None:
        """`work/critic/*` of an update over rows of `lengths` tokens: rows, tokens, optimiser steps and the
        passes it plans (padded, training/critic.py); with `values_pass` its value pass too (a critic device;
        next to the actor that pass is among the actor's prepare passes)."""
        train = self.cfg.train
        optimiser_steps, _ = update_shape(len(lengths), train.micro_batch_size, train.mini_batches, train.ppo_epochs)
        padded = replace(train.batching, packed=False)
        values = {"prepare_micro_batches": padded.planned(lengths)} if values_pass else {}
        self._count("critic", rows=len(lengths), tokens=float(sum(lengths)), optimiser_steps=optimiser_steps,
                    micro_batches=padded.update_passes(lengths, train.mini_batches, train.ppo_epochs), **values)

    @names_oom("rollout", "weight sync")
    def sync_weights(self, version: int, load: bool = True) -> None:
        """Gather the weights of update `version` (a collective over all trainers) into this device's engine.

        With `load=False` (a `dynamic` device that serves the reward models next step) the device
        only takes part in the gather, and its policy engine stays discarded until a later sync.
        """
        load = load and self.engine is not None
        if load:
            self._use("rollout", keep_trainer=True)  # wakes the engine; its discarded weights are refilled here
        gathered = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal gathered
            for name, tensor in self._full_weights():
                gathered += tensor.numel() * tensor.element_size()
                yield name, tensor

        with self.timer.phase("update/sync"):
            if load:
                self.engine.load_weights(counted(), version=version)  # one tensor at a time, as it is gathered
            else:
                for _ in counted():  # take part in the gather
                    pass
        self._count("sync", bytes=gathered, loads=int(load))

    def _full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The trainer's gathered weights one tensor at a time (a collective); the `sync` fault point halfway."""
        self._place_trainer(resident=True)
        halfway = len(list(self.trainer.model.parameters())) // 2
        for index, named in enumerate(self.trainer.sync_weights()):
            if index == halfway:
                maybe_fail("sync", self.step)
            yield named

    @names_oom("rollout", "weight sync")
    def publish_weights(self, bucket_bytes: int, version: int = 0, load: bool = False) -> Iterator[dict[str, torch.Tensor]]:
        """Gather the updated weights (a collective over all trainers); the slice's publishing trainer
        yields them as CPU copies in buckets of about `bucket_bytes`, the others yield nothing.

        With `load` (a trainer device that also generates, beside a critic device that does) the
        gathered tensors also go into this device's own engine as update `version`, one at a time, as
        `sync_weights` loads them: a worker runs one call at a time, so a `load_weights` call sent to it
        would wait for this stream, which waits for the others' gather."""
        if load:
            self._use("rollout", keep_trainer=True)
        with self.timer.phase("update/sync"):
            bucket: dict[str, torch.Tensor] = {}
            size = 0
            for name, tensor in self._full_weights():
                if load:
                    self.engine.load_weights([(name, tensor)], final=False, version=version)
                if not self.spec.publishes_weights:
                    continue  # take part in the gather
                bucket[name] = tensor.detach().to("cpu", copy=True)
                size += tensor.numel() * tensor.element_size()
                if size >= bucket_bytes:
                    yield bucket
                    bucket, size = {}, 0
            if load:
                self.engine.load_weights([], final=True, version=version)
            if bucket:
                yield bucket

    @names_oom("rollout", "weight load")
    def load_weights(self, weights: dict[str, torch.Tensor], version: int, final: bool = True) -> int:
        """Load (part of) the weights of update `version` published by a trainer into this device's
        rollout engine; `final` ends the update (see `RolloutEngine.load_weights`)."""
        self._use("rollout")
        with self.timer.phase("rollout/load_weights"):
            return self.engine.load_weights(weights.items(), final=final, version=version)

    # ---- checkpoints --------------------------------------------------------------------

    def save_checkpoint(self, directory: str) -> None:
        """Stage this trainer's (or critic's) state and start writing it into the checkpoint folder
        `directory` (`TrainerCheckpointer.save`: the trainer's under `trainer/`, a critic device's under
        `critic/`); returns before the write ends. Devices that train nothing do nothing."""
        self._place_trainer(resident=True)
        if self.trainer is not None:
            with self.timer.phase("checkpoint/stage"):
                self.checkpointer.save(self.trainer, directory, TRAINER_DIR, TRAINER_STATE)
        elif self.critic is not None:
            with self.timer.phase("checkpoint/stage"):
                self.checkpointer.save(self.critic, directory, CRITIC_DIR, CRITIC_STATE)

    def finish_checkpoint(self) -> float:
        """Wait for the checkpoint write in flight; the seconds waited (0 when it was already done)."""
        return self.checkpointer.wait() if self.spec.group_rank is not None else 0.0

    def load_checkpoint(self, directory: str) -> None:
        """Restore this trainer's (or critic's) state from the checkpoint folder `directory`, resharded to
        this device's group (the driver has checked that the critic is where it was saved, `runtime/resume.py`)."""
        self._place_trainer(resident=True)
        if self.trainer is not None:
            self.checkpointer.load(self.trainer, directory, TRAINER_DIR, TRAINER_STATE)
        elif self.critic is not None:
            self.checkpointer.load(self.critic, directory, CRITIC_DIR, CRITIC_STATE)

    # ---- bookkeeping --------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.step = step
        seed_global_rngs(self.cfg.run.seed, step, DEVICE_PROCESS_OFFSET + self.spec.device)
        self.timeline.begin_step(step)
        if self.heartbeat is not None:
            self.heartbeat.begin_step(step)
        self.work = {}
        self.fixed = {}
        self.rounds = {}

    def device_load(self) -> DeviceLoad:
        """How long each side of the rollout phase has kept this device busy so far in the step, with
        the part no smaller share of the work would have saved: the policy engine's decode steps at
        their fixed per-step cost; for a generating reward model (the judge), that of its largest call."""
        busy = self.timeline.busy_seconds()
        kinds = reward_kinds()
        return DeviceLoad(generate_s=busy.get("rollout", 0.0), generate_fixed_s=self.fixed.get("rollout/fixed_s", 0.0),
                          score_s=sum(busy.get(role, 0.0) for role in kinds),
                          score_fixed_s=max((self.fixed.get(f"{role}/fixed_s", 0.0) for role in kinds), default=0.0),
                          swap_s=busy.get("swap", 0.0))

    def rollout_work(self) -> RolloutWork:
        """The work behind `device_load`, counted: tokens the policy and the generating reward models (the
        judge) generated and prefilled so far in the step, and samples judged (`work/rollout/*`,
        `work/<kind>/*` counters)."""
        work = self.work
        judging = [name for name, kind in reward_kinds().items() if kind.generates]

        def judged(counter: str) -> float:
            return sum(work.get(f"work/{name}/{counter}", 0.0) for name in judging)

        return RolloutWork(policy_tokens=work.get("work/rollout/tokens", 0.0),
                           policy_prefill_tokens=work.get("work/rollout/prefill_tokens", 0.0),
                           judge_tokens=judged("tokens"), judge_prefill_tokens=judged("prefill_tokens"),
                           judged_samples=judged("samples"))

    def engine_rounds(self) -> dict[str, EngineRounds]:
        """Each generation engine's decode rounds and work so far in the step, by role (`rollout`, a judge's kind),
        with the seconds that role kept the device busy, and the rounds of its start-up probe
        (`_probe_engines`): what the run's forecast fits engine costs to."""
        busy = self.timeline.busy_seconds()
        out = {role: replace(rounds, busy_s=busy.get(role, 0.0)) for role, rounds in self.rounds.items()}
        for role, probe in self.probes.items():
            out[role] = out.get(role, EngineRounds()) + probe
        return out

    def utilisation(self, step_seconds: float) -> dict[str, float]:
        """This device's busy / swap / idle seconds of the step, and its memory figures."""
        metrics = {**self.timeline.utilisation(step_seconds), **self.work}
        metrics["memory/engine_released_mib"] = self.released_bytes / MIB
        metrics["memory/worker_peak_rss_mib_max"] = peak_rss_mib()
        metrics.update(self.memory.take())
        if self.device.type == "cuda":
            metrics["memory/cuda_freed_by_sleep_mib"] = self.cuda_freed_bytes / MIB
        self.released_bytes = 0
        self.cuda_freed_bytes = 0
        self.work = {}
        return metrics

    def save_policy(self, path: str) -> None:
        """Write the engine's (freshly synced) policy as a Hugging Face model folder."""
        self._use("rollout")
        with writing(path, "the final model"):
            self.engine.save_pretrained(Path(path))
            save_beside_weights(self.tokenizer, Path(path), Path(self.cfg.model.path))

    def ready(self) -> int:
        return self.spec.device

    def close(self) -> None:
        for owner in (self.rollout_fn, self.engine, *(scorer.engine for scorer in self.scorers.values())):
            closing = getattr(owner, "close", None)  # tool_turns' pools, an engine's server process
            if closing is not None:
                closing()
        self.checkpointer.close()
        self.timeline.close()
        if self._owns_group:
            destroy_process_group()



def fits_engines(cfg: JobConfig) -> bool:
    """Whether the run's forecast fits engine costs (`placement.forecast.engine_window` under the replay
    forecast of a plan that rebalances), so the engines are probed at the start."""
    forecast = cfg.placement.forecast
    return (forecast.engine_window > 0 and forecast.model == "replay"
            and STRATEGY_TRAITS[cfg.placement.strategy].rebalances)
