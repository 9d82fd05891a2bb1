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
(`sequence_chunk`). Several sequences packed into one row (`training.packing`) are kept apart by
passing the whole row's segment ids as ``sequence_segments`` to the model call: attention is then
causal within each segment only (a block-diagonal mask over the gathered row). Autograd runs through the all-to-alls (functional collectives), so a rank's
parameter gradients are its share; summed over the group they are the whole sequence's gradient
(tests/training/test_sequence_parallel.py: logits and gradients equal the single-process
computation on 2 gloo processes). Scope: one row per call (or several of equal length), no
padding mask (attention masks other than causal or segments are refused). Ring / context-parallel
attention, which also splits the attention's own memory, is the next step where it needs CUDA kernels.

In the trainer (`train.sequence_parallel=N`): the trainer ranks form groups of N consecutive ranks
(`sequence_parallel_groups`), every rank of a group gets the same rows, and `sp_token_logprobs`
packs a pass's rows into one row, gives each rank its chunk, and all-gathers the chunks' log-probs
(differentiably) so every rank of the group holds the whole pass's `[B, T]` log-probs and computes the
same loss. The all-gather's backward sums the N identical losses' gradients (N times each rank's
share); the loss weights count each row N times over the trainer group (`accumulate_gradients`
sums units over all ranks), which divides it out, so the update equals the one without
sequence parallelism (tests/training/test_sequence_parallel_trainer.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from gcore_rl.errors import ConfigError
from gcore_rl.training.logprobs import scored_logprobs
from gcore_rl.training.packing import pack_rows

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


def segment_mask(segments: torch.Tensor) -> torch.Tensor:
    """`[1, 1, S, S]` bool: position i attends to j when j ≤ i and both are in the same segment
    (`segments` `[S]`, equal ids for the tokens of one packed sequence)."""
    length = segments.shape[0]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    return (causal & (segments[:, None] == segments[None, :]))[None, None]


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, sequence_segments: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """A transformers attention function: `query` `[B, H, S/N, D]`, `key`/`value` `[B, Hkv, S/N, D]` of this
    rank's chunk → output `[B, S/N, H, D]`, causal attention over the whole sequence, or within each
    segment of `sequence_segments` `[S]` (the whole row's, see the module docstring)."""
    if attention_mask is not None:
        raise ValueError("Ulysses attention takes whole unpadded sequences (causal only); call the model "
                         "without an attention_mask")
    group = _groups[id(module.config)]
    q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
    kwargs.pop("is_causal", None)
    kwargs.pop("position_ids", None)  # the chunk's: the gathered sequence's are not needed by the kernel
    if sequence_segments is None:
        out, _ = sdpa_attention_forward(module, q, k, v, None, is_causal=True, **kwargs)  # [B, S, H/N, D]
    else:
        out, _ = sdpa_attention_forward(module, q, k, v, segment_mask(sequence_segments), is_causal=False, **kwargs)
    return heads_to_sequence(out, group), None


def _no_mask(*args, **kwargs) -> None:
    """The mask function of ``"ulysses"``: none (attention is causal over the gathered sequence)."""
    return None


AttentionInterface.register(ULYSSES, ulysses_attention)
AttentionMaskInterface.register(ULYSSES, _no_mask)


def attention_heads(config: dict) -> tuple[int, int]:
    """(query heads, key/value heads) of a decoder's config.json (``text_config`` for a multimodal one)."""
    section = config.get("text_config") or config
    heads = int(section["num_attention_heads"])
    return heads, int(section.get("num_key_value_heads") or heads)


def check_divides(config: dict, n: int) -> None:
    """ValueError when the sequence-parallel degree `n` does not divide the query and key/value heads
    of `config` (a config.json's dict)."""
    heads, kv_heads = attention_heads(config)
    if heads % n or kv_heads % n:
        raise ValueError(f"a sequence-parallel degree of {n} must divide the model's attention heads ({heads}) and "
                         f"key/value heads ({kv_heads}): each rank attends with a whole share of them")


def use_ulysses(model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
    """Switch `model`'s attention to Ulysses over `group` (every rank of the group holds the same model)."""
    check_divides(model.config.to_dict(), dist.get_world_size(group))
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


def sequence_parallel_groups(world: int, degree: int) -> list[list[int]]:
    """The sequence-parallel groups of a trainer group of `world` ranks: consecutive blocks of `degree`."""
    if degree < 1 or world % degree:
        raise ValueError(f"a sequence-parallel degree of {degree} does not divide {world} trainer ranks")
    return [list(range(start, start + degree)) for start in range(0, world, degree)]


def new_sequence_parallel_group(degree: int) -> dist.ProcessGroup:
    """This rank's sequence-parallel group (a collective: every trainer rank creates every group, in order).
    ConfigError on a torch without the differentiable all-gather the chunks' log-probs need (before 2.13)."""
    from torch.distributed import _functional_collectives

    if not hasattr(_functional_collectives, "all_gather_single_autograd"):
        raise ConfigError("train.sequence_parallel", f"needs torch's differentiable all-gather "
                          f"(all_gather_single_autograd, torch 2.13 and later); this torch is {torch.__version__}: "
                          "install the project's torch==2.13.0, or leave train.sequence_parallel at 1")
    mine = None
    for ranks in sequence_parallel_groups(dist.get_world_size(), degree):
        group = dist.new_group(ranks)
        if dist.get_rank() in ranks:
            mine = group
    return mine


def sequence_parallel_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The group `use_ulysses` gave `model`, or None when its attention is not Ulysses."""
    return _groups.get(id(model.config)) if model.config._attn_implementation == ULYSSES else None


def _gather_chunks(values: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """`[C]` per rank → `[N·C]`, rank order (differentiable: the backward sums the ranks' gradients)."""
    # imported where it is used: torch has it from 2.13 on, and the rest of the trainer runs on older ones
    from torch.distributed._functional_collectives import all_gather_single_autograd

    return wait_tensor(all_gather_single_autograd(values.contiguous(), 0, group))


def sp_token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                      temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                      first_scored: int = 1, images=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`training.packing.packed_token_logprobs` over a sequence-parallel group: same arguments, same
    `[B, T]` results on every rank of the group (see the module docstring).

    The packed row of `L` tokens is padded to `S`, a multiple of N (the padding is a segment of its
    own), and rank r runs the model on positions `[r·S/N, (r+1)·S/N)`; the LM head only on the
    chunk's positions whose next token is scored. Text only (`images` must be None).
    """
    if images is not None and any(i is not None for i in images):
        raise ValueError("sequence parallelism takes text-only rows")
    group = sequence_parallel_group(model)
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    packed = pack_rows(input_ids, attention_mask)
    length = packed.length
    chunk = -(-length // n)
    pad = chunk * n - length
    ids = torch.nn.functional.pad(packed.input_ids, (0, pad))
    positions = torch.nn.functional.pad(packed.position_ids, (0, pad))
    segments = torch.cat([packed.rows, packed.rows.new_full((pad,), -1)])
    scored = torch.nn.functional.pad(packed.scored(first_scored), (0, chunk * n - (length - 1)))  # [S]
    span = slice(rank * chunk, (rank + 1) * chunk)
    at = scored[span].nonzero().squeeze(-1)  # this chunk's scoring positions, chunk-local
    keep = torch.cat([at, at.new_tensor([chunk - 1])])  # scored_logprobs ignores the last kept position
    targets = torch.nn.functional.pad(ids[0, 1:], (0, 1))[span][at]
    inputs = dict(input_ids=ids[:, span], position_ids=positions[:, span], attention_mask=None, use_cache=False,
                  logits_to_keep=keep, sequence_segments=segments)  # K + 1 positions kept
    logprobs, entropy = scored_logprobs(model, inputs, targets[None], temperature,
                                        with_entropy and entropy_grad)  # [1, K]
    where_all = scored.nonzero().squeeze(-1)  # [K_total] global scoring positions, in order
    where = (packed.rows[where_all + 1], packed.cols[where_all + 1])
    shape = tuple(input_ids.shape)

    def gather(values: torch.Tensor) -> torch.Tensor:  # chunk's [1, K] → [B, T] of the whole pass
        dense = values.new_zeros(chunk).index_put((at,), values[0])
        full = _gather_chunks(dense, group)[where_all]
        return full.new_zeros(shape).index_put(where, full)

    return gather(logprobs), (gather(entropy) if with_entropy else None)
