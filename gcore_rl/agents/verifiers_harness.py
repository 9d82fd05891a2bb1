"""A verifiers (v1) harness that runs its chat loop in this process (`gcore_rl.agents.verifiers_env.in_process_agent`
registers it under a plain module name, as verifiers looks harnesses up): verifiers' own harnesses install `uv` and their scripts' packages on first
use, which an offline machine cannot do. Every model call goes to the rollout's interception endpoint with its
secret, as the v1 harness contract asks; verifiers forwards it to the client's base URL (gcore-rl's chat endpoint,
`gcore_rl.agents.verifiers_env`). The loop asks, appends the reply, and stops at a reply without tool calls or
when the interception refuses a request (the environment stopped the rollout); a reply's tool calls are answered
by the task's tools when the environment offers them through MCP (not yet: the loop stops there).

Import it only where verifiers is installed (`pip install 'gcore-rl[agents]'`).
"""

from __future__ import annotations

from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

__all__ = ["InProcessChat"]


class InProcessChat(vf.Harness[vf.HarnessConfig]):
    """Plain chat turns, in this process, through the interception endpoint."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a multi-turn environment resumes the loop on the transcript so far
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str, mcp_urls: Any,
                     data: Any) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:  # a resumed segment: the conversation so far
            messages += [message_to_wire(m) for m in prompt]
        async with httpx.AsyncClient(timeout=None, trust_env=False) as http:
            while True:
                answer = await http.post(f"{endpoint}/chat/completions", json={"model": ctx.model, "messages": messages},
                                         headers={"Authorization": f"Bearer {secret}"})
                if answer.status_code != 200:  # the environment ended the rollout, or the request was refused
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=answer.text)
                message = answer.json()["choices"][0]["message"]
                messages.append(message)
                if not message.get("tool_calls"):
                    return vf.ProgramResult(exit_code=0, stdout=message.get("content") or "", stderr="")
                return vf.ProgramResult(exit_code=1, stdout="", stderr="tool calls are not answered by this harness")
