"""Generation engine: continuous batching, shared prefill, sleep/wake memory, streamed weight updates,
finish reasons, and log-prob parity with the trainer."""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch

from gcore_rl.algos.mismatch import mismatch_weights
from gcore_rl.models.loading import load_causal_lm
from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model, write_tiny_model
from gcore_rl.records import build_token_batch
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.sampling import SamplingConfig, filter_logits, inverse_cdf_sample
from gcore_rl.training.logprobs import token_logprobs
from tests.rollout.host_reads import HostReads, watch_static_steps


def _prompts(tokenizer):
    return [tokenizer.encode(p, add_special_tokens=False) for p in ["12+7=", "3+45=", "999+1=", "a>"]]


@pytest.mark.parametrize("temperature,slots,every,static,seeding", [
    (1.0, 256, 1, False, "call"), (0.7, 256, 1, False, "call"), (1.0, 2, 1, False, "call"), (1.0, 256, 8, False, "call"),
    (1.0, 2, 8, False, "call"), (1.0, 3, 8, True, "call"), (1.0, 3, 8, False, "row")])
def test_engine_logprobs_match_trainer_recompute(tiny, temperature, slots, every, static, seeding):
    """Parity holds with everything in one batch and with 2 slots refilled continuously, whether the host reads
    the batch every round or every 8th (`finish_check_every`, rows that ended decoding on until a read), and at
    the static shapes CUDA graphs replay."""
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=slots,
                              finish_check_every=every, static_shapes=static, seeding=seeding)
    params = SamplingConfig(n=3, max_new_tokens=12, temperature=temperature, top_p=0.9, top_k=20)
    completions = engine.generate(_prompts(tokenizer), params, seed=0)
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature)
    gap = ((recomputed - batch.rollout_logprobs).abs() * batch.response_mask).max()
    assert gap < 1e-4
    # ragged lengths: the parity must hold across rows that finished at different steps
    assert len({len(c.token_ids) for c in completions}) > 1


def test_a_loaded_engine_computes_what_a_reloaded_one_does(tmp_path):
    """An engine straight from `load_causal_lm` and one whose weights were discarded and refilled
    (fresh storage, as after every colocated update) give bit-identical log-probs: a run resumed from
    a checkpoint (a new engine) continues exactly where the uninterrupted run (a reloaded one) was."""
    tokenizer = build_char_tokenizer()
    path = write_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    loaded = load_causal_lm(path)
    assert all(p.data_ptr() % 64 == 0 for p in loaded.parameters())  # not views into the loader's buffer
    prompts = [tokenizer.encode(f"{a}+{b}=", add_special_tokens=False) for a, b in ((12, 7), (3, 45), (99, 1), (5, 5), (40, 2))]
    params = SamplingConfig(n=4, max_new_tokens=6)
    fresh = GenerationEngine(loaded, tokenizer.eos_token_id, tokenizer.pad_token_id)
    reloaded = GenerationEngine(load_causal_lm(path), tokenizer.eos_token_id, tokenizer.pad_token_id)
    reloaded.sleep("discard")
    reloaded.wake()
    reloaded.load_weights(load_causal_lm(path).named_parameters())
    first, second = (engine.generate(prompts, params, seed=9021) for engine in (fresh, reloaded))
    assert [c.token_ids for c in first] == [c.token_ids for c in second]
    assert [c.logprobs for c in first] == [c.logprobs for c in second]


@pytest.mark.parametrize("every", [1, 8])
def test_engine_shapes_order_and_finish_reasons(tiny, every):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=3,
                              finish_check_every=every)
    prompts = _prompts(tokenizer)
    completions = engine.generate(prompts, SamplingConfig(n=2, max_new_tokens=6), seed=1)
    assert len(completions) == 8
    assert [c.prompt_index for c in completions] == [0, 0, 1, 1, 2, 2, 3, 3]
    for c in completions:
        assert c.prompt_ids == prompts[c.prompt_index]
        assert len(c.token_ids) == len(c.logprobs) <= 6
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == tokenizer.eos_token_id
            assert tokenizer.eos_token_id not in c.token_ids[:-1]
        else:
            assert len(c.token_ids) == 6 and tokenizer.eos_token_id not in c.token_ids


def test_greedy_matches_full_recompute_argmax(tiny):
    """Greedy decoding with the cache equals argmax decoding without any cache."""
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompt = tokenizer.encode("12+34=", add_special_tokens=False)
    completion = engine.generate([prompt], SamplingConfig(n=1, max_new_tokens=8, temperature=0.0))[0]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(len(completion.token_ids)):
            logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
            seq.append(int(logits.argmax()))
            if seq[-1] == tokenizer.eos_token_id:
                break
    assert seq[len(prompt):] == completion.token_ids


def test_seeded_generation_is_reproducible(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    params = SamplingConfig(n=4, max_new_tokens=8)
    first = [c.token_ids for c in engine.generate(_prompts(tokenizer), params, seed=5)]
    second = [c.token_ids for c in engine.generate(_prompts(tokenizer), params, seed=5)]
    assert first == second


def test_load_weights_changes_outputs_and_version(tiny):
    model, tokenizer = tiny
    other = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=4),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine = GenerationEngine(build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=3),
                                               len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id),
                              tokenizer.eos_token_id, tokenizer.pad_token_id)
    updated = engine.load_weights(other.named_parameters())
    assert updated == len(list(other.parameters()))
    assert engine.policy_version == 1
    for (name, p), (_, q) in zip(engine.model.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    with pytest.raises(KeyError, match="no parameter"):
        engine.load_weights([("not.a.param", torch.zeros(1))])


def test_filter_logits_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    top2 = filter_logits(logits, top_k=2, top_p=1.0)
    assert torch.isfinite(top2).tolist() == [[True, True, False, False]]
    # mass before token: 0, .5, .8, .95 → with top_p=0.8 keep tokens 0 and 1 only
    nucleus = filter_logits(logits, top_k=0, top_p=0.8)
    assert torch.isfinite(nucleus).tolist() == [[True, True, False, False]]
    nucleus = filter_logits(logits, top_k=0, top_p=0.81)
    assert torch.isfinite(nucleus).tolist() == [[True, True, True, False]]


def _fresh_engine(tiny) -> GenerationEngine:
    model, tokenizer = tiny
    copy = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=3),
                            len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    copy.load_state_dict(model.state_dict())
    return GenerationEngine(copy.eval(), tokenizer.eos_token_id, tokenizer.pad_token_id)


def test_stream_yields_each_completion_once_as_it_finishes(tiny):
    engine = _fresh_engine(tiny)
    prompts = _prompts(tiny[1])
    params = SamplingConfig(n=3, max_new_tokens=10)
    chunks = list(engine.generate_stream(prompts, params, seed=4))
    streamed = [c for chunk in chunks for c in chunk]
    assert sorted((c.prompt_index, c.sample_index) for c in streamed) == [(p, s) for p in range(4) for s in range(3)]
    # finish order: completions that stopped earlier are yielded in earlier chunks
    lengths = [max(len(c.token_ids) for c in chunk) for chunk in chunks]
    assert lengths == sorted(lengths) and len(chunks) > 1
    batch = engine.generate(prompts, params, seed=4)
    assert [(c.prompt_index, c.sample_index) for c in batch] == [(p, s) for p in range(4) for s in range(3)]
    by_key = {(c.prompt_index, c.sample_index): c.token_ids for c in streamed}
    assert [c.token_ids for c in batch] == [by_key[(c.prompt_index, c.sample_index)] for c in batch]


def test_sleep_offload_and_wake_restore_the_same_engine(tiny):
    engine = _fresh_engine(tiny)
    prompts = _prompts(tiny[1])
    params = SamplingConfig(n=2, max_new_tokens=8)
    before = engine.generate(prompts, params, seed=2)
    held = engine.weight_bytes() + engine.kv_bytes()
    assert engine.kv_bytes() > 0  # the KV pool stays allocated between generate calls
    released = engine.sleep("offload")
    assert released == held and engine.kv_bytes() == 0 and engine.state == "offloaded"
    assert engine.sleep("offload") == 0  # already asleep
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, params, seed=2)
    engine.wake()
    after = engine.generate(prompts, params, seed=2)
    assert [c.token_ids for c in after] == [c.token_ids for c in before]


def test_discarded_weights_must_be_reloaded_before_generating(tiny):
    engine = _fresh_engine(tiny)
    weights = {k: v.clone() for k, v in engine.model.named_parameters()}
    prompts = _prompts(tiny[1])
    params = SamplingConfig(n=2, max_new_tokens=8)
    before = engine.generate(prompts, params, seed=5)
    engine.sleep("discard")
    assert all(p.numel() == 0 for p in engine.model.parameters())  # the memory is really gone
    engine.wake()
    with pytest.raises(RuntimeError, match="discarded"):
        engine.generate(prompts, params, seed=5)
    with pytest.raises(RuntimeError, match="only 1 of"):
        engine.load_weights(list(weights.items())[:1])
    engine.load_weights(weights.items())
    assert [c.token_ids for c in engine.generate(prompts, params, seed=5)] == [c.token_ids for c in before]


def test_discarding_an_offloaded_engine_drops_its_host_copy(tiny):
    engine = _fresh_engine(tiny)
    engine.sleep("offload")
    assert engine.sleep("discard") == 0 and engine.state == "discarded"
    assert all(p.numel() == 0 for p in engine.model.parameters())


def _greedy_reference(model, prompt: list[int], steps: int, eos_id: int) -> list[int]:
    """Argmax decoding by full recomputation (no cache, no padding)."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            token = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token == eos_id:
                break
    return out


@pytest.mark.parametrize("slots,min_admit,every", [(2, 1, 1), (3, 2, 1), (64, None, 1), (2, 1, 8), (3, 2, 3)])
def test_refilled_rows_decode_exactly_like_a_lone_sequence(tiny, slots, min_admit, every):
    """Rows admitted mid-flight, moved by compaction and padded differently still decode greedily
    exactly as each prompt alone without a cache (positions, masks and KV moves are right), also when
    finished rows leave only at the host's reads every few rounds."""
    model, tokenizer = tiny
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["12+7=", "3+45=", "999+1=", "a>", "77+", "5"]]
    limits = [3, 11, 2, 7, 5, 9]  # per-prompt lengths: rows finish at different steps
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=slots,
                              min_admit=min_admit, finish_check_every=every)
    completions = engine.generate(prompts, SamplingConfig(n=2, temperature=0.0), max_new_tokens=limits)
    for c in completions:
        assert c.token_ids == _greedy_reference(model, prompts[c.prompt_index], limits[c.prompt_index],
                                                tokenizer.eos_token_id)
    assert engine.last_stats.peak_batch == min(slots, 12)


@pytest.mark.parametrize("every", [1, 8])
def test_finished_rows_are_refilled_so_a_long_tail_does_not_hold_the_batch(tiny, every):
    """One long request among short ones: with refill the decode steps ≈ total tokens / slots plus the
    tail, far fewer than static batches that each wait for their longest member. A row's length limit is
    known to the host, which reads the batch when one is reached: no row waits for a later read."""
    model, tokenizer = tiny
    prompts = [tokenizer.encode(f"{i}+1=", add_special_tokens=False) for i in range(16)]
    limits = [40] + [4] * 15
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=4, min_admit=1,
                              finish_check_every=every)
    params = SamplingConfig(n=1, temperature=1.0, ignore_eos=True)
    completions = engine.generate(prompts, params, seed=0, max_new_tokens=limits)
    assert [len(c.token_ids) for c in completions] == limits  # ignore_eos: exactly the limits
    stats = engine.last_stats
    assert stats.generated_tokens == 100
    # the long row decodes alongside 3 refilled short rows: 40 sampling rounds, not 40 + 3 × 4 (static batches)
    assert stats.sample_steps == 40
    assert stats.prefills > 1 and stats.peak_batch == 4


def test_n_samples_share_one_prefill_per_prompt(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompts = _prompts(tokenizer)
    completions = engine.generate(prompts, SamplingConfig(n=5, max_new_tokens=6), seed=3)
    assert len(completions) == 20
    assert engine.last_stats.prefills == 1 and engine.last_stats.prefill_rows == 4  # not 20
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    with torch.no_grad():
        recomputed, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)
    assert ((recomputed - batch.rollout_logprobs).abs() * batch.response_mask).max() < 1e-4
    # the copies are independent samples, not one sample repeated
    assert len({tuple(c.token_ids) for c in completions if c.prompt_index == 0}) > 1


def test_bad_requests_are_refused(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    with pytest.raises(ValueError, match="one value >= 1 per prompt"):
        engine.generate([[5, 6]], SamplingConfig(n=1), max_new_tokens=[3, 4])
    with pytest.raises(ValueError, match="at least one token"):
        engine.generate([[]], SamplingConfig(n=1))
    assert engine.generate([], SamplingConfig(n=1)) == []


def test_the_host_reads_the_batch_once_per_check(tiny):
    """Issue 49: with `finish_check_every=8` the decode loop waits on the device at most once per 4 decode steps
    (its only waits: a check reads the rows' status, and the completions of the rows that ended), rows that ended
    on EOS still finish there, and the sampled completions are well formed."""
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=8, finish_check_every=8)
    params = SamplingConfig(n=6, max_new_tokens=40, temperature=1.0)
    completions = engine.generate(_prompts(tokenizer), params, seed=3)
    stats = engine.last_stats
    assert stats.decode_steps >= 40 and stats.host_syncs <= stats.decode_steps / 4
    assert {c.finish_reason for c in completions} == {"stop", "length"}
    for c in completions:
        assert tokenizer.eos_token_id not in c.token_ids[:-1] and len(c.token_ids) == len(c.logprobs) <= 40
    assert stats.generated_tokens == sum(len(c.token_ids) for c in completions)
    every_round = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=8)
    every_round.generate(_prompts(tokenizer), params, seed=3)
    assert every_round.finish_check_every == 1  # on a CPU by default
    assert every_round.last_stats.host_syncs >= every_round.last_stats.sample_steps


def test_greedy_completions_do_not_depend_on_the_check_interval(tiny):
    """Which rows decode together changes with `finish_check_every`; a greedy completion does not (its
    log-probs agree to fp32 round-off: the batch's matrix products may sum in another order)."""
    model, tokenizer = tiny
    prompts = [tokenizer.encode(f"{a}+{b}=", add_special_tokens=False) for a, b in ((1, 2), (34, 5), (600, 7), (8, 90))]
    params = SamplingConfig(n=2, max_new_tokens=24, temperature=0.0)
    runs = [GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=3,
                             finish_check_every=every).generate(prompts, params) for every in (1, 3, 8)]
    for other in runs[1:]:
        assert [c.token_ids for c in other] == [c.token_ids for c in runs[0]]
        assert [c.finish_reason for c in other] == [c.finish_reason for c in runs[0]]
        gaps = [abs(a - b) for x, y in zip(other, runs[0], strict=True) for a, b in zip(x.logprobs, y.logprobs, strict=True)]
        assert max(gaps) < 1e-5


@pytest.mark.parametrize("temperature,slots", [(1.0, 5), (0.0, 3), (1.3, 64)])
def test_static_shapes_decode_as_the_eager_loop_does(tiny, temperature, slots):
    """Issue 49: the static-shape decode (the batch padded to a power of two, attention over every pool column:
    the path CUDA graphs replay) gives the eager loop's tokens, with rows refilled and moved, and log-probs to
    fp32 round-off."""
    model, tokenizer = tiny
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["12+7=", "3+45=", "999+1=", "a>", "77+", "5"]]
    params = SamplingConfig(n=3, max_new_tokens=16, temperature=temperature)
    eager, static = (GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=slots,
                                      static_shapes=flag) for flag in (False, True))
    assert eager._static is None and not static.cuda_graphs  # a CPU has no graphs; the static path runs without
    limits = [3, 16, 7, 11, 5, 9]  # rows finish at different steps
    first, second = (engine.generate(prompts, params, seed=11, max_new_tokens=limits) for engine in (eager, static))
    assert [c.token_ids for c in second] == [c.token_ids for c in first]
    gaps = [abs(a - b) for x, y in zip(first, second, strict=True) for a, b in zip(x.logprobs, y.logprobs, strict=True)]
    assert max(gaps) < 1e-5


def test_at_static_shapes_a_call_a_few_tokens_longer_keeps_the_pool_and_its_graphs(tiny):
    """The graphs hold the KV pool's addresses: at static shapes the pool's columns are rounded up (to 64), so the
    next rollout, whose longest prompt or completion is a little longer, decodes in the same pool and replays the
    same graphs instead of capturing new ones."""
    from gcore_rl.rollout.engine import STATIC_COLUMNS

    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=4, static_shapes=True)
    params = SamplingConfig(n=2, max_new_tokens=8)
    engine.generate([tokenizer.encode("1+2=", add_special_tokens=False)], params, seed=0)
    static, capacity = engine._static, engine._cache.capacity
    engine.generate([tokenizer.encode("123+456=", add_special_tokens=False)], SamplingConfig(n=2, max_new_tokens=12), seed=0)
    assert capacity % STATIC_COLUMNS == 0 and engine._static is static and engine._cache.capacity == capacity


def test_with_row_seeding_a_sample_is_the_same_whatever_decodes_beside_it(tiny):
    """`seeding=row`: each sample draws from its own uniforms (by its index and token position), so the batch size,
    the check interval and the static path leave every sampled completion as it was (tokens identical, log-probs
    to fp32 round-off); with one stream per call (`seeding=call`, the default) they do not."""
    model, tokenizer = tiny
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["12+7=", "3+45=", "999+1=", "a>", "77+"]]
    params = SamplingConfig(n=3, max_new_tokens=16, temperature=1.2, top_p=0.95)
    layouts = [dict(max_num_seqs=64), dict(max_num_seqs=2), dict(max_num_seqs=5, finish_check_every=8),
               dict(max_num_seqs=3, static_shapes=True)]
    runs = [GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seeding="row", **layout)
            .generate(prompts, params, seed=7) for layout in layouts]
    assert len({len(c.token_ids) for c in runs[0]}) > 1  # rows ended at different steps
    for other in runs[1:]:
        assert [c.token_ids for c in other] == [c.token_ids for c in runs[0]]
        gaps = [abs(a - b) for x, y in zip(other, runs[0], strict=True) for a, b in zip(x.logprobs, y.logprobs, strict=True)]
        assert max(gaps) < 1e-5
    per_call = [GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, **layout)
                .generate(prompts, params, seed=7) for layout in layouts[:2]]
    assert [c.token_ids for c in per_call[0]] != [c.token_ids for c in per_call[1]]
    with pytest.raises(ValueError, match="seeding"):
        GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, seeding="row", logit_noise_std=0.1)


def test_the_sampler_draws_with_given_uniforms_as_with_its_generator():
    """`inverse_cdf_sample` with a row's own uniforms picks what the generator's identical draws pick."""
    probs = torch.softmax(torch.randn(50, 30, generator=torch.Generator().manual_seed(0)), dim=-1)
    uniforms = torch.rand((50, 1), generator=torch.Generator().manual_seed(1))
    drawn = inverse_cdf_sample(probs, torch.Generator().manual_seed(1))
    assert torch.equal(inverse_cdf_sample(probs, None, uniforms[:, 0]), drawn)


def test_decode_buckets_are_powers_of_two_within_the_pool():
    from gcore_rl.rollout.static_decode import bucket

    assert [bucket(rows, 64) for rows in (1, 2, 3, 5, 8, 9, 33, 64)] == [1, 2, 4, 8, 8, 16, 64, 64]
    assert bucket(5, 6) == 6  # never more rows than the pool has
    with pytest.raises(ValueError):
        bucket(0, 8)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_static_decode_step_reads_nothing_back_and_takes_no_host_data(arch, monkeypatch):
    """Issue 49: what a CUDA graph capture needs of the decode forward, checked on a CPU: no operator in the
    model's static-shape step reads a value back to the host or copies host data in (either would make the
    capture fail on a GPU and leave the bucket eager)."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(arch=arch, hidden_size=32, num_layers=2, intermediate_size=64),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id).eval()
    steps = watch_static_steps(monkeypatch)
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=4,
                              static_shapes=True)
    engine.generate(_prompts(tokenizer), SamplingConfig(n=2, max_new_tokens=5, ignore_eos=True), seed=0)
    assert len(steps) >= 4 and all(not s.reads and not s.uploads for s in steps), steps


@pytest.mark.parametrize("static", [False, True])
def test_the_decode_loop_reads_the_device_only_at_its_counted_checks(tiny, static):
    """Issue 49: between its counted reads (`host_syncs`, <= 1 per 4 decode steps at `finish_check_every=8`)
    nothing in the loop — sampler with top-k/top-p, bookkeeping, forward — reads a value back to the host, so
    on a GPU the host queues forwards without waiting on each."""
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=8,
                              finish_check_every=8, static_shapes=static)
    params = SamplingConfig(n=3, max_new_tokens=40, top_p=0.9, top_k=20)
    with HostReads() as seen:
        completions = engine.generate(_prompts(tokenizer), params, seed=0)
    stats = engine.last_stats
    assert len({len(c.token_ids) for c in completions}) > 1  # rows ended, left and were read at the checks
    assert not seen.reads, seen.reads
    assert stats.decode_steps >= 32 and stats.host_syncs <= stats.decode_steps / 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_decode_as_the_eager_loop_does_on_cuda(tiny):
    """On a GPU: the decode under CUDA graphs (the default there) gives the eager loop's tokens, greedy and sampled
    with a fixed seed, and its log-probs within 1e-5 (issue 49's equality on the GPU)."""
    model, tokenizer = tiny
    model = model.to("cuda")
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["12+7=", "3+45=", "999+1=", "a>"]]
    graphs = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=8)
    eager = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=8, cuda_graphs=False)
    assert graphs.cuda_graphs and graphs.finish_check_every == 8
    for params in (SamplingConfig(n=3, max_new_tokens=24, temperature=0.0), SamplingConfig(n=3, max_new_tokens=24)):
        first, second = eager.generate(prompts, params, seed=5), graphs.generate(prompts, params, seed=5)
        assert [c.token_ids for c in second] == [c.token_ids for c in first]
        gaps = [abs(a - b) for x, y in zip(first, second, strict=True) for a, b in zip(x.logprobs, y.logprobs, strict=True)]
        assert max(gaps) < 1e-5
    assert any(replay.graph is not None for replay in graphs._static._buckets.values())  # captured, not fallen back
    model.to("cpu")


def test_the_sampler_never_draws_a_token_of_zero_probability_at_the_edge(monkeypatch):
    """A draw that rounds up to the row's total mass takes the last token with mass, not one past it."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.2, 0.0, 0.8, 0.0]])
    monkeypatch.setattr(torch, "rand", lambda shape, **kw: torch.ones(shape, dtype=kw.get("dtype")))
    assert inverse_cdf_sample(probs, None).tolist() == [1, 2]


def test_inverse_cdf_sampler_follows_the_distribution():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(20000, 1)
    tokens = inverse_cdf_sample(probs, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert freq[1] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(freq, probs[0], atol=0.01)
    # unnormalised rows (top-k/top-p filtered mass) are sampled in proportion too
    half = inverse_cdf_sample(torch.tensor([[0.0, 2.0, 2.0]]).repeat(4000, 1), torch.Generator().manual_seed(1))
    assert 0.45 < float((half == 1).float().mean()) < 0.55 and int((half == 0).sum()) == 0


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux) to read resident memory")
def test_sleep_frees_weights_and_kv_pool_from_process_memory():
    """Measured, not just counted: resident memory falls by most of what sleep reports releasing."""
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=256, num_layers=4, intermediate_size=512, vocab_size=16000,
                                             max_positions=512), len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    engine.generate([[5, 6, 7] * 10] * 32, SamplingConfig(n=2, max_new_tokens=100, ignore_eos=True), seed=0)
    weights_mib, kv_mib = engine.weight_bytes() / 2**20, engine.kv_bytes() / 2**20
    assert weights_mib > 20 and kv_mib > 20
    gc.collect()
    before = _resident_mib()
    released = engine.sleep("discard") / 2**20
    gc.collect()
    freed = before - _resident_mib()
    assert released == pytest.approx(weights_mib + kv_mib)
    assert freed > 0.6 * released, f"sleep reported {released:.1f} MiB released but RSS fell by {freed:.1f} MiB"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sleep_frees_cuda_memory():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=256, num_layers=4, intermediate_size=512, vocab_size=16000,
                                             max_positions=512), len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    engine = GenerationEngine(model.cuda(), tokenizer.eos_token_id, tokenizer.pad_token_id)
    engine.generate([[5, 6, 7] * 10] * 32, SamplingConfig(n=2, max_new_tokens=100, ignore_eos=True), seed=0)
    torch.cuda.synchronize()
    before, kv = torch.cuda.memory_allocated(), engine.kv_bytes()
    released = engine.sleep("offload")
    freed = before - torch.cuda.memory_allocated()
    assert freed >= 0.95 * released > 0
    engine.wake()  # the weights come back; the KV cache is allocated again by the next generate
    assert torch.cuda.memory_allocated() >= before - kv - released * 0.05
    out = engine.generate([[5, 6, 7] * 10] * 32, SamplingConfig(n=2, max_new_tokens=100, ignore_eos=True), seed=0)
    assert len(out) == 64 and torch.cuda.memory_allocated() >= 0.95 * before


def test_weight_update_streams_one_tensor_at_a_time(tiny):
    """The engine copies each received tensor and lets it go: at no time do more than two streamed
    tensors exist (the one being copied and the sender's next), so no second full model is built."""
    engine = _fresh_engine(tiny)
    source = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=11),
                              len(tiny[1]), tiny[1].pad_token_id, tiny[1].eos_token_id)
    alive: list[weakref.ref] = []
    most_alive = 0

    def stream():
        nonlocal most_alive
        for name, param in source.named_parameters():
            tensor = param.detach().clone()  # as a gathered full tensor would be: fresh memory
            alive.append(weakref.ref(tensor))
            most_alive = max(most_alive, sum(ref() is not None for ref in alive))
            yield name, tensor
            del tensor

    assert engine.load_weights(stream()) == len(list(source.parameters())) > 2
    assert most_alive <= 2
    for (name, mine), theirs in zip(engine.model.named_parameters(), source.parameters(), strict=True):
        assert torch.equal(mine, theirs), name


def test_weight_update_in_parts_counts_as_one_update(tiny):
    engine = _fresh_engine(tiny)
    weights = [(k, v.clone()) for k, v in engine.model.named_parameters()]
    engine.sleep("discard")
    engine.wake()
    version = engine.policy_version
    half = len(weights) // 2
    assert engine.load_weights(weights[:half], final=False) == half
    assert engine.policy_version == version  # not yet a new policy
    with pytest.raises(RuntimeError, match="discarded"):
        engine.generate(_prompts(tiny[1]), SamplingConfig(n=1, max_new_tokens=2))
    assert engine.load_weights(weights[half:], final=False) == len(weights)
    assert engine.load_weights([], final=True) == len(weights)
    assert engine.policy_version == version + 1
    engine.generate(_prompts(tiny[1]), SamplingConfig(n=1, max_new_tokens=2))


def test_engine_config_errors_name_the_key():
    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="engine.max_num_seqs"):
        load_config(JobConfig, None, ["engine.max_num_seqs=0"])
    with pytest.raises(ConfigError, match="engine.min_admit"):
        load_config(JobConfig, None, ["engine.max_num_seqs=8", "engine.min_admit=9"])
    with pytest.raises(ConfigError, match="engine.finish_check_every"):
        load_config(JobConfig, None, ["engine.finish_check_every=-1"])


# ---- the mismatch demo's perturbed engine (engine.logit_noise_std) ----


def _stats(tiny, noise_std: float):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, logit_noise_std=noise_std)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in ["12+7=", "3+45="]]
    batch = build_token_batch(engine.generate(prompts, SamplingConfig(n=8, max_new_tokens=8), seed=0), tokenizer.pad_token_id)
    with torch.no_grad():
        trainer, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, 1.0)
    return mismatch_weights(trainer, batch.rollout_logprobs, batch.response_mask, "tis", "token", 2.0)


def test_noise_shows_as_mismatch_kl_and_tis_weights_stay_under_the_cap(tiny):
    weights, stats = _stats(tiny, 1.0)
    # N(0, 1) noise on every logit: the engine's token log-probs differ from the trainer's by O(1)
    assert stats.kl_k3 > 0.05 and stats.kl_k1 > 0.05
    assert float(weights.max()) <= 2.0 and stats.truncated_fraction > 0 and stats.ratio_max > 2.0


def test_without_noise_there_is_no_mismatch(tiny):
    _, stats = _stats(tiny, 0.0)
    assert abs(stats.kl_k1) < 1e-5 and stats.kl_k3 < 1e-6 and stats.truncated_fraction == 0.0


def test_greedy_decoding_ignores_the_noise(tiny):
    model, tokenizer = tiny
    prompts = [tokenizer.encode("12+7=", add_special_tokens=False)]
    greedy = SamplingConfig(n=1, max_new_tokens=6, temperature=0.0)
    noisy = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, logit_noise_std=3.0)
    clean = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    assert noisy.generate(prompts, greedy, seed=0)[0].token_ids == clean.generate(prompts, greedy, seed=0)[0].token_ids


def test_the_probe_times_decode_rounds_at_each_batch_size_and_a_line_fits_them(tiny):
    from gcore_rl.costmodel.replay import fit_engine
    from gcore_rl.records import EngineRounds
    from gcore_rl.rollout.stats import PROBE_BATCHES, probe_rounds

    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=32)
    batches, seconds = probe_rounds(engine, tokenizer.eos_token_id, steps=5)
    # the same number of timed rounds at every batch size, in order: no row stops early
    per_call = len(batches) // len(PROBE_BATCHES)
    assert per_call >= 2 and batches == [b for b in PROBE_BATCHES for _ in range(per_call)]
    assert len(seconds) == len(batches) and all(s > 0 for s in seconds)
    fit = fit_engine(EngineRounds.of_call(batches, seconds, 0, 0, 0, 0))
    assert fit is not None and fit.step_s >= 0 and fit.token_s >= 0 and fit.step_s + fit.token_s > 0
