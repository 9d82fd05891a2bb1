"""Per-token log-probs and entropies of a causal LM over a `TokenBatch` layout.

The log-prob of the chosen token is `x_t − logsumexp(x)` with `x = logits / T`. Every layout (padded
here, packed in `training.packing`, sequence-parallel in `training.sequence_parallel`) runs its forward
through `scored_logprobs`, which by default scores the LM head in chunks of positions inside the
model's forward (`training.chunked_head`): neither the `[tokens, V]` logits nor their gradient is ever
whole, and the banned vocabulary ids of a vision model (`banned_ids`) and the temperature are applied
there, as the engine applies them when it samples.

The full-logits path is kept for models whose forward changes the logits after the head
(`chunked_head.head_is_plain`) and as the reference (`CHUNKED_HEAD = False`: tests and
benchmarks/logprob_memory.py). There, written naively (`log_softmax` then `gather`), autograd would
materialise several `[B, T, V]` tensors per micro-batch; `SelectedLogprob` does the forward in row
chunks and the backward in one pass that writes the logits' gradient directly:
`∂/∂x_j = (1[j = t] − softmax(x)_j) · g / T`. The entropy for the metrics is computed in the same
chunked pass without a graph; only when the loss uses it (entropy bonus) is it computed differentiably
from the full logits (the chunked head has the entropy's gradient built in).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from gcore_rl.algos.kl import entropy_from_logits
from gcore_rl.models.vision import batch_positions, unsampled_tokens, vision_forward_inputs, without_unsampled
from gcore_rl.records import ImageInputs
from gcore_rl.training.chunked_head import head_is_plain, selected_head

#: Rows of `[rows, V]` logits handled at once by `SelectedLogprob` on the full-logits path (bounds its temporaries).
CHUNK_ROWS = 256
#: Score the LM head in chunks inside the forward (`training.chunked_head`); False: the full-logits path.
CHUNKED_HEAD = True


class SelectedLogprob(torch.autograd.Function):
    """`(logits [B, T, V], targets [B, T-1], T) → (logprobs [B, T-1], entropy [B, T-1])`.

    Position p of the outputs scores `targets[:, p]` under `logits[:, p]`; the logits of the last
    position are not used (their gradient is 0). The entropy output carries no gradient. Work goes
    in chunks of whole batch rows (about `CHUNK_ROWS` positions each), so no temporary exceeds a
    chunk, and the backward writes the gradient in place in its output.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, temperature: float):
        batch, length, _ = logits.shape
        lse = torch.empty((batch, length - 1), dtype=torch.float32, device=logits.device)
        entropy = torch.empty_like(lse)
        for rows in _row_chunks(batch, length):
            scaled = logits[rows, :-1].float()
            if temperature != 1.0:
                scaled = scaled / temperature
            lse[rows] = torch.logsumexp(scaled, dim=-1)
            probs = torch.exp(scaled - lse[rows, :, None])
            if bool(torch.isneginf(scaled).any()):  # masked vocabulary: 0 · (−inf) would be NaN
                scaled = scaled.masked_fill(torch.isneginf(scaled), 0.0)
            entropy[rows] = lse[rows] - probs.mul_(scaled).sum(-1)  # not vecdot: autocast would run it in bf16
        picked = logits[:, :-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1).float() / temperature
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.mark_non_differentiable(entropy)
        return picked - lse, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor, grad_entropy: torch.Tensor | None):
        logits, targets, lse = ctx.saved_tensors
        temperature = ctx.temperature
        batch, length, _ = logits.shape
        grad = torch.empty_like(logits)
        grad[:, -1] = 0
        g = (grad_logprobs.float() / temperature).to(grad.dtype)
        for rows in _row_chunks(batch, length):
            out = grad[rows, :-1]  # a view: written in place
            if temperature == 1.0:
                torch.sub(logits[rows, :-1], lse[rows, :, None].to(out.dtype), out=out)
            else:
                torch.div(logits[rows, :-1], temperature, out=out).sub_(lse[rows, :, None].to(out.dtype))
            out.exp_().mul_(-g[rows, :, None])
            out.scatter_add_(-1, targets[rows].unsqueeze(-1), g[rows].unsqueeze(-1))
        return grad, None, None


def _row_chunks(batch: int, length: int) -> list[slice]:
    step = max(1, CHUNK_ROWS // max(1, length - 1))
    return [slice(start, min(batch, start + step)) for start in range(0, batch, step)]


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, temperature: float = 1.0,
                   with_entropy: bool = False, entropy_grad: bool = False,
                   first_scored: int = 1, images: Sequence[ImageInputs | None] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of every token given the tokens before it.

    Args: input_ids, attention_mask `[B, T]` (any mix of left and right padding); `entropy_grad`:
    the entropy takes part in the loss (it then carries a gradient; see `scored_logprobs`);
    `first_scored`: the first column whose log-prob is needed (e.g. the batch's first response
    column): the LM head runs only on columns `first_scored - 1 ..` (`logits_to_keep`), so the
    prompt's columns cost no vocabulary projection; `images`: each row's prompt images (a
    vision-language model: the pixels go in, positions are M-RoPE's, as the engine prefilled them).
    Returns (logprobs `[B, T]` fp32, entropy `[B, T]` or None), zero in columns before
    `first_scored` (column 0 always), computed from logits / temperature exactly as the engine samples.
    """
    first_scored = max(1, first_scored)
    keep = input_ids.shape[1] - first_scored + 1
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=keep,
                  **position_inputs(model, input_ids, attention_mask, images))
    logprobs, entropy = scored_logprobs(model, inputs, input_ids[:, first_scored:], temperature,
                                        with_entropy and entropy_grad)
    pad = torch.nn.functional.pad
    return pad(logprobs, (first_scored, 0)), (pad(entropy, (first_scored, 0)) if with_entropy else None)


def scored_logprobs(model: nn.Module, inputs: dict, targets: torch.Tensor, temperature: float = 1.0,
                    entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `model(**inputs)` and score `targets` `[B, K-1]` under its kept positions: the one forward of every
    log-prob layout.

    `inputs` keep K positions per row (`logits_to_keep`); position p scores `targets[:, p]` under
    `logits[:, p] / T` with the model's `banned_ids` at −inf, the last kept position scores nothing.
    Returns (logprobs, entropy) `[B, K-1]` fp32; the entropy carries a gradient only with `entropy_grad`.
    The head runs chunked (`training.chunked_head`) unless `CHUNKED_HEAD` is off or the model's logits
    are not its head's plain output; then the `[B, K, V]` logits are materialised (`SelectedLogprob`).
    """
    banned = banned_ids(model, targets.device)
    if CHUNKED_HEAD and head_is_plain(model):
        with selected_head(model, targets, temperature, banned, entropy_grad) as scores:
            logits = model(**inputs).logits
        return scores.read(logits)
    logits = without_unsampled(model(**inputs).logits, banned)
    logprobs, entropy = SelectedLogprob.apply(logits, targets, temperature)
    if entropy_grad:
        entropy = entropy_from_logits(logits[:, :-1].float() / temperature)
    return logprobs, entropy


def position_inputs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    images: Sequence[ImageInputs | None] | None = None) -> dict[str, torch.Tensor]:
    """The forward's `position_ids` for a padded batch `[B, T]` (each row's real tokens contiguous, any
    padding side): positions restart at 0 on each row's first real token; with `images`, M-RoPE's
    `[3, B, T]` positions and the rows' pixels (`pixel_values`, `image_grid_thw`), in row order."""
    if has_images(images):
        return {"position_ids": batch_positions(model, input_ids, attention_mask, images),
                **vision_forward_inputs(images, input_ids.device)}
    return {"position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0)}


def banned_ids(model: nn.Module, device: torch.device) -> torch.Tensor | None:
    """The `unsampled_tokens` of `model` as a long tensor (None for a text model), masked as the engine masks them."""
    banned = unsampled_tokens(model)
    return torch.tensor(banned, dtype=torch.long, device=device) if banned else None


def has_images(images: Sequence[ImageInputs | None] | None) -> bool:
    """Whether any row of a batch's `images` (None: a text batch) carries images."""
    return images is not None and any(i is not None for i in images)


def first_response_column(response_mask: torch.Tensor) -> int:
    """The first column of `[B, T]` `response_mask` that holds a response token in any row (1 if none)."""
    columns = response_mask.any(dim=0).nonzero()
    return int(columns[0]) if columns.numel() else 1
