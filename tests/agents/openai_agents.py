"""Agents written against the `openai` client, as users write them, for the tests of `agent_loop`."""

from __future__ import annotations

import openai

from gcore_rl.agents.agent_loop import openai_client


def _client(base_url: str) -> openai.OpenAI:
    return openai_client(base_url, max_retries=0, timeout=60)


def ask_twice(base_url: str, model: str, episode: dict) -> float:
    """Asks the question, then asks "again?" after the reply; rewarded 1 when the second reply has more characters
    than the first (anything the policy can learn), else 0."""
    client = _client(base_url)
    messages = [{"role": "user", "content": episode.get("question", "hi")}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=6)
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=episode.get("max_tokens", 8))
    return float(len(second.choices[0].message.content) > len(first.choices[0].message.content))


def rewrites_history(base_url: str, model: str, episode: dict) -> None:
    """Asks, then asks again with its first reply rewritten: the second request starts a new segment."""
    client = _client(base_url)
    first = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "a"}])
    client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": "a"}, {"role": "assistant", "content": first.choices[0].message.content + "!"},
        {"role": "user", "content": "b"}])


def wrong_model(base_url: str, model: str, episode: dict) -> None:
    _client(base_url).chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "a"}])


def raises(base_url: str, model: str, episode: dict) -> None:
    raise RuntimeError("the agent's own bug")
