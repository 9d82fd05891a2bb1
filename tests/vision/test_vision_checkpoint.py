"""A checkpointed group of a vision-language run keeps token ids only (JSON); on resume its row gives the
prompt's images back, encoded exactly as rollout encoded them."""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import torch

from gcore_rl.algos.dynamic_sampling import WaveSampler
from gcore_rl.controller.checkpointing import decode_rollout, encode_payload
from gcore_rl.controller.program import GroupPayload
from gcore_rl.controller.shard import ControllerShard
from gcore_rl.controller.token_samples import TokenSamples
from gcore_rl.data.prompts import policy_prompt_encoder
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.models.loading import load_tokenizer
from gcore_rl.records import Completion, VisionPrompt


def test_a_saved_group_gets_its_images_back_from_its_row(vlm_dir, random_image):
    prompts = policy_prompt_encoder(str(vlm_dir), load_tokenizer(vlm_dir))
    rows = [{"prompt": "<image>count?", "answer": str(i), "images": [random_image(i)]} for i in range(3)]
    shard = ControllerShard(rows=rows, row_ids=[1, 3, 5], eval_rows=[], length_stats={},
                            sampler=ShardedPromptSampler(3, seed=0), waves=WaveSampler.__new__(WaveSampler))
    encoded = prompts(rows[2])
    payload = GroupPayload(row_id=5, completions=[Completion(0, encoded, [7, 8], [-0.5, -0.25], "stop", sample_index=s)
                                                  for s in range(2)])
    saved = json.loads(json.dumps(encode_payload(payload)))  # what the checkpoint file holds
    assert saved["completions"][0]["prompt_ids"] == list(encoded)  # token ids, no pixels
    decode = functools.partial(TokenSamples().decode_payload, tensors={}, shard=shard, ctx=SimpleNamespace(prompts=prompts))
    restored = decode(saved)
    for completion in restored.completions:
        assert isinstance(completion.prompt_ids, VisionPrompt) and list(completion.prompt_ids) == list(encoded)
        assert torch.equal(completion.prompt_ids.images.pixel_values, encoded.images.pixel_values)
    rollout = {"groups": [{"key": 0, "rewards": [1.0, 0.0], "payload": saved}], "mask": [True], "waves": 1,
               "generated_groups": 1, "valid_fraction_observed": 1.0, "stats": {}, "row_ids": [5]}
    ahead = decode_rollout(rollout, decode)  # a rollout made ahead (bounded staleness) gets them too
    assert isinstance(ahead.groups.groups[0].payload.completions[0].prompt_ids, VisionPrompt)
