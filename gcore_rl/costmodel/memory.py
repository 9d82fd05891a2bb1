"""Bytes a trainer device holds: at its update-phase peak, and while the engines generate.

The simulator's other memory figures are the engine's (`ModelSpec.weight_bytes`, `kv_bytes_per_token`,
`cost.kv_capacity_tokens`). This module adds the trainer's, per device of an FSDP group of `shards`:

- **state**: master weights of every parameter (`master_bytes` each, sharded; under LoRA the frozen base's
  `frozen_bytes`), and for the *trained* ones (all, or LoRA's adapters) a gradient (`grad_bytes`) and AdamW's
  two moments (2 × `moment_bytes`);
- **gathers**: FSDP2 all-gathers a block's parameters (in the compute dtype, `gather_bytes`) into fresh
  buffers before its forward and frees them after, on one shard too; the root block (embeddings, LM head,
  final norm) stays gathered through the whole forward and backward, and one block is prefetched beside the
  one running (so 2 blocks);
- **activations** of one micro-batch (`activation_bytes_per_token`), counted tensor by tensor for a
  Llama/Qwen2 layer the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
  Models", §4.1, 34·s·b·h + 5·a·s²·b bytes per layer for GPT in 16-bit) count theirs, adapted: no dropout, a
  gated MLP of width `intermediate`, grouped-query attention, and an attention kernel that keeps no s² scores
  (SDPA's flash / memory-efficient kernels);
- **the log-prob head**: the full-logits path keeps `[tokens, vocab]` logits for the backward and writes
  their fp32 gradient; the chunked head (`gcore_rl.training.chunked_head`) keeps about three fp32
  `[CHUNK_POSITIONS, vocab]` tensors (fewer positions where the micro-batch has fewer);
- **the optimiser step**: a foreach AdamW (the default on CUDA) allocates one more fp32 tensor per trained
  parameter (`torch._foreach_sqrt` of the second moment) for the step.

The update's peak is where the backward starts or where the optimiser steps, whichever is larger: the
backward frees a layer's activations as it writes that layer's gradients, so what it holds moves linearly
from (activations + head + the root's gradients) to (all gradients), and a linear function peaks at an end.

While the engines generate, a colocated trainer keeps its master weights and AdamW moments (gradients are
unset after the step); `train.offload=optimizer` moves the moments to the host, `all` moves everything.

It counts live tensors. What an allocator keeps beyond them (CUDA's caching allocator; on a CPU device,
glibc's heap, which does not return freed tensors below its mmap threshold) is not modelled: on the
Qwen2-0.5B shape on CPU the model is 17-20 % under the measured resident peak of a first update
(BENCHMARKS.md, "Memory per role and phase").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gcore_rl.costmodel.models import ModelSpec
from gcore_rl.errors import ConfigError

CHUNK_POSITIONS = 256
"""Positions in one chunk of the chunked head (`gcore_rl.training.chunked_head.CHUNK_POSITIONS`)."""

CHUNK_TENSORS = 3
"""Such tensors alive at once in the chunked head's forward or backward."""

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The linear layers of a Llama/Qwen2 decoder layer: `all-linear` (the LM head is never adapted)."""

Offload = Literal["none", "optimizer", "all"]


@dataclass(frozen=True)
class TrainerSetup:
    """How a trainer holds and trains a model: what `TrainerMemory` needs besides the model's shape."""

    micro_batch_tokens: int = field(metadata={"help": "Token positions of one micro-batch (rows × padded length)."})
    head_tokens: int = field(default=0, metadata={"help": "Positions the LM head scores per micro-batch (0 = all of micro_batch_tokens)."})
    shards: int = field(default=1, metadata={"help": "Devices of the FSDP group the state is sharded over."})
    lora_rank: int = field(default=0, metadata={"help": "Rank of the LoRA adapters (0 = full fine-tuning)."})
    lora_targets: tuple[str, ...] = field(default=LORA_TARGETS, metadata={"help": "Linear layers with adapters."})
    master_bytes: int = field(default=4, metadata={"help": "Bytes of a master weight (4 = fp32)."})
    frozen_bytes: int = field(default=0, metadata={"help": "Bytes of a frozen base weight under LoRA (2: a bf16 base, `model.dtype=bfloat16`; 0 = master_bytes)."})
    grad_bytes: int = field(default=4, metadata={"help": "Bytes of a gradient of a trained parameter."})
    moment_bytes: int = field(default=4, metadata={"help": "Bytes of each of AdamW's two moments."})
    gather_bytes: int = field(default=4, metadata={"help": "Bytes of a gathered parameter (2 under bf16 mixed precision)."})
    activation_bytes: int = field(default=4, metadata={"help": "Bytes of a saved activation (2 under bf16 autocast)."})
    attention_scores_length: int = field(default=0, metadata={"help": "Sequence length when the attention kernel keeps its softmax probabilities (the math SDPA kernel); 0 = a flash kernel that keeps none."})
    activation_checkpointing: bool = field(default=False, metadata={"help": "Keep only each layer's input; recompute the rest in the backward."})
    chunked_head: bool = field(default=True, metadata={"help": "Score the LM head in chunks (False: full [tokens, vocab] logits)."})
    foreach_optimizer: bool = field(default=False, metadata={"help": "AdamW's foreach step (CUDA's default): one more fp32 tensor per trained parameter."})
    process_bytes: float = field(default=0.0, metadata={"help": "Fixed bytes of the process: CUDA context and allocator slack, or Python + torch + libraries on CPU."})

    def validate(self) -> None:
        for key in ("micro_batch_tokens", "shards"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.frozen_bytes < 0:
            raise ConfigError("frozen_bytes", f"must be >= 0, got {self.frozen_bytes}")
        if self.lora_rank < 0:
            raise ConfigError("lora_rank", f"must be >= 0, got {self.lora_rank}")
        unknown = set(self.lora_targets) - set(LORA_TARGETS)
        if unknown:
            raise ConfigError("lora_targets", f"unknown {sorted(unknown)}; the modelled ones are {', '.join(LORA_TARGETS)}")


@dataclass(frozen=True)
class TrainerMemory:
    """Bytes of one trainer device, by what holds them (see the module's docstring)."""

    weights: float
    gradients: float
    moments: float
    root_gradients: float
    gathered: float
    activations: float
    head: float
    optimizer_step: float
    process: float

    @property
    def update_peak(self) -> float:
        """The update phase's peak: the state plus the larger of the backward's start, its end and the step."""
        state = self.process + self.weights + self.moments + self.gathered
        backward_start = self.activations + self.head + self.root_gradients
        return state + max(backward_start, self.gradients, self.gradients + self.optimizer_step)

    def rollout_resident(self, offload: Offload = "none") -> float:
        """What a colocated trainer keeps on the device while the engines generate (gradients are unset)."""
        kept = {"none": self.weights + self.moments, "optimizer": self.weights, "all": 0.0}[offload]
        return self.process + kept


def _linear_shapes(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each linear layer of a decoder layer."""
    _require_intermediate(model)
    q_width, kv_width = model.query_heads * model.head_dim, model.kv_heads * model.head_dim
    h, f = model.hidden, model.intermediate
    return {"q_proj": (h, q_width), "k_proj": (h, kv_width), "v_proj": (h, kv_width), "o_proj": (q_width, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}


def _require_intermediate(model: ModelSpec) -> None:
    if model.intermediate < 1:
        raise ConfigError("intermediate", f"the trainer memory model needs {model.name}'s MLP width "
                          "(ModelSpec.intermediate, filled by from_hf_config)")


def lora_params(model: ModelSpec, rank: int, targets: tuple[str, ...] = LORA_TARGETS) -> int:
    """Adapter parameters: rank × (in + out) per targeted linear layer, in every layer."""
    shapes = _linear_shapes(model)
    return model.layers * sum(rank * (shapes[name][0] + shapes[name][1]) for name in targets)


def root_params(model: ModelSpec) -> float:
    """Parameters outside the decoder layers (embeddings, an untied LM head, final norm): `params` less the
    layers' linear weights and their two norms (q/k/v biases, if any, count as root: a rounding error)."""
    per_layer = sum(i * o for i, o in _linear_shapes(model).values()) + 2 * model.hidden
    return model.params - model.layers * per_layer


def activation_bytes_per_token(model: ModelSpec, setup: TrainerSetup) -> float:
    """Bytes one token position of a micro-batch keeps for the backward, over all layers.

    Per layer, in elements (× `activation_bytes`), as autograd saves them in transformers' Llama/Qwen2 layer
    (counted with `torch.autograd.graph.saved_tensors_hooks` on the 0.5B shape, 2026-11-28): each of the two
    RMSNorms its input, its normalised input and its output, the next projections' input (6 h); attention's
    q after rotary, k and v at the query heads' width (transformers' SDPA path repeats the key/value heads
    when there is a padding mask), the attention's output and the contiguous copy `o_proj` takes (5 q widths);
    the gated MLP's gate and up projections, silu(gate) and their product, `down_proj`'s input (4
    intermediate); LoRA's rank-wide intermediate per adapted linear; the softmax probabilities
    (heads × `attention_scores_length`) when the attention kernel keeps them (Korthikanti et al.'s 5 a s
    term less dropout: 0 for flash kernels). Beside the layers: the embedding's output and the final norm's
    input and output (3 h). With activation checkpointing a layer keeps only its input (h), and one layer's
    full set is alive while it is recomputed.
    """
    _require_intermediate(model)
    q_width = model.query_heads * model.head_dim
    full_layer = (6 * model.hidden + 5 * q_width + 4 * model.intermediate + setup.lora_rank * len(setup.lora_targets)
                  + model.query_heads * setup.attention_scores_length)
    if setup.activation_checkpointing:
        elements = model.layers * model.hidden + full_layer
    else:
        elements = model.layers * full_layer
    return (elements + 3 * model.hidden) * setup.activation_bytes


def head_bytes(model: ModelSpec, setup: TrainerSetup) -> float:
    """The log-prob pass's LM-head bytes: `[tokens, vocab]` logits (activation dtype) and their fp32 gradient,
    or the chunked head's `CHUNK_TENSORS` fp32 `[chunk, vocab]` chunks."""
    tokens = setup.head_tokens or setup.micro_batch_tokens
    if setup.chunked_head:
        return float(CHUNK_TENSORS * min(tokens, CHUNK_POSITIONS) * model.vocab * 4)
    return float(tokens * model.vocab * (setup.activation_bytes + 4))


def trainer_memory(model: ModelSpec, setup: TrainerSetup) -> TrainerMemory:
    """The bytes of one trainer device of `setup.shards` for `model` (see `TrainerMemory.update_peak`)."""
    setup.validate()
    shards = setup.shards
    lora = setup.lora_rank > 0
    trained = lora_params(model, setup.lora_rank, setup.lora_targets) if lora else model.params
    base_bytes = (setup.frozen_bytes or setup.master_bytes) if lora else setup.master_bytes
    stored = model.params * base_bytes + (trained * setup.master_bytes if lora else 0)
    block = max(sum(i * o for i, o in _linear_shapes(model).values()), 1)
    # with LoRA the embeddings are frozen: their gradient is never written
    root_grad = 0.0 if lora else root_params(model) * setup.grad_bytes / shards
    return TrainerMemory(
        weights=stored / shards,
        gradients=trained * setup.grad_bytes / shards,
        moments=2 * trained * setup.moment_bytes / shards,
        root_gradients=root_grad,
        gathered=(root_params(model) + 2 * block) * setup.gather_bytes,
        activations=setup.micro_batch_tokens * activation_bytes_per_token(model, setup),
        head=head_bytes(model, setup),
        optimizer_step=trained * 4 / shards if setup.foreach_optimizer else 0.0,
        process=setup.process_bytes,
    )


@dataclass(frozen=True)
class PlacementFit:
    """Whether a trainer and its engines fit their devices (bytes per device; tokens per engine)."""

    update_peak: float = field(metadata={"help": "A trainer device's update-phase peak, bytes."})
    rollout_trainer: float = field(metadata={"help": "What a colocated trainer keeps on a device while it generates."})
    kv_tokens: float = field(metadata={"help": "KV-cache tokens an engine holds beside its weights (and a colocated trainer's state)."})
    update_fits: bool = field(metadata={"help": "The update's peak fits a device's usable memory."})
    rollout_fits: bool = field(metadata={"help": "An engine keeps at least `min_kv_tokens` of KV cache."})

    @property
    def fits(self) -> bool:
        return self.update_fits and self.rollout_fits


def placement_fit(model: ModelSpec, device_bytes: float, setup: TrainerSetup, *, engine_tp: int, colocated: bool,
                  offload: Offload = "none", memory_utilization: float = 0.9,
                  min_kv_tokens: float = 65_536) -> PlacementFit:
    """Price one placement: trainers on `setup.shards` devices; engines of `engine_tp` devices each, on the same
    devices (`colocated`: the engines sleep, freeing everything, during the update, and the trainer keeps
    `TrainerMemory.rollout_resident(offload)` during the rollout) or on devices of their own. Usable memory is
    `memory_utilization` × `device_bytes`; the engine's weights are `model.weight_bytes` over `engine_tp`."""
    memory = trainer_memory(model, setup)
    usable = memory_utilization * device_bytes
    resident = memory.rollout_resident(offload) if colocated else 0.0
    free = engine_tp * (usable - resident) - model.weight_bytes
    kv_tokens = max(0.0, free / model.kv_bytes_per_token)
    return PlacementFit(update_peak=memory.update_peak, rollout_trainer=resident, kv_tokens=kv_tokens,
                        update_fits=memory.update_peak <= usable, rollout_fits=kv_tokens >= min_kv_tokens)
