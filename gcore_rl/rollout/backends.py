"""Engine backends by name, and the one factory every engine of `gcore_rl` is built by (`build_engine`).

A backend is a builder `(EngineConfig, EngineSource) -> RolloutEngine`: registered here by name
(`builtin`: `GenerationEngine`, our continuous-batching engine), or named in `engine.backend` by its import
path (`package.module:build`), so a new backend needs no edit outside its own module. The builder is looked
up where the engine is built (a device worker's process), so an import path works under Ray too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from gcore_rl.configlib import check_import_path, load_callable
from gcore_rl.errors import ConfigError
from gcore_rl.models.lora import LoraSettings, inject_lora
from gcore_rl.rollout.protocol import RolloutEngine
from gcore_rl.rollout.vllm_server import VllmConfig


@dataclass(frozen=True)
class EngineSource:
    """What an engine serves and where: the model folder (Hugging Face, local), the device, the tokenizer's
    end-of-sequence and padding ids, the model's dtype and attention implementation, and the LoRA adapters
    it applies (a backend that cannot refuses a source with `lora`)."""

    model_path: str
    device: torch.device
    eos_id: int
    pad_id: int
    dtype: str = "float32"
    attn_implementation: str = "sdpa"
    lora: LoraSettings | None = None
    """Adapters the engine applies itself (`model.lora.sync=adapters`): the weight sync sends only them."""
    seed: int = 0
    """The run's seed, for backends that take one at start-up (vLLM's server)."""
    log_dir: str | None = None
    """Where a backend that runs a process of its own writes that process's log (None: the temporary folder)."""
    threads: int = 1
    """CPU threads a backend's own process may compute with."""


EngineBuilder = Callable[["EngineConfig", EngineSource], RolloutEngine]


def _builtin(cfg: EngineConfig, source: EngineSource) -> RolloutEngine:
    from gcore_rl.models.loading import load_causal_lm
    from gcore_rl.rollout.engine import GenerationEngine

    model = load_causal_lm(source.model_path, source.dtype, source.attn_implementation, source.device)
    if source.lora is not None:
        inject_lora(model, source.lora)
    return GenerationEngine(model, eos_id=source.eos_id, pad_id=source.pad_id, max_num_seqs=cfg.max_num_seqs,
                            min_admit=cfg.min_admit, logit_noise_std=cfg.logit_noise_std,
                            prefill_chunk_tokens=cfg.prefill_chunk_tokens, prefix_cache_tokens=cfg.prefix_cache_tokens,
                            finish_check_every=cfg.finish_check_every, cuda_graphs=cfg.cuda_graphs,
                            seeding=cfg.seeding)


def _vllm(cfg: EngineConfig, source: EngineSource) -> RolloutEngine:
    import os
    import tempfile
    from pathlib import Path

    from gcore_rl.rollout.vllm_engine import VllmEngine
    from gcore_rl.rollout.vllm_server import VllmServer

    if source.lora is not None:
        raise ConfigError("model.lora.sync", "'adapters' needs an engine that applies LoRA adapters itself; the vllm "
                          "backend takes merged weights (model.lora.sync=merged)")
    log = Path(source.log_dir or tempfile.gettempdir()) / f"vllm-{source.device.type}-{os.getpid()}.log"
    return VllmEngine(lambda: VllmServer(cfg.vllm, source.model_path, source.dtype, source.device.type, source.seed,
                                         log, threads=source.threads, max_num_seqs=cfg.max_num_seqs),
                      source.model_path, source.eos_id,
                      pause_when_asleep=source.device.type == "cpu", weight_sync=cfg.vllm.weight_sync)


BACKENDS: dict[str, EngineBuilder] = {"builtin": _builtin, "vllm": _vllm}
"""Backends by name (`engine.backend`)."""
APPLIES_ADAPTERS = frozenset({"builtin"})
"""Backends that apply LoRA adapters themselves (`EngineSource.lora`, `model.lora.sync=adapters`)."""
BUILTIN_ONLY = ("min_admit", "prefill_chunk_tokens", "logit_noise_std", "finish_check_every", "cuda_graphs", "seeding")
"""`EngineConfig` settings only the builtin engine reads (a vLLM engine refuses them; `max_num_seqs` it takes)."""


@dataclass
class EngineConfig:
    """Which backend generates, and the capacity and scheduling of the builtin one."""

    backend: str = field(default="builtin", metadata={"help": "Who generates: 'builtin' (our continuous-batching engine), 'vllm' (a vLLM server from the environment engine.vllm.python names; docs/engines.md), another registered backend's name, or the import path `package.module:build` of a builder `build(EngineConfig, EngineSource) -> RolloutEngine` (gcore_rl/rollout/protocol.py says what a backend must do)."})
    dtype: Literal["model", "float32", "bfloat16", "float16"] = field(default="model", metadata={"help": "The engine's parameter dtype: 'model' is the trained model's (model.dtype; a judge's: float32). A bfloat16 engine beside an fp32 trainer samples from a slightly other distribution: rollout/logprob_gap_max and mismatch/* measure it, algo.mismatch_correction corrects for it (docs/memory.md has a measured table)."})
    max_num_seqs: int = field(default=256, metadata={"help": "Sequences decoded together (rows of the KV pool); finished ones are refilled from the queue."})
    min_admit: int | None = field(default=None, metadata={"help": "Free rows that trigger a refill prefill while others decode (null = an eighth of max_num_seqs)."})
    prefill_chunk_tokens: int = field(default=0, metadata={"help": "Prefill an admission wider than this many token columns (longest prompt, left padding included) in successive forwards of at most this many columns, each attending to the KV cache of the earlier ones: a long prompt's activation memory is bounded by one chunk. Same completions and log-probs (to fp32 round-off); more, smaller forwards. Admissions with images are prefilled whole. 0 = off."})
    prefix_cache_tokens: int = field(default=0, metadata={"help": "Multi-turn rollouts: keep the keys/values of up to this many positions of finished sequences, so that a trajectory continued after a tool's or an environment's answer prefills only the answer (docs/multi-turn.md). Same tokens and log-probs (to fp32 round-off). 0 = off. vLLM caches prefixes itself and does not read it."})
    finish_check_every: int = field(default=0, metadata={"help": "Sampling rounds between the host's reads of the sampled tokens, where finished sequences leave the batch: between reads the host queues a GPU's forwards without waiting for each, and a sequence that ended holds its row until the next read. 0 = by device: 1 on a CPU (reading costs nothing there), 8 on CUDA. The samples depend on it (it changes which rows decode together), unless seeding=row."})
    seeding: Literal["call", "row"] = field(default="call", metadata={"help": "'call': one random stream per generate call, so a sample's draws depend on which rows decode beside it (max_num_seqs, finish_check_every). 'row': each sample draws from its own table of uniforms (the call's seed, its index, its token position), the same samples whatever decodes beside it, on any device. Not with logit_noise_std."})
    cuda_graphs: bool = field(default=True, metadata={"help": "On CUDA, decode at static shapes (the batch padded to a power of two, attention over the pool's columns) under one CUDA graph per batch size, so a decode step is one replay instead of a launch per kernel (gcore_rl/rollout/static_decode.py). A CPU decodes eagerly whatever this says."})
    added_seconds_tail: float = field(default=0.0, metadata={"help": "Experiments: each generate call on a rollout device also waits this many seconds times a Pareto(1.5) draw seeded by the call's seed (median 1.6x, one call in 11 over 5x; counted as generation time), to emulate generation with a long tail. 0 = off."})

    vllm: VllmConfig = field(default_factory=VllmConfig, metadata={"help": "The vLLM server of engine.backend=vllm."})

    logit_noise_std: float = field(default=0.0, metadata={"help": "Debugging and the mismatch demo only: add Gaussian noise of this std to the engine's logits before each sampled token (not in greedy decoding), so the engine samples from, and reports the log-probs of, a distribution other than the trainer's (benchmarks/mismatch.py). 0 = off."})

    def validate(self) -> None:
        if self.backend not in BACKENDS:
            try:
                check_import_path(self.backend, "backend")
            except ConfigError:
                raise ConfigError("backend", f"'{self.backend}' is neither a known backend ({', '.join(sorted(BACKENDS))}) "
                                  "nor an import path `package.module:build`") from None
        if not self.logit_noise_std >= 0:
            raise ConfigError("logit_noise_std", f"must be >= 0 (0 = off), got {self.logit_noise_std}")
        if self.added_seconds_tail < 0:
            raise ConfigError("added_seconds_tail", f"must be >= 0, got {self.added_seconds_tail}")
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be at least 1, got {self.max_num_seqs}")
        if self.prefill_chunk_tokens < 0:
            raise ConfigError("prefill_chunk_tokens", f"must be >= 0 (0 = off), got {self.prefill_chunk_tokens}")
        if self.prefix_cache_tokens < 0:
            raise ConfigError("prefix_cache_tokens", f"must be >= 0 (0 = off), got {self.prefix_cache_tokens}")
        if self.finish_check_every < 0:
            raise ConfigError("finish_check_every", f"must be >= 0 (0 = by device), got {self.finish_check_every}")
        if self.seeding == "row" and self.logit_noise_std > 0:
            raise ConfigError("seeding", "'row' draws one uniform per sample and token, and logit_noise_std needs "
                              "a draw per vocabulary entry; use seeding=call with logit_noise_std, or "
                              "logit_noise_std=0")
        if self.min_admit is not None and not 1 <= self.min_admit <= self.max_num_seqs:
            raise ConfigError("min_admit", f"must be between 1 and max_num_seqs={self.max_num_seqs}, got {self.min_admit}")
        if self.backend == "vllm":  # what only the builtin engine reads must not be ignored silently
            default = EngineConfig()
            for key in BUILTIN_ONLY:
                if getattr(self, key) != getattr(default, key):
                    raise ConfigError(key, f"is {getattr(self, key)!r}, a setting of the builtin engine, and "
                                      "backend=vllm does not read it (the vLLM server's own settings are under "
                                      "vllm.*); remove it, or use backend=builtin")


def engine_dtype(cfg: EngineConfig, model_dtype: str) -> str:
    """The dtype an engine loads its model in: `cfg.dtype`, or `model_dtype` for 'model'."""
    return model_dtype if cfg.dtype == "model" else cfg.dtype


def engine_builder(cfg: EngineConfig, key: str = "engine.backend") -> EngineBuilder:
    """The builder `cfg.backend` names: a registered backend, or one imported by its path (ConfigError naming
    `key`, the backend's dotted config key, when it cannot be imported)."""
    return BACKENDS.get(cfg.backend) or load_callable(cfg.backend, key)


def build_engine(cfg: EngineConfig, source: EngineSource, key: str = "engine.backend") -> RolloutEngine:
    """The engine of backend `cfg.backend` serving `source` (see `engine_builder` for `key`)."""
    return engine_builder(cfg, key)(cfg, source)
