"""Forward passes over a micro-batch packed into one row, without padding.

A `TokenBatch` micro-batch is `[B, T]` with left-padded prompts and right-padded completions, so a
padded forward spends `B · T` positions of attention and MLP on rows whose real lengths may differ by
orders of magnitude. Packed, the rows' real tokens are concatenated into one row of `N = Σ len_b`
tokens, each row's positions restarting at 0. With `attention_mask=None`, transformers (≥ 5) reads
the restarts in `position_ids` as sequence boundaries: flash-attention kernels run varlen
(`cu_seqlens`), SDPA and eager get an exact block-diagonal causal mask, so no token attends across
rows. The LM head runs only on the positions whose next token is scored (`logits_to_keep` as
indices). The results are scattered back to the `[B, T]` layout, equal to the padded computation
up to float rounding (tests/training/test_packing.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from gcore_rl.models.vision import batch_positions, vision_forward_inputs
from gcore_rl.records import ImageInputs
from gcore_rl.training.logprobs import has_images, scored_logprobs


@dataclass(frozen=True)
class PackedRows:
    """The real tokens of a `[B, T]` batch as one row.

    input_ids, position_ids: `[1, N]`; rows, cols: `[N]`, where packed token `j` came from
    (`rows[j]`, `cols[j]`). Each row's tokens are contiguous and in column order.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.input_ids.shape[1])

    def scored(self, first_scored: int) -> torch.Tensor:
        """`[N-1]` bool: packed position `j` scores the token at `j + 1` (both of one row, its column at
        least `first_scored`, and never column 0)."""
        same_row = self.rows[1:] == self.rows[:-1]
        return same_row & (self.cols[1:] >= max(1, first_scored))


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack the tokens where `attention_mask` `[B, T]` is 1 (contiguous within each row) into one row."""
    rows, cols = attention_mask.bool().nonzero(as_tuple=True)  # row-major: each row's tokens in order
    positions = (attention_mask.long().cumsum(-1) - 1)[rows, cols]
    return PackedRows(input_ids=input_ids[rows, cols][None], position_ids=positions[None], rows=rows, cols=cols)


def packed_token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          temperature: float = 1.0, with_entropy: bool = False, entropy_grad: bool = False,
                          first_scored: int = 1, images: Sequence[ImageInputs | None] | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`training.logprobs.token_logprobs` computed on the packed row: same arguments, same `[B, T]` results.

    With `images` (a vision-language model) the positions are `[4, 1, N]`: the text positions that mark
    the rows' boundaries, then the M-RoPE positions of every packed token; the rows' pixels go in row order.

    The token at packed position `j + 1` is scored under the logits of position `j` when both belong
    to the same row and its column is at least `first_scored`; every other entry is 0.
    """
    packed = pack_rows(input_ids, attention_mask)
    at = packed.scored(first_scored).nonzero().squeeze(-1)  # [K] scoring positions
    # one trailing position more: scored_logprobs scores position p with targets[p] and ignores the last one
    keep = torch.cat([at, at.new_tensor([packed.length - 1])])
    positions, extra = packed.position_ids, {}
    if has_images(images):
        rope = batch_positions(model, input_ids, attention_mask, images)[:, packed.rows, packed.cols]  # [3, N]
        positions = torch.cat([packed.position_ids, rope])[:, None]  # [4, 1, N]
        extra = vision_forward_inputs(images, input_ids.device)
    inputs = dict(input_ids=packed.input_ids, position_ids=positions, attention_mask=None, use_cache=False,
                  logits_to_keep=keep, **extra)  # K + 1 positions kept
    logprobs, entropy = scored_logprobs(model, inputs, packed.input_ids[:, at + 1], temperature,
                                        with_entropy and entropy_grad)  # [1, K]
    where = (packed.rows[at + 1], packed.cols[at + 1])
    shape = tuple(input_ids.shape)
    scatter = lambda values: values.new_zeros(shape).index_put(where, values[0])  # noqa: E731 - differentiable
    return scatter(logprobs), (scatter(entropy) if with_entropy else None)
