"""`gcore-rl train` with a vision-language policy, as a user runs it: two controllers (FSDP2 over two
processes), each drawing and encoding only its own shard's images; the engine's and the trainer's
log-probs agree, and the exported policy reloads with its image processor."""

from __future__ import annotations

import json

import pytest
from cli_helpers import REPO, SHORT, gcore_rl

from gcore_rl.data.prompts import policy_prompt_encoder
from gcore_rl.models.loading import load_causal_lm, load_tokenizer
from gcore_rl.records import VisionPrompt


@pytest.mark.slow
def test_two_controllers_train_a_vision_policy_and_export_it(tmp_path):
    made = gcore_rl("init-tiny", "vl", "arch=qwen2_vl", "hidden_size=32", "num_layers=2", "intermediate_size=64",
                    "vision.image_size=16", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    run = gcore_rl("train", REPO / "recipes" / "grpo_vision_shapes.yaml", "model.path=vl", "run.output_dir=out",
                   "run.steps=2", "run.eval_every=2", "data.eval_prompts=16", "data.num_prompts=64",
                   "data.task_options.size=16", "run.stop_at_eval_accuracy=0", "runtime.controllers=2", *SHORT,
                   cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2
    # fp32 on CPU: the trainer's recomputed log-probs of the sampled tokens equal the engine's
    assert max(m["rollout/logprob_gap_max"] for m in metrics) < 1e-4
    final = tmp_path / "out" / "final"
    assert (final / "preprocessor_config.json").is_file()
    tokenizer = load_tokenizer(final)
    prompt = policy_prompt_encoder(str(final), tokenizer)({"prompt": "<image>count?", "images": [_black(16)]})
    assert isinstance(prompt, VisionPrompt)
    assert load_causal_lm(final).config.model_type == "qwen2_vl"


def _black(size: int):
    from PIL import Image

    return Image.new("RGB", (size, size))
