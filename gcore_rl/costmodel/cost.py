"""Cost formulas of the simulator: pure functions of (work, hardware, model, constants) -> seconds.

Every fitted or assumed number lives in `CostConstants`; every formula below is a plain function
of those constants and of the work it prices (tokens, decode steps, bytes), so a calibration can
fit the constants from measured phase times and the work the simulator reports for the same
phases (`DecodeRun` features, `StepRecord.features`).

Units: seconds, bytes, FLOP, tokens. N = `ModelSpec.params`. A "device" is one GPU.

| phase | formula |
|---|---|
| prefill | 2 N tokens / (prefill_mfu x peak x tp) |
| one decode step | max((W + kv x KV) / (tp x eff x hbm), 2 N active / (tp x peak x decode_mfu)) + step_overhead_s + layers x layer_overhead_s |
| log-prob pass | 2 N tokens / (logprob_mfu x peak x devices) + micro-batches x pass_overhead_s |
| training | 6 N (8 N with gradient checkpointing) tokens x epochs / (train_mfu x peak x devices) + micro-batches x train_pass_overhead_s + optimiser steps x optimizer_step_s |
| engine offload | shard bytes / host_link |
| engine wake | shard bytes / host_link + engine_wake_s |
| weight sync | W / link(devices) + sync_overhead_s |
| controller data plane | bytes of the controller's shard / controller_bandwidth |

W = weight bytes, kv = KV bytes per token, KV = tokens held in the KV cache by the active batch,
eff = decode_bandwidth_efficiency, link = NVLink within a node, the NIC across nodes. The update
phase prices the tokens of its slowest trainer rank (`phases.trainer_split`).
Second-order effects left out on purpose: attention FLOPs (quadratic in length) in the seconds of
every phase (they decide only how the update's rows are split over the trainer ranks, as in the
runtime), tensor-parallel all-reduces inside an engine, overlap of FSDP communication with compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from gcore_rl.costmodel.hardware import Hardware
from gcore_rl.costmodel.models import ModelSpec
from gcore_rl.errors import ConfigError


@dataclass(frozen=True)
class CostConstants:
    """Every constant the cost formulas use. Defaults are for datacenter GPUs (their sources: docs/simulator.md)."""

    decode_bandwidth_efficiency: float = field(default=0.75, metadata={"help": "Share of HBM bandwidth a decode step achieves reading weights + KV, in (0, 1]. The default is assumed, not measured; calibrate."})
    decode_mfu: float = field(default=0.5, metadata={"help": "Share of peak FLOP/s of a compute-bound decode step (large batches), in (0, 1]. The default is assumed, not measured."})
    prefill_mfu: float = field(default=0.5, metadata={"help": "Share of peak FLOP/s of prefill (compute-bound), in (0, 1]. The default is assumed, as decode_mfu's."})
    logprob_mfu: float = field(default=0.45, metadata={"help": "Share of peak FLOP/s of a forward-only log-prob pass under FSDP (old and reference log-probs), in (0, 1]."})
    train_mfu: float = field(default=0.4, metadata={"help": "Share of peak FLOP/s of FSDP training (forward + backward = 6N per token), in (0, 1]."})
    step_overhead_s: float = field(default=0.003, metadata={"help": "Fixed seconds per decode step on top of the roofline (scheduling, sampling, kernel launches). Assumed ~3 ms for a CUDA-graph serving engine; on CPU this term dominates."})
    engine_wake_s: float = field(default=5.0, metadata={"help": "Fixed seconds to wake an engine (re-create its memory pools / CUDA graphs), on top of moving its weights (>= 0). The default is a vLLM sleep-mode-style wake."})
    sync_overhead_s: float = field(default=1.0, metadata={"help": "Fixed seconds per weight sync (gathering tensor by tensor, engine-side copy and cache reset)."})
    controller_bandwidth: float = field(default=1.5e9, metadata={"help": "Bytes/s one controller process moves to or from its engines (serialisation + object store): 1-2 GB/s for one Python process."})
    layer_overhead_s: float = field(default=0.0, metadata={"help": "Fixed seconds per decoder layer of each engine forward (decode step or prefill): kernel launches and dispatch. ~0 for a CUDA-graph engine on GPU; on CPU it makes a deeper model's decode step slower at any batch size, so calibration fits it."})
    pass_overhead_s: float = field(default=0.0, metadata={"help": "Fixed seconds per forward-only micro-batch (log-prob passes): launches, Python, FSDP gathers not hidden by compute. Negligible next to 7B+ GEMMs on GPU (0 by default); dominant for the tiny CPU models, so calibration fits it."})
    train_pass_overhead_s: float = field(default=0.0, metadata={"help": "Fixed seconds per training micro-batch (forward + backward); see pass_overhead_s."})
    optimizer_step_s: float = field(default=0.0, metadata={"help": "Fixed seconds per optimiser step (gradient clipping, AdamW update, scheduler). 0 by default: on GPU it is a memory-bound sweep over the FSDP shard, small next to the step; calibration fits it."})
    trainer_state_bytes_per_param: float = field(default=16.0, metadata={"help": "Bytes of training state per parameter that a time-shared trainer offloads to host and reloads each step (bf16 weights and grads + fp32 master and Adam moments = 16)."})

    def validate(self) -> None:
        for key in ("decode_bandwidth_efficiency", "decode_mfu", "prefill_mfu", "logprob_mfu", "train_mfu"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ConfigError(key, f"must be in (0, 1], got {value}")
        for key in ("step_overhead_s", "engine_wake_s", "sync_overhead_s", "trainer_state_bytes_per_param",
                    "layer_overhead_s", "pass_overhead_s", "train_pass_overhead_s", "optimizer_step_s"):
            if getattr(self, key) < 0:
                raise ConfigError(key, f"must be >= 0, got {getattr(self, key)}")
        if not self.controller_bandwidth > 0:
            raise ConfigError("controller_bandwidth", f"must be > 0, got {self.controller_bandwidth}")


# --------------------------------------------------------------------------- compute phases


def prefill_seconds(tokens, model: ModelSpec, hw: Hardware, c: CostConstants, tp: int = 1):
    """Prefill of `tokens` prompt tokens on one engine of `tp` devices: 2 N tokens / (prefill_mfu peak tp)
    (times the model's `time_scale`, as every engine cost below); with measured engine costs
    (`ModelSpec.engine`) prefill_token_s x tokens instead, here and in every decode formula below."""
    if model.engine is not None:
        return model.engine.prefill_token_s * np.asarray(tokens, dtype=np.float64) * model.time_scale
    return 2.0 * model.params * np.asarray(tokens, dtype=np.float64) * model.time_scale / (
        c.prefill_mfu * hw.peak_flops * tp)


def decode_step_seconds(active, kv_tokens, model: ModelSpec, hw: Hardware, c: CostConstants, tp: int = 1):
    """One decode step of `active` sequences holding `kv_tokens` tokens of KV cache, on `tp` devices.

    max(memory, compute) + step_overhead_s, where memory = (W + kv_bytes_per_token x kv_tokens) /
    (tp x eff x hbm) and compute = 2 N active / (tp x peak x decode_mfu).
    """
    active = np.asarray(active, dtype=np.float64)
    if model.engine is not None:  # shaped like the roofline's result: active and kv_tokens broadcast
        kv_shape = np.zeros_like(np.asarray(kv_tokens, dtype=np.float64))
        return model.engine.token_s * active * model.time_scale + step_fixed_seconds(model, c) + kv_shape
    memory = (model.weight_bytes + model.kv_bytes_per_token * np.asarray(kv_tokens, dtype=np.float64)) / (
        tp * c.decode_bandwidth_efficiency * hw.hbm_bandwidth)
    compute = 2.0 * model.params * active / (tp * hw.peak_flops * c.decode_mfu)
    return np.maximum(memory, compute) * model.time_scale + step_fixed_seconds(model, c)


def step_fixed_seconds(model: ModelSpec, c: CostConstants) -> float:
    """Seconds every engine forward pays on top of the roofline: step_overhead_s + layers x layer_overhead_s
    (with measured engine costs, their `step_s`)."""
    if model.engine is not None:
        return model.engine.step_s * model.time_scale
    return (c.step_overhead_s + model.layers * c.layer_overhead_s) * model.time_scale


def decode_segment_seconds(begin, end, active, kv_offset, model: ModelSpec, hw: Hardware, c: CostConstants,
                           tp: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """Exact sum of `decode_step_seconds` over steps s = begin .. end-1 of each segment.

    In a segment, `active` sequences decode and the KV cache holds kv_offset + active x s tokens at
    step s (every active sequence adds one token per step). The memory time grows linearly in s
    and the compute time is constant, so the sum splits at the step where memory overtakes
    compute. Returns (seconds, compute-bound steps), one entry per segment.
    """
    begin = np.asarray(begin, dtype=np.float64)
    end = np.asarray(end, dtype=np.float64)
    active = np.asarray(active, dtype=np.float64)
    if model.engine is not None:  # measured: every step costs step_s + token_s x active, counted compute-bound
        steps = end - begin
        return (model.engine.token_s * active * model.time_scale + step_fixed_seconds(model, c)) * steps, steps
    bandwidth = tp * c.decode_bandwidth_efficiency * hw.hbm_bandwidth
    intercept = (model.weight_bytes + model.kv_bytes_per_token * np.asarray(kv_offset, dtype=np.float64)) / bandwidth
    slope = model.kv_bytes_per_token * active / bandwidth
    compute = 2.0 * model.params * active / (tp * hw.peak_flops * c.decode_mfu)
    with np.errstate(divide="ignore", invalid="ignore"):
        crossing = np.where(slope > 0, np.ceil((compute - intercept) / slope),
                            np.where(intercept >= compute, -np.inf, np.inf))
    switch = np.clip(crossing, begin, end)  # first memory-bound step
    compute_steps = switch - begin
    memory_steps = end - switch
    step_sum = (switch + end - 1.0) * memory_steps / 2.0  # sum of s over the memory-bound steps
    seconds = ((compute * compute_steps + intercept * memory_steps + slope * step_sum) * model.time_scale
               + step_fixed_seconds(model, c) * (end - begin))
    return seconds, compute_steps


def decode_stretch_seconds(steps: int, active: int, kv_offset: float, model: ModelSpec, hw: Hardware,
                           c: CostConstants, tp: int = 1) -> float:
    """`decode_segment_seconds(0, steps, active, kv_offset, ...)` for one segment, in plain floats.

    The event loops of `streaming.py` and `agent.py` price one stretch per event; numpy's per-call overhead on
    scalars would be most of their run time. Same formula, checked against the array form in
    tests/sim/test_cost.py.
    """
    return decode_stretch(steps, active, kv_offset, model, hw, c, tp)[0]


def decode_stretch(steps: int, active: int, kv_offset: float, model: ModelSpec, hw: Hardware, c: CostConstants,
                   tp: int = 1) -> tuple[float, int]:
    """`decode_stretch_seconds` and the stretch's compute-bound steps (the second value of
    `decode_segment_seconds`)."""
    if steps <= 0:
        return 0.0, 0
    if model.engine is not None:
        return (model.engine.token_s * active * model.time_scale + step_fixed_seconds(model, c)) * steps, steps
    bandwidth = tp * c.decode_bandwidth_efficiency * hw.hbm_bandwidth
    intercept = (model.weight_bytes + model.kv_bytes_per_token * kv_offset) / bandwidth
    slope = model.kv_bytes_per_token * active / bandwidth
    compute = 2.0 * model.params * active / (tp * hw.peak_flops * c.decode_mfu)
    if slope > 0:
        switch = min(max(math.ceil((compute - intercept) / slope), 0), steps)  # first memory-bound step
    else:
        switch = 0 if intercept >= compute else steps
    memory_steps = steps - switch
    step_sum = (switch + steps - 1.0) * memory_steps / 2.0
    return ((compute * switch + intercept * memory_steps + slope * step_sum) * model.time_scale
            + step_fixed_seconds(model, c) * steps), switch


def logprob_seconds(tokens, model: ModelSpec, hw: Hardware, c: CostConstants, devices: int, micro_batches=0):
    """Forward-only log-prob pass over `tokens` tokens spread over `devices`:
    2 N tokens / (logprob_mfu peak devices) + micro_batches (per device) x pass_overhead_s."""
    compute = 2.0 * model.params * np.asarray(tokens, dtype=np.float64) / (c.logprob_mfu * hw.peak_flops * devices)
    return compute + np.asarray(micro_batches, dtype=np.float64) * c.pass_overhead_s


def train_seconds(tokens, model: ModelSpec, hw: Hardware, c: CostConstants, devices: int, epochs: int = 1,
                  micro_batches=0, optimiser_steps=0, recompute: bool = False):
    """Training over `tokens` tokens on `devices`: F N tokens epochs / (train_mfu peak devices)
    + micro_batches x train_pass_overhead_s + optimiser_steps x optimizer_step_s (counts per device).

    F = 6 (forward 2N + backward 4N), or 8 with `recompute` (gradient checkpointing runs every
    layer's forward again during the backward pass).
    """
    compute = (8.0 if recompute else 6.0) * model.params * epochs * np.asarray(tokens, dtype=np.float64) / (c.train_mfu * hw.peak_flops * devices)
    return (compute + np.asarray(micro_batches, dtype=np.float64) * c.train_pass_overhead_s
            + np.asarray(optimiser_steps, dtype=np.float64) * c.optimizer_step_s)


def ulysses_seconds(tokens, model: ModelSpec, hw: Hardware, group: int, passes: float):
    """DeepSpeed-Ulysses' all-to-alls for `tokens` tokens of rows shared by a group of `group` devices
    (each device holds tokens / group of them), over `passes` passes through the layers (1 for a
    forward-only pass, 2 for forward + backward, 3 with recomputation).

    Per layer and pass the four all-to-alls (queries, keys, values before attention, its output after)
    move a device's chunk of (2 heads + 2 kv_heads) x head_dim values per token, of which it sends
    (group - 1) / group (the rest stays on the device), at bytes_per_param each, over the group's link
    (NVLink inside a node, else the NIC). Jacobs et al. 2023 (arXiv 2309.14509, sec. 3.2) count the
    whole chunk, 4 N h / P per layer without grouped-query attention. 0 for a group of one.
    """
    if group <= 1:
        return np.zeros_like(np.asarray(tokens, dtype=np.float64))
    width = 2.0 * (model.query_heads + model.kv_heads) * model.head_dim
    sent = np.asarray(tokens, dtype=np.float64) / group * (group - 1) / group * width * model.bytes_per_param
    return passes * model.layers * sent / hw.link_bandwidth(group)


# --------------------------------------------------------------------------- moving bytes


def offload_seconds(bytes_per_device: float, hw: Hardware) -> float:
    """An engine or trainer moves `bytes_per_device` from device to host memory."""
    return bytes_per_device / hw.host_link_bandwidth


def wake_seconds(bytes_per_device: float, hw: Hardware, c: CostConstants) -> float:
    """An engine reloads `bytes_per_device` from host memory and re-initialises: bytes / host_link + engine_wake_s."""
    return bytes_per_device / hw.host_link_bandwidth + c.engine_wake_s


def trainer_swap_seconds(model: ModelSpec, hw: Hardware, c: CostConstants, devices: int,
                         reference: bool = False) -> float:
    """A time-shared trainer moves its FSDP shard of training state (and the reference's weights) to or from host."""
    state = model.params * c.trainer_state_bytes_per_param + (model.weight_bytes if reference else 0.0)
    return state / devices / hw.host_link_bandwidth


def weight_sync_seconds(model: ModelSpec, hw: Hardware, c: CostConstants, devices: int) -> float:
    """New policy weights reach the engines: W / link(devices) + sync_overhead_s.

    The trainer gathers full tensors over the group of `devices` GPUs (each GPU receives about W
    bytes, over NVLink when the group fits in a node, else over its NIC) and copies them into the
    engines.
    """
    return model.weight_bytes / hw.link_bandwidth(devices) + c.sync_overhead_s


def data_plane_seconds(bytes_moved, c: CostConstants):
    """The controller serialises and ships `bytes_moved` (its own shard only): bytes / controller_bandwidth."""
    return np.asarray(bytes_moved, dtype=np.float64) / c.controller_bandwidth


# --------------------------------------------------------------------------- capacity


def kv_capacity_tokens(model: ModelSpec, hw: Hardware, tp: int, memory_utilization: float) -> float:
    """Tokens of KV cache an engine of `tp` devices holds next to its weights."""
    free = memory_utilization * hw.memory_bytes * tp - model.weight_bytes
    return max(0.0, free / model.kv_bytes_per_token)


def concurrent_sequences(model: ModelSpec, hw: Hardware, tp: int, memory_utilization: float, max_num_seqs: int,
                         mean_sequence_tokens: float) -> int:
    """Sequences an engine decodes at once: max_num_seqs, or fewer when their KV cache would not fit."""
    fit = kv_capacity_tokens(model, hw, tp, memory_utilization) / max(1.0, mean_sequence_tokens)
    return int(max(1, min(max_num_seqs, math.floor(fit))))
