"""Generation engine: continuous batching over a preallocated KV pool, for Hugging Face causal LMs.

The engine owns a copy of the policy and serves "n samples for each of these prompts" requests:

- **Continuous batching.** Up to `max_num_seqs` sequences decode together, each in one row of a
  `SlotKVCache`. A sequence that finishes (EOS or its length limit) leaves the batch at once and
  its row is refilled from the queue of waiting samples (`scheduler.admission_size`), so a few long
  completions do not hold the whole batch: the batch stays full until the queue runs dry.
- **Shared prefill.** The n samples of a prompt admitted together prefill the prompt once; the
  other n-1 rows copy its keys/values (`scheduler.share_prefill`).
- **Streaming.** `generate_stream` yields completions at the check where they are seen finished (the
  judge can grade them while the rest decode).
- **Few host reads.** Tokens, log-probs, counts and the finished mask stay on the device; the host reads
  them in one copy every `finish_check_every` sampling rounds (every round on a CPU, every 8th on a GPU,
  or earlier when a row reaches its length limit, which the host knows), so on a GPU it queues the
  forwards between reads without waiting for each. `EngineStats.host_syncs` counts the reads.
- **Sleep / wake.** When generation shares a device with training or another engine (`colocate`),
  `sleep("offload")` moves the weights to host memory (pinned on CUDA) and frees the KV pool;
  `wake()` copies the weights back (the pool is reallocated by the next generate call).
  `sleep("discard")` drops the weights; the next `load_weights` after `wake()` refills them.
- **Chunked prefill.** With `prefill_chunk_tokens` set, an admission wider than that is prefilled in
  forwards of at most that many columns, each attending to the keys the earlier ones wrote to the
  pool, so a long prompt needs activation memory for one chunk at a time (same logits to fp32
  round-off). An admission with images is prefilled in one forward (the vision tower's features
  replace the image tokens of the whole input).
- **Images.** A prompt that is a `VisionPrompt` (a vision-language policy such as Qwen2-VL) is
  prefilled with its images' pixels and its 3-D M-RoPE positions (`models/vision.py`); the n
  samples of the prompt share that one prefill, so the image is encoded once. Each row keeps the
  offset `delta` between its M-RoPE position and its token count, and decodes from `len + delta`.
- **In-memory weight update.** `load_weights` copies from an iterator of `(name, tensor)`, one
  tensor at a time, so a sender can gather and send one full tensor at a time; an update may also
  arrive in several parts (buckets sent between processes).

Log-probs are those of the sampling distribution (`log_softmax(logits / T)` at the chosen token)
and match the trainer's recomputation to fp32 round-off (`tests/rollout/test_engine.py`).
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Literal

import torch
from transformers import PreTrainedModel

from gcore_rl.models.lora import lora_layers, merged_weights
from gcore_rl.models.vision import (
    rope_positions,
    unsampled_tokens,
    uses_mrope,
    vision_forward_inputs,
    without_unsampled,
)
from gcore_rl.records import Completion, prompt_images
from gcore_rl.rollout.graphs import GraphCapture
from gcore_rl.rollout.kv_cache import SlotKVCache, cache_keyword, decode_mask, prefill_mask
from gcore_rl.rollout.prefix_cache import CachedPrefix, PrefixCache
from gcore_rl.rollout.protocol import Continuation, continuation_inputs, prompt_major
from gcore_rl.rollout.sampling import SamplingConfig, sample_tokens
from gcore_rl.rollout.scheduler import (
    admission_size,
    default_finish_check_every,
    default_min_admit,
    prefill_chunks,
    share_prefill,
)
from gcore_rl.rollout.static_decode import StaticDecode
from gcore_rl.rollout.stats import EngineStats
from gcore_rl.rollout.transfer import upload

STATIC_COLUMNS = 64
"""At static shapes (CUDA graphs), the KV pool's columns are rounded up to a multiple of this."""


class GenerationEngine:
    """Serves sampling requests from its own copy of the policy weights: the `builtin` backend of the
    `RolloutEngine` protocol (`rollout/protocol.py`).

    Args:
        model: a causal LM with full attention in every layer; the engine owns it (the trainer
            holds a separate copy).
        eos_id / pad_id: token ids of end-of-sequence and padding.
        max_num_seqs: sequences decoded together (rows of the KV pool).
        min_admit: free rows that trigger a refill prefill while others decode
            (None = `scheduler.default_min_admit`, an eighth of the rows).
        logit_noise_std: std of Gaussian noise added to the logits before each sampled (not greedy)
            token; the reported log-probs are then those of the noisy distribution (`EngineConfig`).
        prefill_chunk_tokens: most columns of one prefill forward; a wider admission is prefilled in
            chunks (0 = one forward per admission; admissions with images always take one).
        prefix_cache_tokens: positions of finished text sequences whose keys/values are kept, so that a
            continuation of one prefills only what follows it (`rollout/prefix_cache.py`; 0 = none kept).
        finish_check_every: sampling rounds between the host's reads of the sampled tokens, where finished
            sequences leave the batch (0 = `default_finish_check_every` of the device). Between two reads the
            host queues forwards without waiting on the device; a sequence that ends in between keeps its
            row, decoding unkept tokens, until the next read. The samples depend on it (it changes which
            rows decode together) unless `seeding="row"`; greedy completions do not.
        cuda_graphs: on CUDA, decode at static shapes under CUDA graphs, one per batch bucket
            (`rollout/static_decode.py`); a CPU decodes eagerly.
        static_shapes: decode at static shapes (None: where CUDA graphs are used); True on a CPU runs that
            path without graphs (tests: it gives the eager path's tokens).
        seeding: "call" draws every round's uniforms from the call's generator, so a sample's draws depend on
            the rows decoding beside it; "row" gives each sample its own uniforms, a table `[samples, positions]`
            drawn on the host from the call's seed before the first round and read by (sample, token position):
            the same samples whatever the batch, check interval, static or eager path, or device.
    """

    def __init__(self, model: PreTrainedModel, eos_id: int, pad_id: int, max_num_seqs: int = 256,
                 min_admit: int | None = None, logit_noise_std: float = 0.0, prefill_chunk_tokens: int = 0,
                 prefix_cache_tokens: int = 0, finish_check_every: int = 0, cuda_graphs: bool = True,
                 static_shapes: bool | None = None, seeding: Literal["call", "row"] = "call"):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        if prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0 (0 = off), got {prefill_chunk_tokens}")
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0 (0 = off), got {prefix_cache_tokens}")
        if finish_check_every < 0:
            raise ValueError(f"finish_check_every must be >= 0 (0 = by device), got {finish_check_every}")
        if seeding not in ("call", "row") or (seeding == "row" and logit_noise_std > 0):
            raise ValueError(f"seeding must be 'call' or 'row' (not with logit_noise_std), got {seeding!r}")
        _check_full_attention(model)
        self.model = model.eval()
        self.eos_id = eos_id
        self.pad_id = pad_id
        self.max_num_seqs = max_num_seqs
        self.min_admit = min_admit
        self.logit_noise_std = logit_noise_std
        self.seeding = seeding
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.policy_version = 0
        self.state: Literal["awake", "offloaded", "discarded"] = "awake"
        self._home: torch.device = next(self.model.parameters()).device
        self.finish_check_every = finish_check_every or default_finish_check_every(self._home)
        self.cuda_graphs = cuda_graphs and self._home.type == "cuda"
        self.static_shapes = self.cuda_graphs if static_shapes is None else static_shapes
        self.capture = GraphCapture(self.cuda_graphs, "the engine's decode step")
        self._static: StaticDecode | None = None  # the static decode of the current pool
        self._needs_weights = False
        self._cache: SlotKVCache | None = None
        # an M-RoPE model's positions follow its images: its keys are not kept
        self._prefixes = PrefixCache(prefix_cache_tokens) if prefix_cache_tokens and not uses_mrope(model) else None
        self.last_stats = EngineStats()  # of the last generate call (tests and benchmarks read it)
        self._untaken: list[EngineStats] = []  # every call's since the last `take_stats`
        self._loaded = 0  # tensors received by an update still in progress
        banned = unsampled_tokens(model)  # a vision-language policy's image slot tokens
        self._banned = torch.tensor(banned, dtype=torch.long, device=self._home) if banned else None
        self._mrope = uses_mrope(model)  # prompts with images are prefilled with 3-D positions
        self._cache_key = cache_keyword(model)
        for param in self.model.parameters():
            param.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self._home

    def kv_bytes(self) -> int:
        """Bytes of the KV pool currently allocated (kept between generate calls, freed by sleep)."""
        return self._cache.nbytes() if self._cache is not None else 0

    def weight_bytes(self) -> int:
        """Bytes of the engine's parameters and buffers (what sleeping releases from the device)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @torch.no_grad()
    def sleep(self, level: Literal["offload", "discard"] = "offload") -> int:
        """Release the engine's device memory (weights and KV pool); returns the bytes released
        (0 if already asleep).

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
        released = self.weight_bytes() + (self._cache.release() if self._cache is not None else 0)
        self._cache = self._static = None  # a new pool, and new graphs over it, after wake
        self._forget_prefixes()
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
        else:
            return_freed_heap_to_os()
        return released

    def _discard_host_copy(self) -> None:
        """Drop the parameters' host copy of an offloaded engine (it becomes "discarded")."""
        self._discarded_shapes = {}
        for name, tensor in self.model.named_parameters():
            self._discarded_shapes[name] = tensor.shape
            tensor.data = torch.empty(0, dtype=tensor.dtype, device=self._home)
        self.state = "discarded"
        return_freed_heap_to_os()

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
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], final: bool = True,
                     version: int | None = None) -> int:
        """Copy weights in place, one tensor at a time; returns the number of tensors updated.

        Accepts an iterator so the sender can materialise one full tensor at a time. An update may
        come in parts (`final=False` for all but the last call): the policy version moves, and a
        discarded engine is checked for a complete refill, once the final part is in; the return
        value of the final call counts the tensors of all parts. The new policy version is
        `version` (the trainer's count of updates) when given, else the old one plus one.
        """
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"engine has no parameter named '{name}'")
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))
            self._loaded += 1
        if not final:
            return self._loaded
        updated, self._loaded = self._loaded, 0
        if self._needs_weights and updated < len(params):
            raise RuntimeError(f"the engine's weights were discarded but only {updated} of {len(params)} were reloaded")
        self._needs_weights = False
        self._forget_prefixes()  # their keys are the old policy's
        self.policy_version = self.policy_version + 1 if version is None else version
        return updated

    def load_weights_from_path(self, path: str | Path, version: int | None = None) -> int:
        """Load the parameters stored in the safetensors files of the Hugging Face folder `path` as one update."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors file in '{path}'")
        params = dict(self.model.named_parameters())
        for file in files[:-1]:
            self.load_weights(((k, v) for k, v in load_file(file).items() if k in params), final=False)
        return self.load_weights(((k, v) for k, v in load_file(files[-1]).items() if k in params), version=version)

    def save_pretrained(self, path: str | Path) -> None:
        """Write the served weights and the model's config as a Hugging Face folder (safetensors); an engine
        that applies LoRA adapters writes them merged into its base, under the base's names."""
        merged = dict(merged_weights(self.model, lambda tensor: tensor)) if lora_layers(self.model) else None
        self.model.save_pretrained(Path(path), state_dict=merged, safe_serialization=True)

    def take_stats(self) -> EngineStats:
        """The summed statistics of the generate calls since the last take (`EngineStats`), then reset."""
        total = sum(self._untaken, EngineStats())
        self._untaken = []
        return total

    def continue_stream(self, requests: Sequence[Continuation], params: SamplingConfig,
                        seed: int | None = None) -> Iterator[list[Completion]]:
        """One continuation of each request (see `RolloutEngine.continue_stream`): a generate call of each
        request's `prefix + appended`. With a prefix cache (`prefix_cache_tokens`) and every prefix still in
        it, only the positions after the cached ones are prefilled; else the whole context is, which gives
        the same tokens and log-probs (the keys of a prefix do not depend on what follows it)."""
        prompts, single, limits = continuation_inputs(requests, params)
        yield from self.generate_stream(prompts, single, seed, limits)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingConfig, seed: int | None = None,
                 max_new_tokens: Sequence[int] | None = None) -> list[Completion]:
        """Sample `params.n` completions for every prompt.

        Returns `len(prompts) * n` completions ordered prompt-major (the n samples of prompt i
        are rows i*n .. i*n+n-1), each with its token ids, per-token log-probs and finish reason.
        `max_new_tokens` (one per prompt) overrides `params.max_new_tokens` prompt by prompt.
        """
        return prompt_major(self.generate_stream(prompts, params, seed, max_new_tokens))

    def generate_stream(self, prompts: Sequence[Sequence[int]], params: SamplingConfig,
                        seed: int | None = None, max_new_tokens: Sequence[int] | None = None,
                        ) -> Iterator[list[Completion]]:
        """Like `generate`, but yields completions as soon as they finish.

        Each yielded list holds the completions found finished (EOS or length) at one of the host's checks
        (every sampling round on a CPU; see `finish_check_every`);
        over the whole iteration every one of the `len(prompts) * n` completions is yielded once.
        The samples of one prompt keep their relative order. Same seed and engine settings → same
        completions as `generate`.
        """
        self._check_ready()
        if not prompts:
            return
        limits = [params.max_new_tokens] * len(prompts) if max_new_tokens is None else list(max_new_tokens)
        if len(limits) != len(prompts) or min(limits) < 1:
            raise ValueError(f"max_new_tokens needs one value >= 1 per prompt ({len(prompts)} prompts), got {limits}")
        if min(len(p) for p in prompts) == 0:
            raise ValueError("every prompt needs at least one token")
        generator = None
        if seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(seed)
        draws = self._row_draws(len(prompts) * params.n, max(limits), seed) if self.seeding == "row" else None
        yield from self._run(prompts, limits, params, generator, draws)

    def _row_draws(self, samples: int, longest: int, seed: int | None) -> torch.Tensor:
        """`seeding=row`: each sample's uniforms `[samples, longest + 1]` (row p·n + s for sample s of prompt p,
        column k for its k-th token; one more for a row that ended between two checks), drawn on the host from
        `seed` (any device then samples alike) and uploaded once."""
        host = torch.Generator().manual_seed(seed) if seed is not None else None
        return upload(torch.rand((samples, longest + 1), generator=host), self.device)

    # ---- continuous batching ------------------------------------------------------------------

    def _pool(self, slots: int, capacity: int) -> SlotKVCache:
        """The KV pool, reallocated only when this call needs more rows or columns than it has. At static shapes its
        columns are a multiple of `STATIC_COLUMNS`: a new pool means new graphs, so a call whose prompts are a few
        tokens longer than the last one's should still fit (the static step attends over every column, masked)."""
        if self._cache is None or not self._cache.fits(slots, capacity):
            if self._cache is not None:
                self._cache.release()
            dtype = next(self.model.parameters()).dtype
            if self.static_shapes:
                capacity = -(-capacity // STATIC_COLUMNS) * STATIC_COLUMNS
            self._cache = SlotKVCache(slots, capacity, dtype, self.device)
            self._static = (StaticDecode(self.model, self._cache, self.pad_id, self.capture)
                            if self.static_shapes else None)
        return self._cache

    @torch.no_grad()
    def _run(self, prompts: Sequence[Sequence[int]], limits: list[int], params: SamplingConfig,
             generator: torch.Generator | None, draws: torch.Tensor | None = None) -> Iterator[list[Completion]]:
        n, device = params.n, self.device
        every = self.finish_check_every
        waiting = deque((p, s) for p in range(len(prompts)) for s in range(n))
        slots = min(self.max_num_seqs, len(waiting))
        # a row that ends on EOS between two checks decodes up to every - 1 more steps before it leaves
        cache = self._pool(slots, max(len(p) for p in prompts) + max(limits) + every - 1)
        outputs = _Outputs(slots, max(limits), device)
        min_admit = self.min_admit or default_min_admit(slots)
        eos = None if params.ignore_eos else self.eos_id
        stats = self.last_stats = EngineStats(calls=1)
        self._untaken.append(stats)

        # per live row b (rows 0 .. B-1 of the pool), on the device
        start = torch.empty(0, dtype=torch.long, device=device)  # first column of the row's tokens
        delta = torch.empty(0, dtype=torch.long, device=device)  # M-RoPE position minus token count (0 for text)
        end = torch.empty(0, dtype=torch.long, device=device)  # column the next token is written to
        limit = torch.empty(0, dtype=torch.long, device=device)
        count = torch.empty(0, dtype=torch.long, device=device)  # tokens generated so far
        sample = torch.empty(0, dtype=torch.long, device=device)  # the row's sample, p·n + s (its `draws` row)
        alive = torch.empty(0, dtype=torch.bool, device=device)  # still generating (no EOS, under its limit)
        on_eos = torch.empty(0, dtype=torch.bool, device=device)  # ended on EOS
        logits = torch.empty(0, device=device)
        # ... and on the host
        owner: list[tuple[int, int]] = []  # (prompt, sample)
        first_col: list[int] = []  # = start
        end_base: list[int] = []  # end = end_base + forwards: every row advances one column per forward
        admitted: list[int] = []  # rounds before the row's first: it reaches its limit in round admitted + limit
        forwards = rounds = checked = 0  # decode forwards, sampling rounds, and the round of the last check
        due = float("inf")  # the round in which the first live row reaches its limit

        lagged, last_batch = device.type == "cuda", 0
        while owner or waiting:
            round_start = time.perf_counter()
            admit = admission_size(slots - len(owner), len(waiting), len(owner), min_admit) if rounds == checked else 0
            if admit:
                batch = [waiting.popleft() for _ in range(admit)]
                new_logits, new_start, new_delta, width = self._prefill(cache, len(owner), batch, prompts)
                owner += batch
                first_col += [width - len(prompts[p]) for p, _ in batch]
                end_base += [width - forwards] * admit
                admitted += [rounds] * admit
                due = min(due, rounds + min(limits[p] for p, _ in batch))
                start = torch.cat([start, new_start])
                delta = torch.cat([delta, new_delta])
                end = torch.cat([end, torch.full_like(new_start, width)])
                limit = torch.cat([limit, upload([limits[p] for p, _ in batch], device)])
                count = torch.cat([count, torch.zeros_like(new_start)])
                sample = torch.cat([sample, upload([p * n + s for p, s in batch], device)])
                alive = torch.cat([alive, torch.ones_like(new_start, dtype=torch.bool)])
                on_eos = torch.cat([on_eos, torch.zeros_like(new_start, dtype=torch.bool)])
                logits = new_logits if logits.numel() == 0 else torch.cat([logits, new_logits])

            uniforms = draws[sample, count] if draws is not None else None
            new_tokens, new_logprobs = sample_tokens(self._perturbed(logits, params, generator), params, generator,
                                                     uniforms)
            outputs.record(count, new_tokens, new_logprobs)
            count = count + alive
            if eos is not None:
                stopped = alive & (new_tokens == eos)
                on_eos, alive = on_eos | stopped, alive & ~stopped
            alive = alive & (count < limit)
            rounds += 1
            stats.sample_steps += 1
            stats.peak_batch = max(stats.peak_batch, len(owner))
            # the host reads the device every `every` rounds, and in the round a row reaches its limit
            if rounds - checked == every or rounds == due:
                checked = rounds
                live, ended_on_eos, counts = _rows_status(alive, on_eos, count)
                stats.host_syncs += 1
                done_rows = [row for row, still in enumerate(live) if not still]
                if done_rows:
                    read = outputs.read(done_rows, [counts[r] for r in done_rows])
                    stats.host_syncs += 1
                    finished = [self._completion(owner[r], prompts, ids, lps, "stop" if ended_on_eos[r] else "length")
                                for r, (ids, lps) in zip(done_rows, read, strict=True)]
                    stats.generated_tokens += sum(len(c.token_ids) for c in finished)
                    stats.longest = max(stats.longest, *(len(c.token_ids) for c in finished))
                    if self._prefixes is not None:
                        self._keep_prefixes(cache, done_rows, finished, [first_col[r] for r in done_rows])
                    paused = time.perf_counter()
                    yield finished
                    round_start += time.perf_counter() - paused  # the consumer's time is not the engine's
                    order = _compacted_order(len(owner), done_rows)
                    self._compact(cache, outputs, order, max(end_base) + forwards)
                    owner, first_col, end_base, admitted = ([side[r] for r in order]
                                                            for side in (owner, first_col, end_base, admitted))
                    due = min((a + limits[p] for (p, _), a in zip(owner, admitted, strict=True)), default=float("inf"))
                    index = upload(order, device)
                    start, delta, end, limit, count, sample, alive, on_eos = (
                        t[index] for t in (start, delta, end, limit, count, sample, alive, on_eos))
                    new_tokens, logits = new_tokens[index], logits[index]
            if not owner:
                continue
            # a row's token in column c has position c - start (its left padding takes no positions),
            # shifted by the row's M-RoPE offset (text tokens after images advance all three axes alike)
            positions = end - start + delta
            if self._static is not None:
                logits = self._static.forward(new_tokens, positions, start, end)
            else:
                span = max(end_base) + forwards + 1
                cache.plan_decode(end, span)
                out = self.model(input_ids=new_tokens.unsqueeze(-1), position_ids=positions.unsqueeze(-1),
                                 attention_mask=decode_mask(start, end, span), use_cache=True, **{self._cache_key: cache})
                logits = out.logits[:, -1]
            end = end + 1
            forwards += 1
            stats.decode_steps += 1
            # a round's time pairs with the batch whose forward it waited for: on CUDA the forward is
            # asynchronous and the next round's sampling waits for it; rounds with a prefill cost more
            timed_batch, last_batch = (last_batch if lagged else len(owner)), len(owner)
            if not admit and timed_batch:
                stats.round_batches.append(timed_batch)
                stats.round_seconds.append(time.perf_counter() - round_start)

    def _perturbed(self, logits: torch.Tensor, params: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
        """`logits` `[A, V]` plus N(0, logit_noise_std²) noise when sampling with a noise std set, else as given;
        tokens the policy may not generate (`unsampled_tokens`) at −inf."""
        logits = without_unsampled(logits, self._banned)
        if self.logit_noise_std == 0 or params.temperature == 0:
            return logits
        noise = torch.randn(logits.shape, generator=generator, device=logits.device, dtype=torch.float32)
        return logits.float() + self.logit_noise_std * noise

    def _prefill(self, cache: SlotKVCache, first_row: int, batch: list[tuple[int, int]],
                 prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Prefill the distinct prompts of `batch` once and give every sample its prompt's KV rows.

        Rows `first_row .. first_row+len(batch)-1` receive the samples in order. Returns their
        next-token logits `[k, V]`, their first token column `[k]`, their M-RoPE offset `[k]` (0 for
        text) and the prefill width. Prompts with images are prefilled with their pixels.
        """
        distinct, source = share_prefill([p for p, _ in batch])
        width = max(len(prompts[p]) for p in distinct)
        rows = [prompts[p] for p in distinct]
        input_ids, start, positions, delta, extra = self._prefill_inputs(rows, width)
        first_col = self._place_prefixes(cache, first_row, rows, width) if not extra else 0
        logits = self._prefill_forwards(cache, first_row, input_ids, positions, start, extra, first_col)
        self.last_stats.prefill_rows += len(distinct)
        self.last_stats.prefill_tokens += len(distinct) * (width - first_col)
        src = upload(source, self.device)
        if len(distinct) < len(batch):  # n samples of a prompt share its prefilled row
            cache.copy_rows(first_row + src, torch.arange(first_row, first_row + len(batch), device=self.device), width)
        return logits[src], start[src], delta[src], width

    def _prefill_inputs(self, rows: list[Sequence[int]], width: int,
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        """The left-padded prefill batch of `rows` (prompts): token ids `[P, W]`, first token column `[P]`,
        position ids (`[P, W]`, or `[3, P, W]` M-RoPE), M-RoPE offset `[P]` and the pixels' forward inputs."""
        device = self.device
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)  # built on the host, uploaded once
        for row, prompt in enumerate(rows):
            ids[row, width - len(prompt):] = torch.tensor(list(prompt), dtype=torch.long)
        starts = [width - len(prompt) for prompt in rows]
        input_ids, start = upload(ids, device), upload(starts, device)
        positions = (torch.arange(width, device=device)[None, :] - start[:, None]).clamp(min=0)
        delta = torch.zeros(len(rows), dtype=torch.long, device=device)
        images = [prompt_images(prompt) for prompt in rows]
        extra = {}
        if self._mrope:
            positions = positions[None].repeat(3, 1, 1)  # [3, rows, width]
            for row, prompt in enumerate(rows):
                if images[row] is not None:
                    rope = rope_positions(self.model, input_ids[row, starts[row]:], images[row])
                    positions[:, row, starts[row]:] = rope
                    delta[row] = int(rope.max()) + 1 - len(prompt)
            extra = vision_forward_inputs(images, device)
        elif any(i is not None for i in images):
            raise ValueError(f"a prompt carries images but the engine's model ({self.model.config.model_type}) "
                             "is text-only")
        return input_ids, start, positions, delta, extra

    def _prefill_forwards(self, cache: SlotKVCache, first_row: int, input_ids: torch.Tensor,
                          positions: torch.Tensor, start: torch.Tensor, extra: dict, first_col: int = 0) -> torch.Tensor:
        """Write the prefill batch's keys/values into pool rows `first_row ..`, columns `first_col ..` (the
        earlier ones hold cached keys); returns the last column's logits `[P, V]`.

        Columns go in chunks of at most `prefill_chunk_tokens` (`prefill_chunks`), each attending to the
        pool's columns written before it. A batch with images (`extra`) goes in one forward:
        the model writes the vision tower's features over the image tokens of the input it is given.
        """
        rows, width = input_ids.shape
        chunks = prefill_chunks(width, 0 if extra else self.prefill_chunk_tokens, first_col)
        for first, end in chunks:
            cache.plan_prefill(first_row, rows, end, first_col=first)
            out = self.model(input_ids=input_ids[:, first:end], position_ids=positions[..., first:end],
                             attention_mask=prefill_mask(start, end, first_col=first), **{self._cache_key: cache},
                             use_cache=True, logits_to_keep=1, **extra)
        self.last_stats.prefills += len(chunks)
        return out.logits[:, -1]

    def _place_prefixes(self, cache: SlotKVCache, first_row: int, rows: list[Sequence[int]], width: int) -> int:
        """Copy the cached keys of the prefill batch's `rows` (left-padded to `width` columns, written to pool rows
        `first_row ..`) into the pool; returns the first column the model must still compute (0: not every row
        extends a cached prefix, so the whole batch is prefilled)."""
        if self._prefixes is None:
            return 0
        hits = [self._prefixes.longest(row) for row in rows]
        if any(hit is None for hit in hits):
            return 0
        first_col = width - max(len(row) - len(hit.tokens) for row, hit in zip(rows, hits, strict=True))
        for i, (row, hit) in enumerate(zip(rows, hits, strict=True)):
            row_start = width - len(row)
            if first_col > row_start:  # cached columns the batch's forward does not recompute
                cache.write_block(first_row + i, row_start, [k[:, :first_col - row_start] for k in hit.keys],
                                  [v[:, :first_col - row_start] for v in hit.values])
                self.last_stats.cached_tokens += first_col - row_start
        return first_col

    def _keep_prefixes(self, cache: SlotKVCache, done_rows: list[int], finished: list[Completion],
                       first_cols: list[int]) -> None:
        """Keep the keys of the sequences that just finished (pool rows `done_rows`, whose tokens start at
        `first_cols`): their prompt and every generated token but the last, which was never run through the model
        (a row that ended between two checks wrote keys after it, which are not kept)."""
        for row, completion, first in zip(done_rows, finished, first_cols, strict=True):
            kept = (*completion.prompt_ids, *completion.token_ids[:-1])
            keys, values = cache.read_block(row, first, first + len(kept))
            self._prefixes.put(CachedPrefix(kept, keys, values))

    def _forget_prefixes(self) -> None:
        if self._prefixes is not None:
            self._prefixes.clear()

    def _compact(self, cache: SlotKVCache, outputs: _Outputs, order: list[int], width: int) -> None:
        """Move surviving rows to their new slots (`order[new] = old`, from `_compacted_order`)."""
        moves = [(src, dst) for dst, src in enumerate(order) if src != dst]
        if moves:
            src, dst = (upload(list(side), self.device) for side in zip(*moves, strict=True))
            cache.copy_rows(src, dst, width)
            outputs.move(src, dst)

    def _completion(self, key: tuple[int, int], prompts: Sequence[Sequence[int]], token_ids: list[int],
                    logprobs: list[float], reason: str) -> Completion:
        prompt, sample = key
        return Completion(prompt_index=prompt, sample_index=sample, prompt_ids=list(prompts[prompt]),
                          token_ids=token_ids, logprobs=logprobs, finish_reason=reason,
                          policy_version=self.policy_version)


def _compacted_order(live: int, done_rows: list[int]) -> list[int]:
    """Old row of each surviving row after compaction: finished rows' slots are refilled from the end
    of the batch (survivors in the tail move down, everything else stays in place)."""
    done = set(done_rows)
    survivors = live - len(done)
    tail = [r for r in range(survivors, live) if r not in done]
    return [r if r not in done else tail.pop() for r in range(survivors)]


class _Outputs:
    """The live rows' completions so far, on the device: token ids and log-probs `[slots, longest + 1]`, row b the
    sequence in pool row b (moved with it at compaction). The host reads a row once, when its sequence ends."""

    def __init__(self, slots: int, longest: int, device: torch.device):
        self.tokens = torch.zeros((slots, longest + 1), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((slots, longest + 1), dtype=torch.float32, device=device)

    def record(self, count: torch.Tensor, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        """Row b's new token `tokens[b]` and its fp32 log-prob (`[B]` each) at column `count[b]` (`[B]` long, its
        tokens so far); a row that has ended writes after its last token, where nothing is read."""
        rows = count.shape[0]
        self.tokens[:rows].scatter_(1, count[:, None], tokens[:, None])
        self.logprobs[:rows].scatter_(1, count[:, None], logprobs[:, None])

    def read(self, rows: list[int], lengths: list[int]) -> list[tuple[list[int], list[float]]]:
        """(token ids, log-probs) of each of `rows`, the first `lengths` of each, in one device-to-host copy (fp64
        holds the ids and the fp32 log-probs exactly)."""
        width = max(lengths)
        index = upload(rows, self.tokens.device)
        packed = torch.cat([self.tokens[index, :width].double(), self.logprobs[index, :width].double()], dim=1).tolist()
        return [([int(t) for t in row[:length]], row[width:width + length]) for row, length in zip(packed, lengths, strict=True)]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Row `dst[i]` takes row `src[i]` (`[M]` long each)."""
        self.tokens[dst], self.logprobs[dst] = self.tokens[src], self.logprobs[src]


def _rows_status(alive: torch.Tensor, on_eos: torch.Tensor, count: torch.Tensor) -> list[list[int]]:
    """Per live row (`[B]` each): whether it still generates (1/0), whether it ended on EOS (1/0), its token count;
    in one device-to-host copy."""
    return torch.stack([alive.long(), on_eos.long(), count]).tolist()


def _to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    copy = tensor.to("cpu", copy=True)
    return copy.pin_memory() if pin else copy


def return_freed_heap_to_os() -> None:
    """Ask glibc to give freed heap pages back to the OS (`malloc_trim`).

    Large tensors freed on CPU may sit in the allocator's heap once glibc has raised its mmap
    threshold, so without this a sleeping CPU engine would keep its memory resident. No-op where
    glibc is absent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.malloc_trim(0)


def _check_full_attention(model: PreTrainedModel) -> None:
    """The KV pool keeps every token of every layer: sliding-window or linear-attention layers are refused."""
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        raise ValueError(f"GenerationEngine supports full-attention decoders only; {model.config.model_type} "
                         f"has layer types {sorted(kinds)}")
