"""The LM head of a log-prob pass, scored in chunks of positions: no `[tokens, vocab]` logits, no such gradient.

A log-prob pass needs, per scored position, the chosen token's `x_t − logsumexp(x)` (`x = logits / T`) and
the entropy `−Σ p log p`, never the logits themselves. Computed from the model's `[B, K, V]` logits, the
head's output and its gradient are each `tokens × vocab` floats (8 rows × 1,024 tokens at Qwen2's 151,936
vocabulary: 5 GB each in fp32), the largest tensors of the step. `ChunkedHeadLogprob` takes the head's
*input* instead: hidden states `[B, K, H]` and the head's weight `[V, H]`, and works through the positions in
chunks of `CHUNK_POSITIONS`, each chunk's logits `[chunk, V]` alive only while it is scored. The
backward recomputes each chunk's logits (one more head matmul) and turns them into `grad_hidden` and
`grad_weight` (accumulated over the chunks) directly, with

    ∂/∂x_j = g · (1[j = t] − p_j)  −  g_H · p_j · (log p_j + H),    ∂/∂logits = ∂/∂x / T,

`g`, `g_H` the gradients of the log-prob and of the entropy (an entropy bonus in the loss: the entropy is
differentiable here at no full-logits cost; its term is skipped when no gradient reaches it).

`selected_head(model, ...)` installs it for one forward: the model's output-embedding module (`lm_head`,
kept as is: parameter names, tied embeddings, weight sync and checkpoints are untouched) has its
`forward` replaced for the duration of the `with`, so when the transformers forward calls
`self.lm_head(hidden[:, kept])` (after `logits_to_keep`), the head returns the `[B, K-1, 2]` scores
(log-prob, entropy) and the model's `.logits` carries them. The weight is used inside the model's forward,
which is what FSDP2 (`fully_shard`) needs: the root module's parameters (the head, the embeddings) are
unsharded only in the root's forward and backward, and FSDP's backward hooks sit on the root's outputs,
through which these scores flow. A model whose forward changes the head's output after the call (logit
soft-capping or scaling) would get wrong scores; `head_is_plain` refuses the known ones (they keep the
full-logits path) and `ChunkedScores.read` raises for any other.

Fused kernels considered (2026-11): liger-kernel's Triton `LigerFusedLinearCrossEntropyFunction` (with
`reduction="none"`, −log-prob per token; CUDA/Triton only) and torch ≥ 2.13's
`torch.nn.functional.linear_cross_entropy` (chunked with `options=LinearCrossEntropyOptions()`) give the
per-token cross entropy without logits, but neither masks vocabulary ids (the vision models' banned
tokens), returns the entropy or takes its gradient, and liger's `chunked_loss` log-prob function is a
private, plain-PyTorch version of the same chunking without them; so nothing is wired to them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn import functional

#: Positions scored at once: about three `[positions, V]` fp32 tensors are alive per chunk (at V = 151,936:
#: 156 MB each). Not fewer: on 2 CPU cores a pass with 110-position chunks took 1.5x as long as with 256
#: (the head's matmuls run less efficiently), where 256 costs about the one extra matmul of the recompute.
CHUNK_POSITIONS = 256

#: Config attributes of transformers models whose forward changes the logits after the LM head
#: (Gemma 2/3 soft-capping, Cohere's scale, Granite's divisor): those keep the full-logits path.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class ChunkedHeadLogprob(torch.autograd.Function):
    """`(hidden [B, K, H], weight [V, H], bias [V] | None, targets [B, K-1], T, banned [U] | None)
    → (logprobs [B, K-1] fp32, entropy [B, K-1] fp32)` of `logits = hidden @ weight.T + bias`.

    Position p scores `targets[:, p]` under `logits[:, p] / T` with the `banned` vocabulary ids at −inf;
    the last position scores nothing (its gradient is 0). The logits are computed in the dtype the
    forward's `linear` gives (the autocast dtype under autocast) and scored in fp32, as the full-logits
    path does; the backward recomputes them in that dtype and accumulates the weight's gradient in fp32.
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                temperature: float, banned: torch.Tensor | None):
        batch, kept, width = hidden.shape
        if targets.shape != (batch, kept - 1):
            raise ValueError(f"the LM head got hidden states {tuple(hidden.shape)} for targets {tuple(targets.shape)}; "
                             f"expected [B, K, H] with targets [B, K-1]")
        flat, flat_targets = hidden[:, :-1].reshape(-1, width), targets.reshape(-1, 1)
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=hidden.device)
        logprobs, entropy = torch.empty_like(lse), torch.empty_like(lse)
        ctx.compute_dtype = hidden.dtype
        for rows in _position_chunks(flat.shape[0]):
            scaled, ctx.compute_dtype = _scaled_logits(flat[rows], weight, bias, temperature, banned)
            lse[rows] = torch.logsumexp(scaled, dim=-1)
            logprobs[rows] = scaled.gather(-1, flat_targets[rows]).squeeze(-1) - lse[rows]
            log_p = scaled.sub_(lse[rows, None])
            # mul and sum, not vecdot: autocast would run vecdot in bf16 (this forward runs under autocast)
            entropy[rows] = -log_p.exp().mul_(_finite(log_p, banned)).sum(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, banned, lse, entropy)
        ctx.temperature = temperature
        ctx.set_materialize_grads(False)
        return logprobs.view(batch, kept - 1), entropy.view(batch, kept - 1)

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, bias, targets, banned, lse, entropy = ctx.saved_tensors
        dtype, temperature = ctx.compute_dtype, ctx.temperature
        batch, kept, width = hidden.shape
        flat, flat_targets = hidden[:, :-1].reshape(-1, width).to(dtype), targets.reshape(-1, 1)
        weight_c = weight.to(dtype)
        bias_c = None if bias is None else bias.to(dtype)
        g = torch.zeros_like(lse) if grad_logprobs is None else grad_logprobs.reshape(-1).float()
        g_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).float()
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_flat = torch.empty_like(flat) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device) if want_bias else None
        for rows in _position_chunks(flat.shape[0]):
            log_p = _scaled_logits(flat[rows], weight_c, bias_c, temperature, banned)[0].sub_(lse[rows, None])
            probs = log_p.exp()
            if g_entropy is None:
                grad = probs.mul_(-g[rows, None])
            else:  # −p·(g + g_H·(log p + H)), with log p of a banned id (p = 0) made finite
                grad = _finite(log_p, banned).add_(entropy[rows, None]).mul_(g_entropy[rows, None])
                grad = grad.add_(g[rows, None]).mul_(probs).neg_()
            grad.scatter_add_(-1, flat_targets[rows], g[rows, None])
            if temperature != 1.0:
                grad.div_(temperature)
            if grad_bias is not None:
                grad_bias.add_(grad.sum(0))
            grad = grad.to(dtype)
            if grad_flat is not None:
                torch.mm(grad, weight_c, out=grad_flat[rows])
            if grad_weight is not None:
                _accumulate(grad_weight, grad.t(), flat[rows])
        grad_hidden = None
        if grad_flat is not None:
            grad_hidden = torch.zeros_like(hidden)
            grad_hidden[:, :-1] = grad_flat.view(batch, kept - 1, width)
        return (grad_hidden, None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype), None, None, None)


def _position_chunks(positions: int) -> list[slice]:
    step = CHUNK_POSITIONS
    return [slice(start, min(positions, start + step)) for start in range(0, positions, step)]


def _scaled_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, temperature: float,
                   banned: torch.Tensor | None) -> tuple[torch.Tensor, torch.dtype]:
    """`[rows, V]` fp32 `logits / T` of `hidden` `[rows, H]`, banned ids at −inf; and the dtype `linear` gave."""
    logits = functional.linear(hidden, weight, bias)
    dtype = logits.dtype
    scaled = logits.float()
    if banned is not None:
        scaled.index_fill_(-1, banned, float("-inf"))
    if temperature != 1.0:
        scaled.div_(temperature)
    return scaled, dtype


def _finite(log_p: torch.Tensor, banned: torch.Tensor | None) -> torch.Tensor:
    """`log_p` with the banned ids' −inf set to 0 in place (their p is 0: `p · log p` must be 0, not NaN)."""
    return log_p if banned is None else log_p.index_fill_(-1, banned, 0.0)


def _accumulate(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """`total += left @ right` (`total` fp32; a lower-precision product is rounded once per chunk, then summed in fp32)."""
    if left.dtype == total.dtype:
        total.addmm_(left, right)
    else:
        total.add_(torch.mm(left, right))


def head_is_plain(model: nn.Module) -> bool:
    """Whether `model`'s logits are its output embedding's `nn.Linear` output, unchanged (no soft-capping or scale)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return (isinstance(model.get_output_embeddings(), nn.Linear)
            and not any(getattr(config, name, None) for name in LOGIT_TRANSFORMS))


class ChunkedScores:
    """The `[B, K-1, 2]` scores (log-prob, entropy) the head returned during one forward (see `selected_head`)."""

    def __init__(self) -> None:
        self.scores: torch.Tensor | None = None

    def read(self, logits: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs, entropy) `[B, K-1]` from the model output's `logits`, which must be the head's scores as
        returned: a forward that transformed them (or never called the head) is refused."""
        if self.scores is None or logits is not self.scores:
            raise RuntimeError("the model's forward changed the LM head's output (or did not call the head); the "
                               "chunked head cannot score it: set gcore_rl.training.logprobs.CHUNKED_HEAD = False")
        logprobs, entropy = logits.unbind(-1)
        return logprobs, entropy


@contextlib.contextmanager
def selected_head(model: nn.Module, targets: torch.Tensor, temperature: float = 1.0,
                  banned: torch.Tensor | None = None, entropy_grad: bool = False) -> Iterator[ChunkedScores]:
    """Within the `with`, `model`'s output embedding returns `ChunkedHeadLogprob`'s scores of `targets` `[B, K-1]`
    stacked `[B, K-1, 2]` (log-prob, entropy) instead of `[B, K, V]` logits; the entropy carries a gradient only
    with `entropy_grad`. Yields the `ChunkedScores` to read the forward's `.logits` with."""
    head = model.get_output_embeddings()
    result = ChunkedScores()

    def scored(hidden: torch.Tensor) -> torch.Tensor:
        logprobs, entropy = ChunkedHeadLogprob.apply(hidden, head.weight, head.bias, targets, temperature, banned)
        result.scores = torch.stack([logprobs, entropy if entropy_grad else entropy.detach()], dim=-1)
        return result.scores

    own = head.__dict__.get("forward")  # an instance-level forward someone installed before: put it back after
    head.forward = scored
    try:
        yield result
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
