"""A fake of `python -m vllm.entrypoints.openai.api_server` for the tests that need no vLLM.

It takes vLLM's flags, logs the KV line vLLM logs (the same formula, blocks of 128 tokens), serves /health,
/metrics and /v1/completions (streamed or not) on 127.0.0.1, and spawns a child that sleeps, as vLLM spawns
its engine core, so that a test can see whether the whole process group ended. FAKE_VLLM picks a fault:
  ok (default)      serve until killed
  exit              print an error and exit 1 before serving
  hang              never answer /health
  die_after=N       exit (code 1) on the N-th completion request, its child left to the caller to end
  bad_log           log the KV line with a number that is none ("1,2,,3 tokens"), then serve
  html              answer every completion with 200 and an HTML page (a proxy's or another server's)
  not_found         answer every completion with 404 and an HTML page (a server without the completions API)
Greedy "decoding": token i+1 = (token i * 7 + 3) mod vocab_size, the same rule for every model. /metrics counts
the streamed requests in flight as vLLM's gauges do: running as many as the KV blocks fit (less vLLM's null
block), the rest waiting;
FAKE_VLLM_TOKEN_S (default 0) seconds between streamed tokens keeps them in flight long enough to be seen.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BLOCK = 128
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def next_token(token: int, vocab: int) -> int:
    return (token * 7 + 3) % vocab


def arguments():
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--host", "--dtype"):
        parser.add_argument(flag)
    for flag in ("--port", "--max-model-len", "--kv-cache-memory-bytes"):
        parser.add_argument(flag, type=int)
    args, _ = parser.parse_known_args()
    return args


def kv_tokens(args) -> int:
    config = json.loads((Path(args.model) / "config.json").read_text())
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    per_token = 2 * config["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[args.dtype]
    return args.kv_cache_memory_bytes // per_token // BLOCK * BLOCK


def handler(args, vocab: int, tokens: int):
    mode = os.environ.get("FAKE_VLLM", "ok")
    die_after = int(mode.split("=")[1]) if mode.startswith("die_after=") else None
    served = {"count": 0, "in_flight": []}  # in_flight: blocks each streamed request holds
    lock = threading.Lock()
    token_s = float(os.environ.get("FAKE_VLLM_TOKEN_S", "0"))

    def gauges() -> str:
        with lock:
            free, running = tokens // BLOCK - 1, 0  # one block is vLLM's null block
            for (blocks,) in served["in_flight"]:  # first come, first run, while blocks are free
                if blocks > free:
                    break
                free, running = free - blocks, running + 1
            waiting = len(served["in_flight"]) - running
        labels = f'engine="0",model_name="{args.served_model_name}"'
        return (
            f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
            f"vllm:num_requests_waiting{{{labels}}} {float(waiting)}\n"
            f"vllm:num_preemptions_total{{{labels}}} 0.0\n"
        )

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            print("request", self.path, flush=True)

        def _send(self, body: str, kind="application/json"):
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self):
            if self.path == "/health":
                return self._send("")
            if self.path == "/metrics":
                labels = f'block_size="{BLOCK}",kv_cache_memory_bytes="{args.kv_cache_memory_bytes}"'
                info = f'vllm:cache_config_info{{{labels},num_gpu_blocks="{tokens // BLOCK}"}} 1.0\n'
                return self._send(info + gauges())
            self.send_error(404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            served["count"] += 1
            if mode == "html":
                return self._send("<!DOCTYPE html><html><body>Welcome to nginx!</body></html>", "text/html")
            if mode == "not_found":
                return self.send_error(404)
            if die_after is not None and served["count"] >= die_after:
                print("RuntimeError: the fake engine died", flush=True)
                os._exit(1)
            if len(body["prompt"]) + body["max_tokens"] > args.max_model_len:
                self.send_response(400)
                self.end_headers()
                self.wfile.write(json.dumps({"error": {"message": "prompt too long"}}).encode())
                return
            ids, last = [], body["prompt"][-1]
            for _ in range(body["max_tokens"]):
                last = next_token(last, vocab)
                ids.append(last)
            if not body.get("stream"):
                return self._send(json.dumps({"choices": [{"text": "x", "token_ids": ids}]}))
            entry = [math.ceil((len(body["prompt"]) + body["max_tokens"]) / BLOCK)]  # a list: removed by identity
            with lock:
                served["in_flight"].append(entry)
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for t in ids:
                    time.sleep(token_s)
                    self.wfile.write(f"data: {json.dumps({'choices': [{'text': 'x', 'token_ids': [t]}]})}\n\n".encode())
                    self.wfile.flush()
                usage = json.dumps({"choices": [], "usage": {"completion_tokens": len(ids)}})
                self.wfile.write(f"data: {usage}\n\ndata: [DONE]\n\n".encode())
            finally:
                with lock:
                    served["in_flight"] = [e for e in served["in_flight"] if e is not entry]

    return Handler


def main():
    args = arguments()
    mode = os.environ.get("FAKE_VLLM", "ok")
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print(f"fake engine core pid={core.pid}", flush=True)
    if mode == "exit":
        print("ValueError: the fake cannot load this model", flush=True)
        sys.exit(1)
    if mode == "hang":
        time.sleep(3600)
    config = json.loads((Path(args.model) / "config.json").read_text())
    tokens = kv_tokens(args)
    shown = "1,2,,3" if mode == "bad_log" else f"{tokens:,}"
    print(
        f"CPU KV cache size: {shown} tokens, Maximum concurrency for {args.max_model_len:,} tokens per "
        f"request: {tokens / args.max_model_len:.2f}x",
        flush=True,
    )
    try:
        server = ThreadingHTTPServer((args.host, args.port), handler(args, config["vocab_size"], tokens))
    except OSError as err:
        print(f"OSError: [Errno {err.errno}] {err.strerror}", flush=True)
        sys.exit(1)
    server.serve_forever()


if __name__ == "__main__":
    main()
