"""`engine.backend=vllm`: generation by a vLLM server, behind the `RolloutEngine` contract.

Requests go to the server's `/v1/completions` as token ids, never text: each prompt is one request for its
`n` samples with its own seed (derived from the call's seed and the prompt's index, so a call is
reproducible however the server batches), `logprobs=0` and `return_token_ids`, and the server runs with
`--logprobs-mode processed_logprobs`, so each sampled token's log-prob is taken after the temperature —
`log_softmax(logits / T)`, what the trainer recomputes. vLLM takes its processed log-probs after top-k /
top-p as well (renormalised over the tokens kept), where the contract wants them before: every server loads
our worker extension, whose `gcore_untruncated_logprobs` makes its sampler report them before the truncation
(`vllm_ext/gcore_vllm_sampler.py`; where it cannot, truncated sampling warns once). Requests run concurrently
from a thread pool; the server batches them, and each prompt's samples are yielded as its request finishes.

Weights: `load_weights` collects the named tensors of an update (they may come in buckets) and, at the
last one, writes them as one safetensors file to a folder in `/dev/shm` (or the run's folder where
`/dev/shm` is missing or too small) and asks the server to `reload_weights` from it (`/collective_rpc`),
then resets its prefix cache, whose entries were computed with the old weights. With `weight_sync=group` the
tensors are broadcast to the server's workers over a gloo group instead (`vllm_weight_group`), no file
written. `sleep` maps to vLLM's sleep mode where the server has one (CUDA); on a CPU the server keeps its
weights and `sleep` frees nothing. `take_stats` reads the server's metrics (`vllm_metrics`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from gcore_rl.records import Completion, prompt_images
from gcore_rl.rollout.protocol import Continuation, EngineState, continuation_inputs, prompt_major
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.rollout.stats import EngineStats
from gcore_rl.rollout.vllm_metrics import BusyClock, ServerCounts, window_stats
from gcore_rl.rollout.vllm_server import SERVED_NAME, ServerError, VllmServer, free_port
from gcore_rl.rollout.vllm_weight_group import WeightGroup

WEIGHTS_FILE = "model.safetensors"
TIED_EMBEDDING, TIED_HEAD = "model.embed_tokens.weight", "lm_head.weight"
SEED_STRIDE = 1_000_003
"""Request seed = (call seed × SEED_STRIDE + prompt index) mod 2**31: distinct per prompt and call."""
MAX_CONCURRENT = 256
"""Requests in flight at once (the server batches them; more only queue in its scheduler)."""


def request_seed(seed: int | None, prompt_index: int) -> int | None:
    return None if seed is None else (seed * SEED_STRIDE + prompt_index) % 2**31


def completion_request(prompt: Sequence[int], params: SamplingConfig, max_tokens: int, seed: int | None,
                       eos_id: int) -> dict:
    """The `/v1/completions` body of one prompt's `params.n` samples."""
    body = {"model": SERVED_NAME, "prompt": [int(t) for t in prompt], "n": params.n, "max_tokens": max_tokens,
            "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
            "logprobs": 0, "return_token_ids": True, "ignore_eos": params.ignore_eos,
            "stop_token_ids": [] if params.ignore_eos else [eos_id], "skip_special_tokens": False}
    if seed is not None:
        body["seed"] = seed
    return body


def parse_choices(answer: dict, prompt_index: int, prompt: Sequence[int], version: int) -> list[Completion]:
    """The `Completion`s of one `/v1/completions` answer, in sample order."""
    out = []
    for choice in sorted(answer["choices"], key=lambda c: c["index"]):
        tokens = [int(t) for t in choice["token_ids"]]
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if len(logprobs) != len(tokens):
            raise ServerError(f"the vLLM server returned {len(tokens)} tokens but {len(logprobs)} log-probs")
        reason = "length" if choice.get("finish_reason") == "length" else "stop"
        out.append(Completion(prompt_index=prompt_index, prompt_ids=list(prompt), token_ids=tokens, logprobs=logprobs,
                              finish_reason=reason, policy_version=version, sample_index=choice["index"]))
    return out


class VllmEngine:
    """A `RolloutEngine` whose generation runs in a vLLM server (see the module docstring)."""

    def __init__(self, start_server: Callable[[], VllmServer], model_path: str, eos_id: int,
                 scratch: Path | None = None, pause_when_asleep: bool = False,
                 weight_sync: Literal["file", "group"] = "file"):
        """`start_server()` starts a server for the model folder `model_path` (called now, and again to replace a
        server that died: see `_post`). `pause_when_asleep`: `sleep` pauses the server's processes instead of
        asking for vLLM's sleep mode (a CPU server, which has none). `weight_sync`: how updates reach the server
        (a file it reloads, or a broadcast over a process group, `vllm_weight_group`; `VllmConfig.weight_sync`)."""
        self.pause_when_asleep = pause_when_asleep
        self.weight_sync = weight_sync
        self._group: WeightGroup | None = None  # `group`: joined at the first update, again with a new server
        self._last: dict[str, torch.Tensor] | None = None  # `group`: the last update, for a new server and saving
        self._start_server = start_server
        self.server = start_server()
        self.server_restarts = 0
        self._revive_lock = threading.Lock()
        self.model_path = model_path
        self.eos_id = eos_id
        self.policy_version = 0
        self.state: EngineState = "awake"
        self._pending: dict[str, torch.Tensor] = {}
        self._scratch = scratch or weights_scratch()
        self._weights_dir: Path | None = None  # the last update's folder (None: the model folder's weights)
        self._pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT, thread_name_prefix="vllm-request")
        self._busy = BusyClock()
        self._counts = self._read_counts() or ServerCounts()  # the server's counters at the last `take_stats`
        self._longest, self._calls = 0, 0  # the calls since then (`EngineStats.longest`, `calls`)
        self._calls_lock = threading.Lock()
        self._warned_truncation = False
        config = json.loads((Path(model_path) / "config.json").read_text(encoding="utf-8"))
        self._tied = bool(config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings")))

    # ---- generation --------------------------------------------------------------------------

    def generate_stream(self, prompts: Sequence[Sequence[int]], params: SamplingConfig, seed: int | None = None,
                        max_new_tokens: Sequence[int] | None = None) -> Iterator[list[Completion]]:
        limits = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(prompts)
        self.wake()  # a paused server would never answer
        self._check_truncation(params)
        version = self.policy_version
        pending: dict[Future, tuple[int, Sequence[int]]] = {}
        for index, prompt in enumerate(prompts):
            if prompt_images(prompt) is not None:
                raise ValueError("engine.backend=vllm sends prompts as token ids, without images; a prompt with "
                                 "images needs engine.backend=builtin")
            body = completion_request(prompt, params, limits[index], request_seed(seed, index), self.eos_id)
            pending[self._pool.submit(self._timed_post, "/v1/completions", body)] = (index, prompt)
        longest = 0
        try:
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    index, prompt = pending.pop(future)
                    completions = parse_choices(future.result(), index, prompt, version)
                    longest = max([longest, *(len(c.token_ids) for c in completions)])
                    yield completions
        finally:
            for future in pending:
                future.cancel()
        with self._calls_lock:
            self._longest += longest
            self._calls += 1

    def _check_truncation(self, params: SamplingConfig) -> None:
        """Warn once where top-k / top-p sampling would report renormalised log-probs: the server could not be
        made to report them before the truncation (`VllmServer.untruncated_logprobs` says why)."""
        reason = self.server.untruncated_logprobs
        if reason and not self._warned_truncation and (params.top_p < 1 or params.top_k > 0):
            self._warned_truncation = True
            warnings.warn(f"engine.backend=vllm: with sampling top_p={params.top_p:g} / top_k={params.top_k} the "
                          f"server reports each token's log-prob renormalised over the kept tokens, not before the "
                          f"truncation as the trainer recomputes it ({reason}); rollout/logprob_gap_max will show "
                          f"the difference", stacklevel=3)

    def _timed_post(self, path: str, body: dict) -> dict:
        """`_post`, counted in the seconds the server was busy (`BusyClock`)."""
        self._busy.start()
        try:
            return self._post(path, body)
        finally:
            self._busy.end()

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingConfig, seed: int | None = None,
                 max_new_tokens: Sequence[int] | None = None) -> list[Completion]:
        return prompt_major(self.generate_stream(prompts, params, seed, max_new_tokens))

    def continue_stream(self, requests: Sequence[Continuation], params: SamplingConfig,
                        seed: int | None = None) -> Iterator[list[Completion]]:
        """Each request's `prefix + appended` as one prompt; the server's prefix cache (where enabled) reuses
        the prefix's KV entries."""
        prompts, single, limits = continuation_inputs(requests, params)
        yield from self.generate_stream(prompts, single, seed, limits)

    # ---- weights -----------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], final: bool = True,
                     version: int | None = None) -> int:
        count = 0
        for name, tensor in weights:
            # `group` keeps the update (for a new server, for saving): a copy, never the trainer's own storage
            host = tensor.detach().to("cpu", copy=self.weight_sync == "group").contiguous()
            if any(host.data_ptr() == held.data_ptr() for held in self._pending.values()):
                host = host.clone()  # tied weights (embedding and LM head): safetensors stores no shared tensors
            self._pending[name] = host
            count += 1
        if final:
            self._add_tied_head()
            update, self._pending = self._pending, {}
            if self.weight_sync == "group":
                self._broadcast(update)
            else:
                folder = Path(tempfile.mkdtemp(prefix="update-", dir=self._scratch))
                save_file(update, str(folder / WEIGHTS_FILE))
                self._reload(folder)
                self._replace_weights_dir(folder)
            if version is not None:
                self.policy_version = version
        return count

    def load_weights_from_path(self, path: str | Path, version: int | None = None) -> int:
        """Every tensor of the folder's safetensors files as one update, through `load_weights` (which completes a
        tied model's head, see `_add_tied_head`)."""
        from safetensors.torch import load_file

        files = sorted(Path(path).glob("*.safetensors"))
        tensors = [item for file in files for item in load_file(str(file)).items()]
        return self.load_weights(tensors, final=True, version=version)

    def _add_tied_head(self) -> None:
        """Send a tied model's LM head beside its embedding: an update without `lm_head.weight` (a Hugging Face
        folder of a tied model, a trainer's deduplicated parameters) left the final norm's old weight in place
        on vLLM 0.32's CPU server (its layer-wise reload completes layers by the elements they receive)."""
        if self._tied and TIED_HEAD not in self._pending and TIED_EMBEDDING in self._pending:
            self._pending[TIED_HEAD] = self._pending[TIED_EMBEDDING].clone()

    def _broadcast(self, update: dict[str, torch.Tensor]) -> None:
        """`weight_sync=group`: send `update` over the weight group (joined at the first update); a server that died
        meanwhile is replaced and given it (`_revive`)."""
        self.wake()
        self._last = update
        server = self.server
        try:
            self._weight_group().send(update)
        except ServerError:
            if server.process.poll() is None:
                raise
            self._revive(server)  # the new server joins a new group and gets `_last`
        self._post("/reset_prefix_cache")

    def _weight_group(self) -> WeightGroup:
        if self._group is None:
            self._group = WeightGroup(self.server.post, free_port())
        return self._group

    def _reload(self, folder: Path) -> None:
        self.wake()
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}})
        self._post("/reset_prefix_cache")

    def _post(self, path: str, body: dict | None = None) -> dict:
        """`server.post`, and once more on a new server when this one died during the call (killed, out of
        memory): the new server gets the weights last loaded, so the request is answered as it would have been."""
        server = self.server
        try:
            return server.post(path, body)
        except ServerError:
            if server.process.poll() is None:
                raise  # a live server refused the request: not ours to heal
            self._revive(server)
            return self.server.post(path, body)

    def _revive(self, dead: VllmServer) -> None:
        """Replace `dead` by a new server with the weights last loaded (once, however many calls saw it die)."""
        with self._revive_lock:
            if self.server is not dead:
                return  # another request's thread revived it already
            dead.stop()
            started = time.monotonic()
            self.server = self._start_server()
            self._group = None
            if self._last is not None:
                self._weight_group().send(self._last)
            elif self._weights_dir is not None:
                self.server.post("/collective_rpc", {"method": "reload_weights",
                                                     "kwargs": {"weights_path": str(self._weights_dir)}})
            self.server_restarts += 1
            print(f"vLLM server died (exit {dead.process.returncode}); a new one served the weights of update "
                  f"{self.policy_version} after {time.monotonic() - started:.1f} s (log: {self.server.log_path})",
                  flush=True)

    def _replace_weights_dir(self, folder: Path) -> None:
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
        self._weights_dir = folder

    # ---- memory ------------------------------------------------------------------------------

    def sleep(self, level: Literal["offload", "discard"] = "offload") -> int:
        """vLLM's sleep mode (level 1 keeps the weights in host memory, level 2 drops them). On a CPU, where the
        server has no sleep mode, its processes are paused instead (SIGSTOP), so that its polling threads leave
        the cores to the trainer that shares them (`colocate`); `wake` resumes them. Returns 0: what vLLM frees
        is not counted here."""
        if self.state != "awake":
            return 0
        if self.pause_when_asleep:
            self.server.pause()
        else:
            self._post(f"/sleep?level={1 if level == 'offload' else 2}")
        self.state = "offloaded" if level == "offload" else "discarded"
        return 0

    def wake(self) -> None:
        if self.state == "awake":
            return
        if self.pause_when_asleep:
            self.server.resume()
        else:
            self._post("/wake_up")
        self.state = "awake"

    def take_stats(self) -> EngineStats | None:
        """What the server did since the last take, from its metrics (`vllm_metrics`): its engine steps as decode
        rounds of the window's mean batch and duration, its generated, prompt and cached tokens. None when the
        metrics cannot be read, or the engine sleeps (a paused CPU server answers nothing; the window stays open
        for the next take)."""
        if self.state != "awake":
            return None
        counts = self._read_counts()
        if counts is None:
            return None
        with self._calls_lock:
            longest, calls = self._longest, self._calls
            self._longest, self._calls = 0, 0
        window, self._counts = counts.since(self._counts), counts
        return window_stats(window, self._busy.take(), longest, calls)

    def _read_counts(self) -> ServerCounts | None:
        try:
            return ServerCounts.parse(self.server.get_text("/metrics"))
        except ServerError:
            return None

    def save_pretrained(self, path: str | Path) -> None:
        """The model folder's config files with the weights last loaded (the model's own before any update)."""
        target = Path(path)
        target.mkdir(parents=True, exist_ok=True)
        source = Path(self.model_path)
        for item in source.iterdir():
            if item.is_file() and item.suffix == ".json" and not item.name.startswith("tokenizer"):
                shutil.copy2(item, target / item.name)
        if self._last is not None:
            (target / "model.safetensors.index.json").unlink(missing_ok=True)
            save_file(self._last, str(target / WEIGHTS_FILE))
        elif self._weights_dir is None:
            for item in source.glob("*.safetensors"):
                shutil.copy2(item, target / item.name)
        else:
            (target / "model.safetensors.index.json").unlink(missing_ok=True)
            shutil.copy2(self._weights_dir / WEIGHTS_FILE, target / WEIGHTS_FILE)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.server.stop()
        shutil.rmtree(self._scratch, ignore_errors=True)  # the updates' folders with it


def weights_scratch(min_free_bytes: int = 0) -> Path:
    """Where updates are written for the server to read: `/dev/shm` (memory, no disk write) when it exists and
    has `min_free_bytes` free, else the system's temporary folder."""
    shm = Path("/dev/shm")
    if shm.is_dir() and shutil.disk_usage(shm).free > max(min_free_bytes, 64 * 2**20):
        return Path(tempfile.mkdtemp(prefix="gcore-vllm-", dir=shm))
    return Path(tempfile.mkdtemp(prefix="gcore-vllm-"))
