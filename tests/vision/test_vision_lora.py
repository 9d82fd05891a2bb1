"""LoRA on a vision-language policy: merged weights carry the base model's names (vision tower included) and
compute what the adapted model computes; naming the language model's modules leaves the tower untouched."""

from __future__ import annotations

import torch

from gcore_rl.models.loading import load_causal_lm
from gcore_rl.models.lora import LoraSettings, apply_lora, merged_weights

LANGUAGE = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_merged_weights_of_a_vision_policy_are_its_base_names_and_its_function(vlm_dir):
    torch.manual_seed(0)
    adapted = apply_lora(load_causal_lm(vlm_dir), LoraSettings(enabled=True, rank=4, alpha=8.0))
    with torch.no_grad():  # B = 0 at the start: move it, so the merge is not vacuous
        for name, param in adapted.named_parameters():
            if ".lora_B." in name:
                param.normal_(0.0, 0.05)
    assert any("visual" in name for name, p in adapted.named_parameters() if p.requires_grad)
    merged = dict(merged_weights(adapted, lambda tensor: tensor))
    plain = load_causal_lm(vlm_dir)
    assert set(merged) == {name for name, _ in plain.named_parameters()}
    plain.load_state_dict(merged, strict=False)
    ids = torch.tensor([[5, 9, 14, 3, 22, 7, 11, 30]])
    with torch.no_grad():
        expected = adapted.eval()(input_ids=ids).logits
        assert float((plain.eval()(input_ids=ids).logits - expected).abs().max()) < 1e-5
        assert float((load_causal_lm(vlm_dir).eval()(input_ids=ids).logits - expected).abs().max()) > 1e-4


def test_the_language_modules_leave_the_vision_tower_alone(vlm_dir):
    adapted = apply_lora(load_causal_lm(vlm_dir), LoraSettings(enabled=True, rank=4, target_modules=LANGUAGE))
    trained = [name for name, p in adapted.named_parameters() if p.requires_grad]
    assert trained and not any("visual" in name for name in trained)
