"""Tool-using rollouts: reading calls, running tools in a pool with a time limit, rendering their answers by
delta through the chat template, and the trajectories `tool_turns` makes from an engine's turns."""

from __future__ import annotations

import pytest
from scripted_engine import ScriptedEngine

from gcore_rl.agents import tool_turns as tool_turns_module
from gcore_rl.agents.parsers import CallError, ToolCall, parse_hermes
from gcore_rl.agents.template import TurnRenderer
from gcore_rl.agents.tool_turns import tool_turns
from gcore_rl.agents.tools import ToolSet
from gcore_rl.errors import ConfigError
from gcore_rl.records import Completion, build_token_batch
from gcore_rl.rollout.functions import RolloutRequest, checked_rollout
from gcore_rl.rollout.sampling import SamplingConfig


@pytest.fixture(autouse=True)
def _stop_tool_pools():
    """`tool_turns` keeps one tool pool per tool set in this process (a device worker closes them when it closes);
    here each test closes them, so no pool worker outlives it (tests/rewards/test_reward_pool.py counts children)."""
    yield
    tool_turns_module.close()


MUL = "calc_tools:mul"
CALL = '<tool_call>{"name": "mul", "arguments": {"a": 3, "b": 4}}</tool_call>'


def test_hermes_calls_are_read_in_order_and_bad_ones_are_errors():
    text = (f'I will call. {CALL} and <tool_call>{{"name": "mul", "arguments": {{"a": 1, "b": 2}}}}</tool_call>'
            '<tool_call>{"name": </tool_call><tool_call>["mul"]</tool_call><tool_call>{"name": "x", "arguments": 3}</tool_call>')
    calls = parse_hermes(text)
    assert calls[:2] == [ToolCall("mul", {"a": 3, "b": 4}), ToolCall("mul", {"a": 1, "b": 2})]
    assert [type(c) for c in calls[2:]] == [CallError] * 3
    assert "not JSON" in calls[2].reason and '"name"' in calls[3].reason and '"arguments"' in calls[4].reason
    assert parse_hermes("12") == []


def test_tools_run_in_a_pool_and_every_failure_is_an_answer_for_the_model():
    tools = ToolSet([MUL, "calc_tools:boom", "calc_tools:slow", "calc_tools:number"], timeout_s=1.0)
    try:
        assert [s["function"]["name"] for s in tools.schemas] == ["mul", "boom", "slow", "number"]
        results = tools.run([ToolCall("mul", {"a": 6, "b": 7}), ToolCall("boom", {"x": 1}), ToolCall("slow", {"x": 1}),
                             ToolCall("number", {"x": 5}), ToolCall("div", {}), CallError("{", "the call is not JSON"),
                             ToolCall("mul", {"a": 1})])
    finally:
        tools.close()
    assert results[0].text == "42" and not results[0].error
    assert [r.error for r in results[1:]] == [True] * 6
    assert "raised ValueError: no 1" in results[1].text and "ran past its 1 s" in results[2].text
    assert "returned int" in results[3].text and "no tool 'div'" in results[4].text and "not JSON" in results[5].text
    assert "TypeError" in results[6].text  # a missing argument is the tool raising


def test_a_tool_that_cannot_be_described_or_imported_is_a_config_error():
    with pytest.raises(ConfigError, match="rollout.options.tools.0.*type hint"):
        ToolSet(["calc_tools:undocumented"], timeout_s=1.0)
    with pytest.raises(ConfigError, match="rollout.options.tools.1.*cannot import"):
        ToolSet([MUL, "calc_tools_missing:mul"], timeout_s=1.0)


def test_tool_answers_are_rendered_by_delta_after_the_turns_end(tool_tokenizer):
    renderer = TurnRenderer(tool_tokenizer)
    ids = renderer.tool_ids(["12"])
    assert tool_tokenizer.decode(ids, skip_special_tokens=False) == "<tool_response>12</tool_response>\nA:"


@pytest.mark.parametrize("template, words", [
    ("{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}{% if m['role'] == 'assistant' and loop.last %}"
     "{{ eos_token }}{% endif %}{% endfor %}", "rewrites earlier turns"),
    ("{% for m in messages %}{% if m['role'] != 'tool' %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}",
     "renders no message of role 'tool'"),
    ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "does not end an assistant turn"),
])
def test_templates_that_cannot_carry_tool_turns_are_refused_by_name(tool_tokenizer, template, words):
    tool_tokenizer.chat_template = template
    with pytest.raises(ConfigError, match=words):
        TurnRenderer(tool_tokenizer)


def _rollout(tokenizer, engine, max_new_tokens=120, **options) -> list[Completion]:
    prompts = [tokenizer.encode("U:3*4?\nA:", add_special_tokens=False)] * 2
    params = SamplingConfig(n=2, max_new_tokens=max_new_tokens)
    request = RolloutRequest(engine, prompts, params, seed=0, tokenizer=tokenizer, options={"tools": [MUL], **options})
    done = [c for chunk in checked_rollout(tool_turns(request), 2, 2, "tool_turns") for c in chunk]
    return sorted(done, key=lambda c: (c.prompt_index, c.sample_index))


def test_a_call_its_answer_and_the_reply_make_one_trajectory_with_the_answer_masked(tool_tokenizer):
    engine = ScriptedEngine(tool_tokenizer, [CALL + "<eos>", "12<eos>"])
    completions = _rollout(tool_tokenizer, engine)
    call, reply = engine.turns
    answer = TurnRenderer(tool_tokenizer).tool_ids(["12"])
    for c in completions:
        assert c.token_ids == call + answer + reply  # ids in and out: nothing re-tokenised
        assert c.loss_mask == [1] * len(call) + [0] * len(answer) + [1] * len(reply)
        assert c.logprobs == [-0.5] * len(call) + [0.0] * len(answer) + [-0.5] * len(reply)
        assert c.rollout_stats == {"turns": 2.0, "tool_calls": 1.0, "tool_errors": 0.0,
                                   "tool_seconds": pytest.approx(c.rollout_stats["tool_seconds"])}
        assert c.finish_reason == "stop"
    assert [list(r.prompt) for r in engine.requests] == [completions[0].prompt_ids + call + answer] * 4
    batch = build_token_batch(completions, tool_tokenizer.pad_token_id)
    assert int(batch.response_mask.sum()) == 4 * (len(call) + len(reply))


def test_the_policys_own_ids_are_kept_where_decode_and_encode_disagree(tool_tokenizer):
    """The policy spelled `<tool_call>` character by character: re-tokenising its decoded turn would give the
    one special token instead, and the trainer would score ids the engine never sampled. The trajectory keeps
    the sampled ids, and the call is still read."""
    call = CALL.replace("<tool_call>", "").replace("</tool_call>", "")
    spelled = [tool_tokenizer.convert_tokens_to_ids(ch) for ch in "<tool_call>"]
    engine = ScriptedEngine(tool_tokenizer, ["x<eos>", "12<eos>"])
    engine.turns[0] = spelled + tool_tokenizer.encode(call + "</tool_call><eos>", add_special_tokens=False)
    [first, *_] = _rollout(tool_tokenizer, engine)
    turn = engine.turns[0]
    assert first.token_ids[:len(turn)] == turn and first.rollout_stats["tool_calls"] == 1.0
    assert tool_tokenizer.encode(tool_tokenizer.decode(turn), add_special_tokens=False) != turn


def test_failed_calls_are_answered_or_end_the_trajectory_as_configured(tool_tokenizer):
    unknown = CALL.replace('"mul"', '"div"') + "<eos>"
    answered = _rollout(tool_tokenizer, ScriptedEngine(tool_tokenizer, [unknown, "12<eos>"]))
    assert all(c.rollout_stats["tool_errors"] == 1.0 and c.rollout_stats["turns"] == 2.0 for c in answered)
    text = tool_tokenizer.decode(answered[0].token_ids, skip_special_tokens=False)
    assert "error: there is no tool 'div'; the tools are mul" in text
    ended = _rollout(tool_tokenizer, ScriptedEngine(tool_tokenizer, [unknown, "12<eos>"]), on_tool_error="end")
    assert all(c.rollout_stats["turns"] == 1.0 and 0 not in c.loss_mask for c in ended)


def test_turns_and_tokens_are_bounded(tool_tokenizer):
    looping = ScriptedEngine(tool_tokenizer, [CALL + "<eos>"] * 3)
    capped = _rollout(tool_tokenizer, looping, max_new_tokens=400, max_turns=3)
    assert all(c.rollout_stats["turns"] == 3.0 and c.rollout_stats["tool_calls"] == 2.0 for c in capped)
    short = _rollout(tool_tokenizer, ScriptedEngine(tool_tokenizer, [CALL + "<eos>", "12<eos>"]), max_new_tokens=50)
    assert all(c.finish_reason == "length" and c.rollout_stats["turns"] == 1.0 for c in short)
    assert all(len(c.token_ids) <= 50 for c in short)  # the call (49 tokens) fits, its answer would not


def test_options_are_checked_with_their_dotted_keys(tool_tokenizer):
    engine = ScriptedEngine(tool_tokenizer, [CALL + "<eos>"])
    with pytest.raises(ConfigError, match="rollout.options.parser.*neither"):
        _rollout(tool_tokenizer, engine, parser="xml")
    with pytest.raises(ConfigError, match="rollout.options.parser.*cannot import"):
        _rollout(tool_tokenizer, engine, parser="no_such_parsers:parse")
    with pytest.raises(ConfigError, match="rollout.options.max_turns"):
        _rollout(tool_tokenizer, engine, max_turns=0)


def test_the_builtin_calculator_does_arithmetic_and_nothing_else():
    from gcore_rl.agents.builtin_tools import calculator

    assert calculator("(12 + 7) * 3") == "57" and calculator("7 / 2") == "3.5" and calculator("-4 // 3") == "-2"
    for bad in ("__import__('os')", "2 ** 10", "x + 1", "10 ** 10 ** 10"):
        with pytest.raises((ValueError, SyntaxError)):
            calculator(bad)


def test_a_grpo_step_runs_with_tool_turns_and_records_their_counts(tmp_path):
    """The rollout function in the loop: options checked by the driver, the template from data.chat_template on
    the device worker, counts in the step's record (a random policy calls no tool: one turn each)."""
    import json
    from pathlib import Path

    from tool_template import TOOL_TEMPLATE

    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.runtime.driver import run_job

    model = write_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "grpo_addition.yaml"
    cfg = load_config(JobConfig, recipe, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=1", "run.prompts_per_step=4",
        "run.eval_every=0", "run.stop_at_eval_accuracy=0", "data.eval_prompts=4", "run.progress=false",
        "runtime.threads_per_process=1", "rollout.function=gcore_rl.agents.tool_turns:tool_turns",
        f"rollout.options={{tools: [{MUL}], max_turns: 2}}", f"data.chat_template={json.dumps(TOOL_TEMPLATE)}"])
    run_job(cfg)
    [record] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout/turns"] == 1.0 and record["rollout/tool_calls"] == 0.0 and record["rollout/tool_errors"] == 0.0


def test_chat_prompts_are_rendered_with_the_tools_the_function_offers(tool_tokenizer):
    from gcore_rl.data.chat import ChatRenderer
    from gcore_rl.rollout.functions import RolloutConfig, prompt_tools

    cfg = RolloutConfig(function="gcore_rl.agents.tool_turns:tool_turns", options={"tools": [MUL]})
    schemas = prompt_tools(cfg)
    assert [s["function"]["name"] for s in schemas] == ["mul"]
    renderer = ChatRenderer(tool_tokenizer, tool_tokenizer.chat_template, schemas)
    assert renderer.prompt([{"role": "user", "content": "3*4?"}], "row 0") == "T:mul;\nU:3*4?\nA:"
    assert prompt_tools(RolloutConfig()) == []  # single-turn offers none


def test_a_sampled_trajectory_is_shown_turn_by_turn_with_the_tool_answers_marked(tool_tokenizer, tmp_path):
    import json

    from gcore_rl.algos.dynamic_sampling import Group, StepBatch
    from gcore_rl.controller.program import GroupPayload
    from gcore_rl.controller.samples import SampleLog, turn_segments
    from gcore_rl.report.run_report import write_run_report

    [trajectory, *_] = _rollout(tool_tokenizer, ScriptedEngine(tool_tokenizer, [CALL + "<eos>", "12<eos>"]))
    segments = turn_segments(tool_tokenizer, trajectory)
    assert [s["inserted"] for s in segments] == [False, True, False]
    assert segments[1]["text"] == "<tool_response>12</tool_response>\nA:" and segments[2]["text"] == "12<eos>"
    log = SampleLog(tmp_path / "samples.jsonl", tool_tokenizer, 1)
    log.write(1, StepBatch([Group(0, (1.0,), GroupPayload(0, [trajectory]))], [True], 1, 1, 1.0))
    log.close()
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 1.0}) + "\n")
    html = write_run_report(tmp_path).read_text()
    assert "A trajectory turn by turn" in html and "inserted (tool, loss mask 0)" in html
    assert "&lt;tool_response&gt;12&lt;/tool_response&gt;" in html


def test_a_tool_use_trace_trains_its_assistant_turns_laid_out_as_a_rollout_lays_them_out(tool_tokenizer):
    """SFT with train_turns=all: the call and the final reply carry the loss, the tool's answer (with the next
    generation prompt) is in the sequence but masked, and it is exactly the ids `tool_turns` would insert."""
    from gcore_rl.data.chat import ChatRenderer
    from gcore_rl.data.prompts import PromptEncoder
    from gcore_rl.training.sft import sft_batch, sft_examples

    messages = [{"role": "user", "content": "3*4?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "content": "12"}, {"role": "assistant", "content": "12"}]
    prompt, segments = ChatRenderer(tool_tokenizer, tool_tokenizer.chat_template).turns(messages, "row 0")
    assert prompt == "U:3*4?\nA:"
    assert segments == [(CALL + "<eos>", True), ("<tool_response>12</tool_response>\nA:", False), ("12<eos>", True)]
    [example] = sft_examples([{"messages": messages}], PromptEncoder(tool_tokenizer), "rows", train_turns="all")
    inserted = TurnRenderer(tool_tokenizer).tool_ids(["12"])
    call = tool_tokenizer.encode(CALL + "<eos>", add_special_tokens=False)
    assert example.target_ids == call + inserted + tool_tokenizer.encode("12<eos>", add_special_tokens=False)
    assert example.target_mask == [1] * len(call) + [0] * len(inserted) + [1] * 3
    _, _, loss_mask = sft_batch([example], tool_tokenizer.pad_token_id)
    assert loss_mask.sum() == len(call) + 3
    [final_only] = sft_examples([{"messages": messages}], PromptEncoder(tool_tokenizer), "rows")
    assert final_only.target_mask is None and tool_tokenizer.decode(final_only.target_ids) == "12<eos>"
