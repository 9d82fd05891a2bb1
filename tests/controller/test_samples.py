"""The per-step sample log (samples.jsonl)."""

from __future__ import annotations

import json

from gcore_rl.algos.dynamic_sampling import StepBatch
from gcore_rl.controller.program import decode_completions
from gcore_rl.controller.samples import SampleLog
from gcore_rl.models.tiny import build_char_tokenizer


def test_a_step_whose_batch_kept_no_group_writes_no_sample(tmp_path):
    """Dynamic sampling can end a step with no group (all rewards equal); batch_decode([]) gives [''], not []."""
    tokenizer = build_char_tokenizer()
    assert decode_completions(tokenizer, []) == []
    log = SampleLog(tmp_path / "samples.jsonl", tokenizer, limit=4)
    log.write(1, StepBatch(groups=[], mask=[], waves=1, generated_groups=4, valid_fraction_observed=0.0))
    log.close()
    assert [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()] == []
