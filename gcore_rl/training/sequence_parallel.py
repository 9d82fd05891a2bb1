"""Ulysses sequence parallelism for transformers decoders: one sequence spread over N processes.

DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv 2309.14509): each of the N ranks of a
sequence-parallel group holds a contiguous 1/N of the sequence's tokens, so embeddings, norms,
MLPs and the LM head run on `S / N` tokens. Attention needs every token, so around it two
all-to-alls change what a rank holds: before, from all heads of its own chunk `[B, H, S/N, D]` to
its own `H / N` heads over the whole sequence `[B, H/N, S, D]`; after, back. Each rank then runs
ordinary causal attention over the whole sequence for its heads. Activation memory per rank falls
to about 1/N, at the price of four all-to-alls of `B·S·H·D / N` elements per layer (query, key,
value, output). Needs the (query and key/value) head counts to be multiples of N.

Use: `use_ulysses(model, group)` switches the model's attention to ``"ulysses"`` over `group`;
each rank then calls the model on its chunk with the chunk's global `position_ids`
(`sequence_chunk`). Autograd runs through the all-to-alls (functional collectives), so a rank's
parameter gradients are its share; summed over the group they are the whole sequence's gradient
(tests/training/test_sequence_parallel.py: logits and gradients equal the single-process
computation on 2 gloo processes). Scope: one sequence (or several of equal length) per batch, no
padding (attention masks other than causal are refused). Ring / context-parallel attention, which
also splits the attention's own memory, is the next step where it needs CUDA kernels.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

ULYSSES = "ulysses"
_groups: dict[int, dist.ProcessGroup] = {}  # id(model config) -> its sequence-parallel group


def _all_to_all(chunks: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`chunks` `[N, ...]`: chunk j goes to rank j; returns `[N, ...]` whose chunk j came from rank j
    (differentiable: the backward is the reverse all-to-all). The input is made contiguous first: the
    collective reads and writes flat memory."""
    return wait_tensor(all_to_all_single_autograd(chunks.contiguous(), None, None, group))


def sequence_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[B, H, S/N, D]` (every head, this rank's chunk) → `[B, H/N, S, D]` (this rank's heads, every chunk in order)."""
    n = dist.get_world_size(group)
    batch, heads, chunk, dim = x.shape
    parts = x.reshape(batch, n, heads // n, chunk, dim).transpose(0, 1)  # [N, B, H/N, S/N, D]: heads for rank j
    gathered = _all_to_all(parts, group)  # [N, B, H/N, S/N, D]: chunk j of the sequence, from rank j
    return gathered.permute(1, 2, 0, 3, 4).reshape(batch, heads // n, n * chunk, dim)


def heads_to_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[B, S, H/N, D]` (attention output of this rank's heads) → `[B, S/N, H, D]` (every head, this rank's chunk)."""
    n = dist.get_world_size(group)
    batch, length, heads, dim = x.shape
    parts = x.reshape(batch, n, length // n, heads, dim).transpose(0, 1)  # [N, B, S/N, H/N, D]: chunk for rank j
    gathered = _all_to_all(parts, group)  # [N, B, S/N, H/N, D]: heads of rank j
    return gathered.permute(1, 2, 0, 3, 4).reshape(batch, length // n, n * heads, dim)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: `query` `[B, H, S/N, D]`, `key`/`value` `[B, Hkv, S/N, D]` of this
    rank's chunk → output `[B, S/N, H, D]`, causal attention over the whole sequence (see the module docstring)."""
    if attention_mask is not None:
        raise ValueError("Ulysses attention takes whole unpadded sequences (causal only); call the model "
                         "without an attention_mask")
    group = _groups[id(module.config)]
    q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)  # [B, S, H/N, D]
    return heads_to_sequence(out, group), None


def _no_mask(*args, **kwargs) -> None:
    """The mask function of ``"ulysses"``: none (attention is causal over the gathered sequence)."""
    return None


AttentionInterface.register(ULYSSES, ulysses_attention)
AttentionMaskInterface.register(ULYSSES, _no_mask)


def check_divides(config, n: int) -> None:
    """ValueError when the sequence-parallel degree `n` does not divide the query and key/value heads."""
    section = getattr(config, "text_config", None) or config
    heads = section.num_attention_heads
    kv_heads = getattr(section, "num_key_value_heads", None) or heads
    if heads % n or kv_heads % n:
        raise ValueError(f"a sequence-parallel degree of {n} must divide the model's attention heads ({heads}) and "
                         f"key/value heads ({kv_heads}): each rank attends with a whole share of them")


def use_ulysses(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Switch `model`'s attention to Ulysses over `group` (every rank of the group holds the same model)."""
    check_divides(model.config, dist.get_world_size(group))
    # the attention layers read their config (usually the model's own object; a sub-model's otherwise)
    for config in [model.config, *(m.config for m in model.modules() if hasattr(m, "config"))]:
        config._attn_implementation = ULYSSES
        _groups[id(config)] = group
    return model


def sequence_chunk(input_ids: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous chunk of `input_ids` `[B, S]` (S a multiple of N) and its global position ids."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    batch, length = input_ids.shape
    if length % n:
        raise ValueError(f"a sequence of {length} tokens does not split into {n} equal chunks for sequence "
                         f"parallelism; pad it to a multiple of {n}")
    chunk = length // n
    positions = torch.arange(rank * chunk, (rank + 1) * chunk, device=input_ids.device).expand(batch, chunk)
    return input_ids[:, rank * chunk:(rank + 1) * chunk], positions
