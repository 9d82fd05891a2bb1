"""The builtin engine's prefix cache (`engine.prefix_cache_tokens`): a continuation of a sequence the engine
finished prefills only the positions after the kept ones, and gives the tokens and log-probs of a full prefill."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.errors import ConfigError
from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, build_tiny_model
from gcore_rl.rollout.backends import EngineConfig
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.prefix_cache import CachedPrefix, PrefixCache
from gcore_rl.rollout.protocol import Continuation, prompt_major
from gcore_rl.rollout.sampling import SamplingConfig

TEXTS = ["7=", "12+7=", "999+1="]  # ragged: rows left-padded differently at each turn
FIRST = SamplingConfig(n=2, max_new_tokens=6, temperature=1.0)
NEXT = SamplingConfig(n=1, max_new_tokens=5, temperature=1.0)


def entry(*tokens: int) -> CachedPrefix:
    kv = [torch.zeros(1, len(tokens), 2)]
    return CachedPrefix(tuple(tokens), kv, kv)


def test_the_longest_kept_prefix_that_leaves_a_token_to_compute_is_found():
    cache = PrefixCache(max_tokens=100)
    for tokens in [(1, 2), (1, 2, 3), (1, 2, 3, 4), (5, 6)]:
        cache.put(entry(*tokens))
    assert cache.longest([1, 2, 3, 4, 9]).tokens == (1, 2, 3, 4)
    assert cache.longest([1, 2, 3, 4]).tokens == (1, 2, 3)  # the last token must run through the model
    assert cache.longest([1, 2, 7]).tokens == (1, 2)
    assert cache.longest([2, 3]) is None and cache.longest([5]) is None


def test_the_least_recently_used_entries_leave_beyond_the_budget():
    cache = PrefixCache(max_tokens=6)
    cache.put(entry(1, 2, 3))
    cache.put(entry(4, 5))
    assert cache.longest([1, 2, 3, 0]) is not None  # (1, 2, 3) is now the most recent
    cache.put(entry(6, 7))
    assert cache.held_tokens == 5 and cache.longest([4, 5, 0]) is None and len(cache) == 2
    cache.put(entry(*range(10, 17)))  # longer than the whole budget: not kept, nothing evicted
    assert len(cache) == 2
    cache.clear()
    assert cache.held_tokens == 0 and cache.longest([1, 2, 3, 0]) is None


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny(request):
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128, seed=5,
                                             arch=request.param),
                             len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    return model.eval(), tokenizer


def two_turns(tiny, appended_text: str = "U:ok\nA:", **engine_args):
    """Each prompt's samples, then one continuation of each after `appended_text`; the engine and its stats of
    the continuation call."""
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, **engine_args)
    prompts = [tokenizer.encode(t, add_special_tokens=False) for t in TEXTS]
    first = engine.generate(prompts, FIRST, seed=3)
    appended = tokenizer.encode(appended_text, add_special_tokens=False)
    requests = [Continuation([*c.prompt_ids, *c.token_ids], appended, NEXT.max_new_tokens) for c in first]
    second = prompt_major(engine.continue_stream(requests, NEXT, seed=4))
    return first, second, engine


def same(completions, reference):
    assert [c.token_ids for c in completions] == [c.token_ids for c in reference]
    for c, r in zip(completions, reference, strict=True):
        assert c.logprobs == pytest.approx(r.logprobs, abs=1e-5, rel=0)


@pytest.mark.parametrize("chunk,every", [(0, 1), (2, 1), (0, 8)])
def test_a_continuation_prefills_only_the_appended_turn_and_samples_the_same(tiny, chunk, every):
    """Also when the host reads the batch every 8th round (a row that ended on EOS writes keys after its last
    token until then, which are not kept)."""
    first, second, engine = two_turns(tiny, prefix_cache_tokens=10_000, prefill_chunk_tokens=chunk,
                                      finish_check_every=every)
    ref_first, ref_second, ref_engine = two_turns(tiny, prefill_chunk_tokens=chunk, finish_check_every=every)
    same(first, ref_first)
    same(second, ref_second)
    cached, full = engine.last_stats, ref_engine.last_stats
    appended = len(tiny[1].encode("U:ok\nA:", add_special_tokens=False))
    contexts = [len(c.prompt_ids) + len(c.token_ids) for c in first]
    assert full.prefill_tokens == len(first) * (max(contexts) + appended) and full.cached_tokens == 0
    # the batch computes the columns of the row with the most uncached positions: its appended turn and the last
    # sampled token of its first turn, which no forward had run
    assert cached.prefill_tokens == len(first) * (appended + 1)
    assert cached.cached_tokens == sum(contexts) - len(first)


def test_loading_weights_empties_the_cache(tiny):
    model, tokenizer = tiny
    _, _, engine = two_turns(tiny, prefix_cache_tokens=10_000)
    assert engine._prefixes.held_tokens > 0
    engine.load_weights(list(model.named_parameters())[:1])
    assert engine._prefixes.held_tokens == 0


def test_a_batch_with_a_prefix_not_kept_is_prefilled_whole(tiny):
    model, tokenizer = tiny
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, prefix_cache_tokens=10_000)
    [done] = engine.generate([tokenizer.encode("12+7=", add_special_tokens=False)], NEXT, seed=1)
    stranger = tokenizer.encode("3+4=", add_special_tokens=False)
    requests = [Continuation([*done.prompt_ids, *done.token_ids], [5], 3), Continuation(stranger, [6], 3)]
    list(engine.continue_stream(requests, NEXT, seed=2))
    assert engine.last_stats.cached_tokens == 0
    assert engine.last_stats.prefill_tokens == 2 * (len(done.prompt_ids) + len(done.token_ids) + 1)


def test_a_budget_smaller_than_the_contexts_falls_back_to_full_prefills(tiny):
    first, second, engine = two_turns(tiny, prefix_cache_tokens=8)
    _, ref_second, _ = two_turns(tiny)
    same(second, ref_second)
    assert engine.last_stats.cached_tokens == 0


def test_the_setting_is_checked_and_a_recipe_with_it_runs_on_vllm_too():
    with pytest.raises(ConfigError, match="prefix_cache_tokens"):
        EngineConfig(prefix_cache_tokens=-1).validate()
    EngineConfig(backend="vllm", prefix_cache_tokens=1024).validate()  # vLLM's own prefix caching serves it
