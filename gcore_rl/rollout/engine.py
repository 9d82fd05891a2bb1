"""Generation engine v1: batched sampling with a KV cache over a Hugging Face causal LM.

The prompt is prefilled once per distinct prompt and its cache is replicated for the n samples;
each decode step feeds only the newest token. Rows that finish (EOS or `max_new_tokens`) are
dropped from the batch and its cache at once, so finished sequences stop costing compute.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from transformers import DynamicCache, PreTrainedModel

from gcore_rl.records import Completion
from gcore_rl.rollout.sampling import SamplingConfig, sample_tokens


class GenerationEngine:
    """Serves sampling requests from its own copy of the policy weights.

    Args:
        model: a causal LM; the engine owns it (the trainer holds a separate copy).
        eos_id / pad_id: token ids of end-of-sequence and padding.
        max_batch_prompts: distinct prompts prefilled together (n samples each).
    """

    def __init__(self, model: PreTrainedModel, eos_id: int, pad_id: int, max_batch_prompts: int = 64):
        self.model = model.eval()
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.max_batch_prompts = max_batch_prompts
        self.policy_version = 0
        for param in self.model.parameters():
            param.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy weights in place, one tensor at a time; returns the number of tensors updated.

        Accepts an iterator so the sender can materialise one full tensor at a time.
        """
        params = dict(self.model.named_parameters())
        updated = 0
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine has no parameter named '{name}'")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            updated += 1
        self.policy_version += 1
        return updated

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingConfig, seed: int | None = None) -> list[Completion]:
        """Sample `params.n` completions for every prompt.

        Returns `len(prompts) * n` completions ordered prompt-major (the n samples of prompt i
        are rows i*n .. i*n+n-1), each with its token ids, per-token log-probs and finish reason.
        """
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        results: list[Completion] = []
        for start in range(0, len(prompts), self.max_batch_prompts):
            chunk = prompts[start : start + self.max_batch_prompts]
            results.extend(self._generate_chunk(chunk, start, params, generator))
        return results

    @torch.no_grad()
    def _generate_chunk(self, prompts: Sequence[Sequence[int]], index_offset: int, params: SamplingConfig,
                        generator: torch.Generator | None) -> list[Completion]:
        device, n = self.device, params.n
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long, device=device)
        attention = torch.zeros((len(prompts), width), dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long, device=device)
            attention[row, width - len(prompt):] = 1
        positions = (attention.cumsum(-1) - 1).clamp(min=0)

        cache = DynamicCache()
        out = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        # one prefill per distinct prompt, replicated for its n samples
        cache.batch_repeat_interleave(n)
        logits = out.logits[:, -1].repeat_interleave(n, dim=0)
        attention = attention.repeat_interleave(n, dim=0)
        next_position = positions[:, -1].repeat_interleave(n, dim=0) + 1

        total = len(prompts) * n
        tokens: list[list[int]] = [[] for _ in range(total)]
        logprobs: list[list[float]] = [[] for _ in range(total)]
        reasons: list[str] = ["length"] * total
        active = torch.arange(total, device=device)  # original row of each live batch row
        for step in range(params.max_new_tokens):
            new_tokens, new_logprobs = sample_tokens(logits, params, generator)
            for row, tok, lp in zip(active.tolist(), new_tokens.tolist(), new_logprobs.tolist(), strict=True):
                tokens[row].append(tok)
                logprobs[row].append(lp)
                if tok == self.eos_id:
                    reasons[row] = "stop"
            keep = new_tokens != self.eos_id
            if step == params.max_new_tokens - 1 or not bool(keep.any()):
                break
            if not bool(keep.all()):
                kept = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(kept)
                active, new_tokens = active[kept], new_tokens[kept]
                attention, next_position = attention[kept], next_position[kept]
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=-1)
            out = self.model(input_ids=new_tokens.unsqueeze(-1), attention_mask=attention,
                             position_ids=next_position.unsqueeze(-1), past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
            next_position = next_position + 1
        return [
            Completion(prompt_index=index_offset + row // n, prompt_ids=list(prompts[row // n]), token_ids=tokens[row],
                       logprobs=logprobs[row], finish_reason=reasons[row], policy_version=self.policy_version)
            for row in range(total)
        ]
