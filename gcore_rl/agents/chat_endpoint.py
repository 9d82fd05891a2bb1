"""An OpenAI-compatible chat-completions endpoint in front of a rollout engine, recording what it generates.

Agent code written against an OpenAI client trains unchanged: `agent_loop` gives each sample's agent a base URL
of its own session (`http://127.0.0.1:PORT/s/<session>/v1`) and the agent calls `chat.completions.create` as it
would call any server. The endpoint renders the request's messages with the policy's chat template, generates
with the engine, and records per session the token ids and log-probs exactly as sampled (the design of AReaL's
proxy and OpenRLHF's agent server):

- A request whose messages extend the session's recorded conversation (every earlier message as recorded, the
  assistant replies as this endpoint returned them) continues the recorded trajectory: only the new messages are
  rendered (by delta, `TurnRenderer`) and inserted (loss mask 0), and the policy's earlier ids are kept as
  sampled, never re-tokenised.
- A request whose history diverges (an agent that rewrote or dropped earlier messages) starts a new segment
  from its fully rendered messages. A sample trains on its session's last segment; earlier ones are counted.

Sampling follows the job's `sampling` settings (the temperature the trainer's log-probs assume); a request's
`max_tokens` / `max_completion_tokens` can only lower the token limit, and its other sampling fields are ignored.
`sampling.max_new_tokens` bounds every token of a segment after its first prompt, inserted ones included.
When the request has `tools`, the template renders them and the reply's tool calls (in the format of the
`parser`, Hermes by default) come back as OpenAI `tool_calls`.

Errors are OpenAI error responses, never a dead run: an unknown model name (404, `model_not_found`), a request
over the context or the segment's token budget (400, `context_length_exceeded`), a malformed body (400), an
unknown session (404).

The engine is not called from the server's threads: a request waits in `pending` until the rollout thread
batches every waiting request into one engine call (`serve_pending`), so agents that are thinking, running a
tool or waiting on an environment leave the batch and the others fill it.
"""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from gcore_rl.agents.parsers import ToolCall
from gcore_rl.agents.template import TurnRenderer
from gcore_rl.agents.turns import Trajectory
from gcore_rl.records import Completion
from gcore_rl.rollout.protocol import Continuation


class RequestError(Exception):
    """A request the endpoint answers with an OpenAI error response (`status`, `code`)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class Session:
    """One sample's agent: its segments (the last is the current one) and the conversation recorded for it."""

    prompt_index: int
    sample_index: int
    segments: list[Trajectory] = field(default_factory=list)
    recorded: list[tuple] = field(default_factory=list)  # canonical messages of the current segment
    requests: int = 0

    def trajectory(self) -> Trajectory | None:
        return self.segments[-1] if self.segments else None


@dataclass
class Pending:
    """A generation a server thread waits for: one continuation of `trajectory`."""

    session: Session
    trajectory: Trajectory
    appended: list[int]
    max_new_tokens: int
    done: threading.Event = field(default_factory=threading.Event)
    turn: Completion | None = None
    error: BaseException | None = None


def canonical(message: Mapping[str, Any]) -> tuple:
    """What identifies a message when a request's history is matched against the recorded one: role, text and
    tool calls (name and parsed arguments), whatever else a client adds."""
    content = message.get("content")
    if isinstance(content, list):  # content parts: the text ones
        content = "".join(part.get("text", "") for part in content if isinstance(part, Mapping))
    calls = tuple((c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
                  for c in message.get("tool_calls") or ())
    return (message.get("role"), content or "", calls, message.get("tool_call_id") or "")


def _arguments(value: Any) -> str:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value
    return json.dumps(value, sort_keys=True)


class ChatEndpoint:
    """The endpoint (see the module docstring) on 127.0.0.1 at a free port, serving model name `model`.

    Args:
        tokenizer: the policy's tokenizer with its chat template.
        model: the name requests must give (`model`).
        budget: `sampling.max_new_tokens`: most tokens of a segment after its first prompt.
        context: most tokens of a sequence (the policy's positions).
        parse: reads tool calls from a reply's text (used when a request offers tools).
    """

    def __init__(self, tokenizer: Any, model: str, budget: int, context: int,
                 parse: Callable[[str], list] | None = None):
        self.tokenizer, self.model, self.budget, self.context, self.parse = tokenizer, model, budget, context, parse
        self.renderer = TurnRenderer(tokenizer, role="user")
        self.sessions: dict[str, Session] = {}
        self.pending: queue.Queue[Pending] = queue.Queue()
        self.lock = threading.Lock()
        self._ids = itertools.count()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, name="chat-endpoint", daemon=True)
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def open_session(self, prompt_index: int, sample_index: int) -> tuple[str, Session]:
        """A new session's base URL (OpenAI clients append `/chat/completions`) and the session."""
        key = f"{next(self._ids)}-{prompt_index}-{sample_index}"
        session = Session(prompt_index, sample_index)
        with self.lock:
            self.sessions[key] = session
        return f"http://127.0.0.1:{self.port}/s/{key}/v1", session

    def close_session(self, url: str) -> None:
        with self.lock:
            self.sessions.pop(url.rstrip("/").split("/")[-2], None)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ---- the request path (server threads) ----

    def complete(self, key: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """The chat-completion response to `body` in session `key` (RequestError for what cannot be served)."""
        with self.lock:
            session = self.sessions.get(key)
        if session is None:
            raise RequestError(404, "session_not_found", f"no open session '{key}' (its sample has finished)")
        if body.get("model") != self.model:
            raise RequestError(404, "model_not_found", f"the model '{body.get('model')}' does not exist; this "
                               f"endpoint serves '{self.model}'")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
            raise RequestError(400, "invalid_request_error", "`messages` must be a non-empty list of messages")
        if body.get("stream"):
            raise RequestError(400, "invalid_request_error", "streaming responses are not served; set stream=false")
        if int(body.get("n") or 1) != 1:
            raise RequestError(400, "invalid_request_error", "n must be 1 (each sample is one session)")
        tools = body.get("tools") or None
        trajectory, appended, wanted = self._extend(session, messages, tools)
        room = min(self.budget - len(trajectory.ids) - len(appended),
                   self.context - len(trajectory.prompt_ids) - len(trajectory.ids) - len(appended))
        cap = body.get("max_completion_tokens") or body.get("max_tokens")
        limit = min(room, int(cap)) if cap else room
        if limit < 1:
            raise RequestError(400, "context_length_exceeded", f"the conversation takes {len(trajectory.prompt_ids)} "
                               f"+ {len(trajectory.ids) + len(appended)} tokens, which leaves no room to generate within "
                               f"the {self.context}-token context and the {self.budget}-token budget after the prompt "
                               "(sampling.max_new_tokens)")
        if trajectory is not session.trajectory():
            session.segments.append(trajectory)
        session.recorded = wanted
        job = Pending(session, trajectory, appended, limit)
        self.pending.put(job)
        job.done.wait()
        if job.error is not None:
            raise RequestError(500, "server_error", f"generation failed: {job.error}")
        return self._respond(session, trajectory, job.turn, tools is not None, bool(body.get("logprobs")))

    def _extend(self, session: Session, messages: list[Mapping[str, Any]],
                tools: list | None) -> tuple[Trajectory, list[int], list[tuple]]:
        """The trajectory this request continues, the ids to append and the request's canonical messages: the
        current segment when the messages extend its recorded conversation, else a new segment (not yet added to
        the session) from the fully rendered messages."""
        wanted = [canonical(m) for m in messages]
        current, recorded = session.trajectory(), session.recorded
        if current is not None and len(wanted) > len(recorded) and wanted[:len(recorded)] == recorded:
            appended = self.renderer.message_ids([dict(m) for m in messages[len(recorded):]])
            eos = self.tokenizer.eos_token_id
            if current.last_turn and current.last_turn[-1] != eos:  # a reply cut by its limit: end its turn first
                appended = [eos, *appended]
            return current, appended, wanted
        text = self.tokenizer.apply_chat_template([dict(m) for m in messages], tools=tools, tokenize=False,
                                                  add_generation_prompt=True)
        prompt = self.tokenizer.encode(text, add_special_tokens=False)
        if len(prompt) >= self.context:
            raise RequestError(400, "context_length_exceeded", f"the messages take {len(prompt)} tokens; the "
                               f"model's context is {self.context}")
        return Trajectory(session.prompt_index, session.sample_index, prompt), [], wanted

    def _respond(self, session: Session, trajectory: Trajectory, turn: Completion, with_tools: bool,
                 logprobs: bool) -> dict[str, Any]:
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if with_tools and self.parse is not None:
            calls = [c for c in self.parse(self.tokenizer.decode(turn.token_ids, skip_special_tokens=False))
                     if isinstance(c, ToolCall)]
            if calls:
                message["tool_calls"] = [{"id": f"call_{session.requests}_{i}", "type": "function",
                                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                                         for i, c in enumerate(calls)]
        session.recorded.append(canonical(message))
        session.requests += 1
        choice: dict[str, Any] = {"index": 0, "message": message,
                                  "finish_reason": "tool_calls" if message.get("tool_calls") else
                                  ("stop" if turn.finish_reason == "stop" else "length")}
        if logprobs:
            choice["logprobs"] = {"content": [{"token": self.tokenizer.decode([t]), "logprob": lp, "top_logprobs": []}
                                              for t, lp in zip(turn.token_ids, turn.logprobs, strict=True)]}
        return {"id": f"chatcmpl-{session.prompt_index}-{session.sample_index}-{session.requests}",
                "object": "chat.completion", "created": int(time.time()), "model": self.model, "choices": [choice],
                "usage": {"prompt_tokens": len(trajectory.prompt_ids) + len(trajectory.ids) - len(turn.token_ids),
                          "completion_tokens": len(turn.token_ids),
                          "total_tokens": len(trajectory.prompt_ids) + len(trajectory.ids)}}

    # ---- the engine path (the rollout thread) ----

    def serve_pending(self, generate: Callable[[list[Continuation]], Any], wait_s: float = 0.005) -> int:
        """Run every waiting request in one engine call (`generate(continuations)` yields lists of completions,
        indexed by continuation), answering each as its turn finishes; the requests served (0 when none came
        within `wait_s`)."""
        try:
            batch = [self.pending.get(timeout=wait_s)]
        except queue.Empty:
            return 0
        while True:
            try:
                batch.append(self.pending.get_nowait())
            except queue.Empty:
                break
        for job in batch:
            job.trajectory.insert(job.appended)
        requests = [Continuation(prefix=job.trajectory.prompt_ids, appended=list(job.trajectory.ids),
                                 max_new_tokens=job.max_new_tokens) for job in batch]
        answered: set[int] = set()
        try:
            for chunk in generate(requests):
                for turn in chunk:
                    job = batch[turn.prompt_index]
                    job.trajectory.add_turn(turn)
                    job.turn = turn
                    answered.add(turn.prompt_index)
                    job.done.set()
        except BaseException as exc:
            for index, job in enumerate(batch):
                if index not in answered:
                    job.error = exc
                    job.done.set()
            raise
        return len(batch)


    def fail_pending(self, reason: str) -> None:
        """Answer every waiting request with a server error (`reason`), without generating."""
        while True:
            try:
                job = self.pending.get_nowait()
            except queue.Empty:
                return
            job.error = RuntimeError(reason)
            job.done.set()


class _Server(ThreadingHTTPServer):
    """A thread per connection; a listen queue for every agent of a device connecting at once (socketserver's
    default of 5 resets connections when 32 agents start together)."""

    daemon_threads = True
    request_queue_size = 1024


def _handler(endpoint: ChatEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        disable_nagle_algorithm = True  # a response's headers and body go out at once, not after a delayed ACK

        def log_message(self, format: str, *args: Any) -> None:  # no access log on stderr
            pass

        def _send(self, status: int, payload: Mapping[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, error: RequestError) -> None:
            self._send(error.status, {"error": {"message": str(error), "type": "invalid_request_error"
                                                if error.status < 500 else "server_error", "code": error.code}})

        def _route(self) -> tuple[str, str]:
            parts = self.path.split("?")[0].strip("/").split("/")
            if len(parts) >= 3 and parts[0] == "s" and parts[2] == "v1":
                return parts[1], "/".join(parts[3:])
            return "", ""

        def do_GET(self) -> None:
            key, route = self._route()
            if route == "models":
                self._send(200, {"object": "list", "data": [{"id": endpoint.model, "object": "model",
                                                             "owned_by": "gcore-rl"}]})
            else:
                self._error(RequestError(404, "not_found", f"no route GET {self.path}"))

        def do_POST(self) -> None:
            key, route = self._route()
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if route != "chat/completions":
                self._error(RequestError(404, "not_found", f"no route POST {self.path}; this endpoint serves "
                                         "/v1/chat/completions"))
                return
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise ValueError("the body is not a JSON object")
            except ValueError as exc:
                self._error(RequestError(400, "invalid_request_error", f"the request body is not valid JSON ({exc})"))
                return
            try:
                self._send(200, endpoint.complete(key, body))
            except RequestError as exc:
                self._error(exc)

    return Handler

