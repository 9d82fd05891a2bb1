"""A vision-language policy (tiny Qwen2-VL) in the engine and the trainer: image prompts are prefilled with
their pixels and M-RoPE positions, and the trainer's recomputed log-probs (padded and packed) equal the
engine's; the image changes what the model says, so the pixels really reach it."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.models.loading import load_causal_lm, load_tokenizer
from gcore_rl.models.vision import VisionProcessor, rope_positions
from gcore_rl.records import VisionPrompt, build_token_batch
from gcore_rl.rollout.engine import GenerationEngine
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.training.logprobs import first_response_column, token_logprobs
from gcore_rl.training.packing import packed_token_logprobs
from tests.rollout.host_reads import watch_static_steps


@pytest.fixture
def vlm(vlm_dir):
    tokenizer = load_tokenizer(vlm_dir)
    return load_causal_lm(vlm_dir).eval(), tokenizer, VisionProcessor.from_model_dir(vlm_dir, tokenizer)


def _prompts(tokenizer, processor, random_image):
    return [processor.encode("U:<image>colour?\nA:", [random_image(0)]),
            processor.encode("U:<image> vs <image>: which?\nA:", [random_image(1), random_image(2, size=24)]),
            tokenizer.encode("U:no image here\nA:", add_special_tokens=False),
            processor.encode("<image>", [random_image(3)])]


def test_vision_prompt_expands_each_placeholder_to_its_image_tokens(vlm, random_image):
    model, tokenizer, processor = vlm
    prompt = processor.encode("U:<image>colour?", [random_image(0)])
    # a 16 px image: 4 × 4 patches of 4 px, merged 2 × 2 → 4 image tokens between the slot markers
    assert prompt.images.grid_thw.tolist() == [[1, 4, 4]]
    ids = list(prompt)
    assert ids.count(processor.image_token_id) == 4
    assert ids[2] == processor.start_id and ids[7] == processor.end_id
    positions = rope_positions(model, torch.tensor(ids), prompt.images)
    # text "U:" at 0, 1; the start marker at 2; the 2 × 2 grid at (3, 3+h, 3+w); the end marker after the grid's extent
    assert positions[:, 3:7].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]
    assert positions[:, 7].tolist() == [5, 5, 5]
    with pytest.raises(ValueError, match="2 <image> placeholders but the row has 1 image;"):
        processor.encode("<image><image>", [random_image(0)])


@pytest.mark.parametrize("sizes", [(16,), (8,), (24, 16), (40,)])
def test_the_token_count_from_image_sizes_equals_the_encoded_length(vlm, random_image, sizes):
    """Measuring a prompt against the context (before step 1) reads only the images' sizes; it must count
    what encoding makes, also for images the processor scales up or down."""
    _, _, processor = vlm
    images = [random_image(i, size=size) for i, size in enumerate(sizes)]
    text = "U:" + " and ".join("<image>" for _ in sizes) + " count?"
    assert processor.token_count(text, images) == len(processor.encode(text, images))


@pytest.mark.parametrize("slots,static", [(64, False), (2, False), (3, True)])
def test_engine_logprobs_match_trainer_with_images(vlm, slots, static, random_image):
    """Parity (< 1e-4, fp32) with every prompt in one batch and with 2 slots refilled continuously (rows
    admitted at different steps keep their own M-RoPE offsets), also at the static shapes CUDA graphs replay;
    padded and packed recomputation alike."""
    model, tokenizer, processor = vlm
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=slots,
                              static_shapes=static)
    params = SamplingConfig(n=3, max_new_tokens=10, temperature=1.0, ignore_eos=True)
    prompts = _prompts(tokenizer, processor, random_image)
    completions = engine.generate(prompts, params, seed=0)
    for c in completions:
        c.prompt_ids = prompts[c.prompt_index]
    batch = build_token_batch(completions, tokenizer.pad_token_id)
    assert batch.images is not None and batch.images[6] is None and batch.images[0] is prompts[0].images
    with torch.no_grad():
        # the prompt's image tokens are never scored: the policy may not generate them (their log-prob is −inf)
        first = first_response_column(batch.response_mask)
        padded, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, first_scored=first, images=batch.images)
        packed, _ = packed_token_logprobs(model, batch.input_ids, batch.attention_mask, first_scored=first,
                                          images=batch.images)
    for recomputed in (padded, packed):
        gap = ((recomputed - batch.rollout_logprobs).abs() * batch.response_mask).max()
        assert gap < 1e-4


def test_a_static_decode_step_of_a_vision_policy_reads_nothing_back(vlm, random_image, monkeypatch):
    """Issue 49: the M-RoPE decode step at static shapes (positions from the rows' host-free offsets) has no host
    read and no upload of host data, so a CUDA graph can capture it as it does a text policy's."""
    model, tokenizer, processor = vlm
    steps = watch_static_steps(monkeypatch)
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, max_num_seqs=4,
                              static_shapes=True)
    engine.generate(_prompts(tokenizer, processor, random_image), SamplingConfig(n=2, max_new_tokens=5,
                                                                                  ignore_eos=True), seed=0)
    assert len(steps) >= 4 and all(not s.reads and not s.uploads for s in steps), steps


def test_chunked_prefill_chunks_text_admissions_and_prefills_image_ones_whole(vlm, random_image):
    """`prefill_chunk_tokens` on a vision-language policy: an admission with images takes one forward (the
    vision tower's features replace the image tokens of the whole input); one of text prompts is chunked,
    with its M-RoPE positions sliced like the tokens. Both give the unchunked engine's completions."""
    model, tokenizer, processor = vlm
    params = SamplingConfig(n=2, max_new_tokens=6, temperature=1.0, ignore_eos=True)
    with_images = _prompts(tokenizer, processor, random_image)
    text = [tokenizer.encode(t, add_special_tokens=False) for t in ("U:hi\nA:", "U:no image here\nA:")]
    for prompts, chunked_forwards in ((with_images, 1), (text, -(-len(text[1]) // 3))):
        runs = []
        for chunk in (0, 3):
            engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id, prefill_chunk_tokens=chunk)
            runs.append((engine.generate(prompts, params, seed=4), engine.last_stats.prefills))
        (whole, whole_forwards), (chunked, forwards) = runs
        assert [c.token_ids for c in chunked] == [c.token_ids for c in whole]
        for c, w in zip(chunked, whole, strict=True):
            assert c.logprobs == pytest.approx(w.logprobs, abs=1e-5, rel=0)
        assert (whole_forwards, forwards) == (1, chunked_forwards)


def test_the_image_changes_the_completion(vlm, random_image):
    """Same text, other pixels: the greedy log-probs differ (the vision tower's features reach the decoder)."""
    model, tokenizer, processor = vlm
    engine = GenerationEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    greedy = SamplingConfig(n=1, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    first, second = engine.generate([processor.encode("<image>?", [random_image(s)]) for s in (5, 6)], greedy, seed=0)
    assert first.logprobs != second.logprobs


def test_a_text_model_refuses_image_prompts(tmp_path):
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.records import ImageInputs

    path = write_tiny_model(tmp_path / "text", TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64))
    tokenizer = load_tokenizer(path)
    engine = GenerationEngine(load_causal_lm(path), tokenizer.eos_token_id, tokenizer.pad_token_id)
    prompt = VisionPrompt([5, 6, 7], ImageInputs(torch.zeros(4, 96), torch.tensor([[1, 2, 2]])))
    with pytest.raises(ValueError, match="text-only"):
        engine.generate([prompt], SamplingConfig(n=1, max_new_tokens=2), seed=0)
