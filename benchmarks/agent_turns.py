"""Multi-turn rollouts with a long-tailed tool latency: turn-synchronous (`turn_loop`) against asynchronous
(`agent_loop` + `ChatEndpoint`), side by side in one process (issue 47, part 3).

**Question.** When each turn of an agent waits on a tool whose latency has a long tail, how much rollout time
does the turn-synchronous loop lose (every turn waits for the slowest tool call of the batch) against the
asynchronous agent loop (each sample's agent runs in its own thread against the OpenAI-compatible endpoint,
and whatever requests are waiting are batched into one engine call, so an agent stuck on a slow tool leaves
the batch to the others)?

**Setup.** One tiny random model (`init-tiny`'s llama: hidden 128, 4 layers, the character tokenizer,
`max_positions` 512) served by one builtin engine (`max_num_seqs` = every sample at once), shared by both
arms. `--prompts` prompts (a user question rendered by the chat template), `--n` samples each, `--turns`
assistant turns per sample of exactly `--tokens` tokens each (`ignore_eos`, temperature 1, each engine call
capped at `--tokens` per sequence), and between two turns a "tool" that takes its latency and then answers
with the same short user message (`TurnRenderer(tokenizer, role="user")`, after an `<eos>` that ends the
turn the limit cut: what the endpoint inserts). Both arms therefore generate the same number of policy
tokens and insert the same ids.

- **A, turn-synchronous**: `turn_synchronous` below, a rollout function on `turn_loop`: one engine call per
  turn for every trajectory, then every trajectory's tool sleeps its latency in a thread of its own, the
  turn ending when the slowest returned.
- **B, asynchronous**: `gcore_rl.agents.agent_loop:agent_loop` with `agent` below (`openai` client, one
  `chat.completions.create` per turn with `max_tokens=--tokens`, then its own latency, then the message).

**Latency.** One draw per (prompt, sample, tool call), the calls between turns (`turns - 1` per sample),
seeded (`--latency-seed`), the same in both arms and in every repeat: log-normal with median
`--latency-median` (50 ms) and σ `--latency-sigma` (1.5), capped at `--latency-cap` (2 s). With σ 1.5 about
6 % of the calls take over 0.5 s and 2.3 % over 1 s; the mean is 3x the median. The lower bounds the tools
alone put on each arm's wall time are printed: A waits Σ over turns of the slowest call of the turn, B the
slowest sample's Σ of its own calls.

**Connections.** The endpoint listens with a 1024-connection accept queue and sends each response in one
go (TCP_NODELAY); the agents share one connection pool (`agent_loop.openai_client`). `--own-http-client` has
each agent build its own `openai.OpenAI` instead (each loads the CA bundle, ~40 ms of CPU: 32 agents starting
at once hold the first engine call back by ~1.3 s on 2 cores), `--agent-retries` gives them retries.

**Measured** per arm and repeat, the arms in the order AB, BA, AB, ... after one untimed warm-up of each:
the rollout's wall time (from the first call of the rollout function to its last sample), the policy tokens
generated (checked: prompts x n x turns x tokens), tokens/s, the engine calls and the continuations per call,
the sequences per decode step (`EngineStats.mean_batch`), the seconds inside engine calls, and when samples
finished. Medians over repeats; the ratios B/A are of the medians.

    .venv/bin/python benchmarks/agent_turns.py --json bench-results/agent_turns.json    # ~1 min on 2 cores
    .venv/bin/python benchmarks/agent_turns.py --own-http-client                       # a client per agent
    .venv/bin/python benchmarks/agent_turns.py --repeats 1 --prompts 2 --n 2            # smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # `agent_turns:agent` (arm B's agent) and `engine_vs_generate.machine`

from gcore_rl.agents.template import TurnRenderer  # noqa: E402
from gcore_rl.agents.turns import Trajectory, turn_loop  # noqa: E402
from gcore_rl.records import Completion, EpisodePrompt  # noqa: E402
from gcore_rl.rollout.functions import RolloutRequest, checked_rollout  # noqa: E402
from gcore_rl.rollout.sampling import SamplingConfig  # noqa: E402

AGENT = "agent_turns:agent"
"""Arm B's agent by import path (this file's folder is on sys.path; `load_callable` imports it as a module)."""
MODEL = "policy"
MESSAGE = "tool: ok"
"""What every tool answers (a user message: the tiny chat template renders it `U:tool: ok\\n` then `A:`)."""
QUESTIONS = ("What is 12 + 30?", "Spell the word cat backwards.", "Name a prime above 40.", "How many legs has a spider?",
             "Convert 3 km to metres.", "Which is larger, 2^10 or 10^3?", "Reverse the list 1 2 3.", "What day follows Monday?")


# ---- the workload --------------------------------------------------------------------------------------------

def latency_table(prompts: int, n: int, calls: int, seed: int, median: float, sigma: float, cap: float,
                  ) -> list[list[list[float]]]:
    """Seconds of tool call `c` of sample `k` of prompt `i`, `[i][k][c]`: log-normal (median, σ), capped."""
    rng = random.Random(seed)
    return [[[min(cap, median * math.exp(sigma * rng.gauss(0.0, 1.0))) for _ in range(calls)] for _ in range(n)]
            for _ in range(prompts)]


def make_prompts(tokenizer, prompts: int, n: int, turns: int, tokens: int, latencies, retries: int = 0,
                 own_client: bool = False) -> list[EpisodePrompt]:
    """Each prompt's chat-rendered ids, carrying in `env` what arm B's agent needs (its question, the turns, the
    tokens per turn, the message, the latency table of the prompt's samples, the client's `max_retries` and whether
    each agent builds its own HTTP client); arm A reads the same `env`."""
    rows = []
    for i in range(prompts):
        question = QUESTIONS[i % len(QUESTIONS)] + (f" (#{i})" if i >= len(QUESTIONS) else "")
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        rows.append(EpisodePrompt(tokenizer.encode(text, add_special_tokens=False),
                                  {"question": question, "turns": turns, "tokens": tokens, "message": MESSAGE,
                                   "latencies": latencies[i], "retries": retries,
                                   "own_client": own_client}))
    return rows


class CountingEngine:
    """The shared engine, each call capped at `limit` new tokens per sequence (the per-turn length: `turn_loop`
    itself only knows the whole budget), counting calls, continuations per call and seconds inside calls."""

    def __init__(self, engine, limit: int):
        self.engine, self.limit = engine, limit
        self.batches: list[int] = []
        self.seconds = 0.0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate_stream(self, prompts, params: SamplingConfig, seed: int | None = None, max_new_tokens=None):
        limits = [min(self.limit, m) for m in (max_new_tokens or [params.max_new_tokens] * len(prompts))]
        return self._timed(self.engine.generate_stream(prompts, params, seed, limits), len(prompts) * params.n)

    def continue_stream(self, requests, params: SamplingConfig, seed: int | None = None):
        capped = [replace(r, max_new_tokens=min(self.limit, r.max_new_tokens)) for r in requests]
        return self._timed(self.engine.continue_stream(capped, params, seed), len(requests))

    def _timed(self, stream, rows: int) -> Iterator[list[Completion]]:
        self.batches.append(rows)
        stream = iter(stream)
        while True:
            started = time.perf_counter()
            try:
                chunk = next(stream)
            except StopIteration:
                self.seconds += time.perf_counter() - started
                return
            self.seconds += time.perf_counter() - started
            yield chunk


# ---- arm A: turn-synchronous -------------------------------------------------------------------------------

def turn_synchronous(request: RolloutRequest) -> Iterator[list[Completion]]:
    """Every trajectory's turn in one engine call (`turn_loop`); then each trajectory's tool sleeps its latency in
    a thread of its own and the turn ends when the slowest returned; the message is inserted; the next turn."""
    env = request.prompts[0].env
    message = TurnRenderer(request.tokenizer, role="user").message_ids([{"role": "user", "content": env["message"]}])
    eos, budget = request.tokenizer.eos_token_id, request.params.max_new_tokens
    pool = ThreadPoolExecutor(max_workers=len(request.prompts) * request.params.n, thread_name_prefix="tool")

    def answer(finished: list[Trajectory], last: bool) -> list[Trajectory]:
        if last:
            return []
        waits = [request.prompts[t.prompt_index].env["latencies"][t.sample_index][t.turns - 1] for t in finished]
        list(pool.map(time.sleep, waits))  # the turn waits for its slowest tool
        going = []
        for t in finished:
            inserted = message if t.last_turn and t.last_turn[-1] == eos else [eos, *message]
            if t.fits(inserted, budget):
                t.insert(inserted)
                going.append(t)
        return going

    try:
        yield from turn_loop(request, env["turns"], answer)
    finally:
        pool.shutdown(wait=False)


# ---- arm B: the agent --------------------------------------------------------------------------------------

def agent(base_url: str, model: str, episode: dict) -> None:
    """Asks the question; after each reply but the last, runs its tool (sleeps its latency) and gives back the
    message. Its sample index is read from its session's URL (`.../s/<id>-<prompt>-<sample>/v1`): `agent_loop`
    hands an agent its prompt's episode, not which sample it is."""
    import openai

    from gcore_rl.agents.agent_loop import openai_client

    sample = int(base_url.rstrip("/").split("/")[-2].rsplit("-", 1)[1])
    latencies = episode["latencies"][sample]
    if episode["own_client"]:
        client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=episode["retries"], timeout=300)
    else:
        client = openai_client(base_url, max_retries=episode["retries"], timeout=300)
    messages = [{"role": "user", "content": episode["question"]}]
    try:
        for turn in range(episode["turns"]):
            reply = client.chat.completions.create(model=model, messages=messages, max_tokens=episode["tokens"])
            if turn == episode["turns"] - 1:
                return None
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
            time.sleep(latencies[turn])
            messages.append({"role": "user", "content": episode["message"]})
    finally:
        if episode["own_client"]:
            client.close()
    return None


class RetryCounter(logging.Handler):
    """Counts the openai client's retries (its `Retrying request to ...` log lines)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += record.getMessage().startswith("Retrying request")


RETRIES = RetryCounter()


# ---- running an arm ----------------------------------------------------------------------------------------

def run_arm(arm: str, engine, tokenizer, prompts, args, seed: int, context: int) -> dict:
    """One rollout of arm `arm` ("A" or "B"), timed, its samples checked."""
    from gcore_rl.agents.agent_loop import agent_loop

    counting = CountingEngine(engine, args.tokens)
    params = SamplingConfig(n=args.n, max_new_tokens=args.budget, temperature=1.0, ignore_eos=True)
    function, options = (turn_synchronous, {}) if arm == "A" else (agent_loop, {"agent": AGENT, "model": MODEL})
    request = RolloutRequest(counting, prompts, params, seed=seed, tokenizer=tokenizer, options=options, context=context)
    engine.take_stats()  # reset
    RETRIES.count = 0
    done: list[Completion] = []
    finished_at: list[float] = []
    started = time.perf_counter()
    for chunk in checked_rollout(function(request), len(prompts), args.n, arm):
        finished_at += [time.perf_counter() - started] * len(chunk)
        done += chunk
    wall = time.perf_counter() - started
    stats = engine.take_stats()
    turns = prompts[0].env["turns"]
    policy = sum(sum(c.loss_mask) for c in done)
    bad = [(c.prompt_index, c.sample_index, c.rollout_stats) for c in done
           if sum(c.loss_mask) != turns * args.tokens or c.rollout_stats.get("turns") != turns
           or c.rollout_stats.get("agent_errors", 0) or c.rollout_stats.get("segments", 1) != 1]
    if bad:
        raise RuntimeError(f"arm {arm}: {len(bad)} samples without {turns} turns of {args.tokens} tokens, e.g. {bad[:3]}")
    return {"wall_s": wall, "policy_tokens": policy, "tokens_per_s": policy / wall,
            "inserted_tokens": sum(len(c.loss_mask) - sum(c.loss_mask) for c in done),
            "engine_calls": len(counting.batches), "continuations_per_call": statistics.mean(counting.batches),
            "call_sizes": counting.batches, "engine_s": counting.seconds,
            "seqs_per_decode_step": stats.mean_batch, "decode_steps": stats.decode_steps,
            "prefill_tokens": stats.prefill_tokens, "first_sample_s": min(finished_at),
            "median_sample_s": statistics.median(finished_at), "client_retries": RETRIES.count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt")
    parser.add_argument("--turns", type=int, default=4, help="assistant turns per sample")
    parser.add_argument("--tokens", type=int, default=32, help="tokens of each assistant turn")
    parser.add_argument("--latency-median", type=float, default=0.05, help="median tool latency (s)")
    parser.add_argument("--latency-sigma", type=float, default=1.5, help="log-normal σ of the tool latency")
    parser.add_argument("--latency-cap", type=float, default=2.0, help="longest tool latency (s)")
    parser.add_argument("--latency-seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on 2 busy cores 2 threads made generation up to 30x slower)")
    parser.add_argument("--agent-retries", type=int, default=0,
                        help="max_retries of the agents' openai clients (0: a failed request fails its sample)")
    parser.add_argument("--own-http-client", action="store_true",
                        help="each agent builds its own openai.OpenAI instead of sharing the process's connection pool")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    command = shlex.join(["python", *sys.argv])

    from engine_vs_generate import machine

    from gcore_rl.agents import agent_loop as agent_loop_module
    from gcore_rl.models.loading import load_tokenizer
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.rollout.backends import EngineConfig, EngineSource, build_engine

    torch.set_num_threads(args.threads)
    openai_log = logging.getLogger("openai")
    openai_log.setLevel(logging.INFO)
    openai_log.propagate = False
    openai_log.addHandler(RETRIES)
    model_cfg = TinyModelConfig(max_positions=512)
    model_dir = write_tiny_model(Path(tempfile.mkdtemp(prefix="agent-turns-")) / "model", model_cfg)
    tokenizer = load_tokenizer(model_dir)
    samples = args.prompts * args.n
    engine = build_engine(EngineConfig(backend="builtin", max_num_seqs=samples),
                          EngineSource(str(model_dir), torch.device("cpu"), tokenizer.eos_token_id,
                                       tokenizer.pad_token_id, "float32", threads=args.threads))
    message = TurnRenderer(tokenizer, role="user").message_ids([{"role": "user", "content": MESSAGE}])
    # every token after the prompt: the turns, and before each later turn an <eos> and the message
    args.budget = args.turns * args.tokens + (args.turns - 1) * (len(message) + 1)
    latencies = latency_table(args.prompts, args.n, args.turns - 1, args.latency_seed, args.latency_median,
                              args.latency_sigma, args.latency_cap)
    prompts = make_prompts(tokenizer, args.prompts, args.n, args.turns, args.tokens, latencies, args.agent_retries,
                           args.own_http_client)
    if max(map(len, prompts)) + args.budget > model_cfg.max_positions:
        raise SystemExit(f"a sample takes {max(map(len, prompts)) + args.budget} positions; the model has "
                         f"{model_cfg.max_positions}: fewer --turns or --tokens")
    draws = [x for per_prompt in latencies for per_sample in per_prompt for x in per_sample]
    per_sample = [sum(s) for per_prompt in latencies for s in per_prompt]
    tool_bound_a = sum(max(s[c] for per_prompt in latencies for s in per_prompt) for c in range(args.turns - 1))
    latency = {"distribution": f"lognormal(median {args.latency_median} s, sigma {args.latency_sigma}), capped at "
                               f"{args.latency_cap} s, seed {args.latency_seed}",
               "calls": len(draws), "median_s": statistics.median(draws), "mean_s": statistics.mean(draws),
               "max_s": max(draws), "over_0.5s": sum(x > 0.5 for x in draws), "over_1s": sum(x > 1.0 for x in draws),
               "tool_bound_A_s": tool_bound_a, "tool_bound_B_s": max(per_sample)}

    # warm-up (untimed): both arms, two turns, no latency; the endpoint it starts is kept for the timed runs
    warm_latencies = latency_table(2, 2, 1, 0, 0.0, 0.0, 0.0)
    warm_args = argparse.Namespace(**{**vars(args), "n": 2})
    warm = make_prompts(tokenizer, 2, 2, 2, args.tokens, warm_latencies, args.agent_retries, args.own_http_client)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    try:
        for arm in ("A", "B"):
            run_arm(arm, engine, tokenizer, warm, warm_args, seed=10_000, context=model_cfg.max_positions)
        for repeat in range(args.repeats):
            for arm in ("A", "B") if repeat % 2 == 0 else ("B", "A"):
                row = run_arm(arm, engine, tokenizer, prompts, args, seed=repeat, context=model_cfg.max_positions)
                runs[arm].append(row)
                print(f"  repeat {repeat + 1} arm {arm}: {row['wall_s']:6.2f} s, {row['tokens_per_s']:7.1f} tokens/s, "
                      f"{row['engine_calls']} engine calls ({row['continuations_per_call']:.1f} per call), "
                      f"{row['engine_s']:.2f} s in the engine; continuations per call {row['call_sizes']}", flush=True)
    finally:
        agent_loop_module.close()

    keys = ("wall_s", "policy_tokens", "tokens_per_s", "engine_calls", "continuations_per_call",
            "seqs_per_decode_step", "engine_s", "prefill_tokens", "first_sample_s", "median_sample_s",
            "client_retries")
    medians = {arm: {k: statistics.median(r[k] for r in rows) for k in keys} for arm, rows in runs.items()}
    ratio = {"wall_s": medians["B"]["wall_s"] / medians["A"]["wall_s"],
             "tokens_per_s": medians["B"]["tokens_per_s"] / medians["A"]["tokens_per_s"]}
    facts = machine()
    print(f"\n{command}\n{datetime.now():%Y-%m-%d %H:%M}, {facts['cpu']}, {facts['cores']} CPUs, torch threads "
          f"{args.threads}, load average {', '.join(f'{x:.2f}' for x in facts['load_average'])}; agents' max_retries "
          f"{args.agent_retries}, {'an HTTP client per agent' if args.own_http_client else 'one shared connection pool'}")
    print(f"{args.prompts} prompts x {args.n} samples, {args.turns} turns of {args.tokens} tokens (budget "
          f"{args.budget}), tool latency {latency['distribution']}: {latency['calls']} calls, median "
          f"{latency['median_s'] * 1000:.0f} ms, mean {latency['mean_s'] * 1000:.0f} ms, max {latency['max_s']:.2f} s, "
          f"{latency['over_0.5s']} over 0.5 s, {latency['over_1s']} over 1 s; the tools alone take at least "
          f"{tool_bound_a:.2f} s in A (sum of each turn's slowest), {max(per_sample):.2f} s in B (slowest sample)")
    print("\n| arm | rollout s | policy tokens | tokens/s | engine calls | continuations / call | seqs / decode step "
          "| s in engine | prefill tokens | first / median sample done (s) | client retries |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    names = {"A": "A turn-synchronous", "B": "B asynchronous"}
    for arm, m in medians.items():
        print(f"| {names[arm]} | {m['wall_s']:.2f} | {m['policy_tokens']:.0f} | {m['tokens_per_s']:.1f} | "
              f"{m['engine_calls']:.0f} | {m['continuations_per_call']:.1f} | {m['seqs_per_decode_step']:.1f} | "
              f"{m['engine_s']:.2f} | {m['prefill_tokens']:.0f} | {m['first_sample_s']:.2f} / {m['median_sample_s']:.2f} | "
              f"{m['client_retries']:.0f} |")
    print(f"\nmedians of {args.repeats} repeats; B/A: rollout time {ratio['wall_s']:.2f}, tokens/s "
          f"{ratio['tokens_per_s']:.2f}")
    print("per repeat (s), A: " + ", ".join(f"{r['wall_s']:.2f}" for r in runs["A"])
          + "; B: " + ", ".join(f"{r['wall_s']:.2f}" for r in runs["B"]))
    if args.json:
        out = {"command": command, "date": f"{datetime.now():%Y-%m-%d}", "machine": facts,
               "settings": {k: v for k, v in vars(args).items() if k != "json"}, "latency": latency,
               "latency_table": latencies, "runs": runs, "medians": medians, "ratio_B_over_A": ratio}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
