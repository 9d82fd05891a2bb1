"""Generation engine v1: batched sampling with a KV cache over a Hugging Face causal LM.

The prompt is prefilled once per distinct prompt and its cache is replicated for the n samples;
each decode step feeds only the newest token. Rows that finish (EOS or `max_new_tokens`) are
dropped from the batch and its cache at once, so finished sequences stop costing compute, and
`generate_stream` hands them out at that moment (the judge can start on them while the rest of
the batch is still decoding).

Sleep / wake. When generation shares a device with training or with another engine
(`colocate`), the engine releases its device memory between turns: `sleep("offload")` moves the
weights to host memory (pinned on CUDA) and `wake()` copies them back; `sleep("discard")` drops
them (the next `load_weights` after `wake()` refills them, e.g. from the trainer). The KV cache
lives only inside a generate call, so a sleeping engine holds no KV memory either.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

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
        self.state: Literal["awake", "offloaded", "discarded"] = "awake"
        self._home: torch.device = next(self.model.parameters()).device
        self._needs_weights = False
        for param in self.model.parameters():
            param.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self._home

    def weight_bytes(self) -> int:
        """Bytes of the engine's parameters and buffers (what sleeping releases from the device)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def sleep(self, level: Literal["offload", "discard"] = "offload") -> int:
        """Release the engine's device memory; returns the bytes released (0 if already asleep).

        "offload" keeps a host copy that `wake()` restores; "discard" keeps nothing of the
        parameters (small buffers such as rotary tables are offloaded), so `load_weights` must
        refill them after `wake()` before the engine generates again. Discarding an offloaded
        engine drops its host copy.
        """
        if self.state == "offloaded" and level == "discard":
            self._discard_host_copy()
            return 0
        if self.state != "awake":
            return 0
        released = self.weight_bytes()
        pin = self._home.type == "cuda"
        self._discarded_shapes = {}
        for name, tensor in self.model.named_parameters():
            if level == "discard":
                self._discarded_shapes[name] = tensor.shape
                tensor.data = torch.empty(0, dtype=tensor.dtype, device=self._home)
            else:
                tensor.data = _to_host(tensor.data, pin)
        for tensor in self.model.buffers():
            tensor.data = _to_host(tensor.data, pin)
        self.state = "offloaded" if level == "offload" else "discarded"
        if pin:
            torch.cuda.empty_cache()
        return released

    def _discard_host_copy(self) -> None:
        """Drop the parameters' host copy of an offloaded engine (it becomes "discarded")."""
        self._discarded_shapes = {}
        for name, tensor in self.model.named_parameters():
            self._discarded_shapes[name] = tensor.shape
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=self._home)
        self.state = "discarded"

    @torch.no_grad()
    def wake(self) -> None:
        """Re-allocate the weights on the device (restored from the host copy after "offload")."""
        if self.state == "awake":
            return
        for name, tensor in self.model.named_parameters():
            if self.state == "discarded":
                tensor.data = torch.empty(self._discarded_shapes[name], dtype=tensor.dtype, device=self._home)
            else:
                tensor.data = tensor.data.to(self._home)
        for tensor in self.model.buffers():
            tensor.data = tensor.data.to(self._home)
        self._needs_weights = self.state == "discarded"
        self.state = "awake"

    def _check_ready(self) -> None:
        if self.state != "awake":
            raise RuntimeError(f"the engine is asleep ({self.state}); call wake() before generating")
        if self._needs_weights:
            raise RuntimeError("the engine's weights were discarded; load_weights() must refill them before generating")

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
        if self._needs_weights and updated < len(params):
            raise RuntimeError(f"the engine's weights were discarded but only {updated} of {len(params)} were reloaded")
        self._needs_weights = False
        self.policy_version += 1
        return updated

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingConfig, seed: int | None = None) -> list[Completion]:
        """Sample `params.n` completions for every prompt.

        Returns `len(prompts) * n` completions ordered prompt-major (the n samples of prompt i
        are rows i*n .. i*n+n-1), each with its token ids, per-token log-probs and finish reason.
        """
        results = [c for finished in self.generate_stream(prompts, params, seed) for c in finished]
        return sorted(results, key=lambda c: (c.prompt_index, c.sample_index))

    def generate_stream(self, prompts: Sequence[Sequence[int]], params: SamplingConfig,
                        seed: int | None = None) -> Iterator[list[Completion]]:
        """Like `generate`, but yields completions as soon as they finish.

        Each yielded list holds the completions that finished at one decode step (EOS or length);
        over the whole iteration every one of the `len(prompts) * n` completions is yielded once.
        The samples of one prompt keep their relative order. Same seed → same completions as
        `generate`.
        """
        self._check_ready()
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        for start in range(0, len(prompts), self.max_batch_prompts):
            chunk = prompts[start : start + self.max_batch_prompts]
            yield from self._generate_chunk(chunk, start, params, generator)

    @torch.no_grad()
    def _generate_chunk(self, prompts: Sequence[Sequence[int]], index_offset: int, params: SamplingConfig,
                        generator: torch.Generator | None) -> Iterator[list[Completion]]:
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
        active = torch.arange(total, device=device)  # original row of each live batch row

        def finished(rows: list[int], reason: str) -> list[Completion]:
            return [Completion(prompt_index=index_offset + row // n, sample_index=row % n, prompt_ids=list(prompts[row // n]),
                               token_ids=tokens[row], logprobs=logprobs[row], finish_reason=reason,
                               policy_version=self.policy_version) for row in rows]

        for step in range(params.max_new_tokens):
            new_tokens, new_logprobs = sample_tokens(logits, params, generator)
            for row, tok, lp in zip(active.tolist(), new_tokens.tolist(), new_logprobs.tolist(), strict=True):
                tokens[row].append(tok)
                logprobs[row].append(lp)
            keep = new_tokens != self.eos_id
            stopped = active[~keep].tolist()
            if stopped:
                yield finished(stopped, "stop")
            if step == params.max_new_tokens - 1 or not bool(keep.any()):
                truncated = active[keep].tolist()
                if truncated:
                    yield finished(truncated, "length")
                return
            if stopped:
                kept = keep.nonzero().squeeze(-1)
                cache.batch_select_indices(kept)
                active, new_tokens = active[kept], new_tokens[kept]
                attention, next_position = attention[kept], next_position[kept]
            attention = torch.cat([attention, attention.new_ones((attention.shape[0], 1))], dim=-1)
            out = self.model(input_ids=new_tokens.unsqueeze(-1), attention_mask=attention,
                             position_ids=next_position.unsqueeze(-1), past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
            next_position = next_position + 1


def _to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = tensor.to("cpu", copy=True)
    return copy.pin_memory() if pin else copy
