"""The serving benchmark: a parent and its conversions served side by side by vLLM, checked and timed.

prepare (no torch, no server: every refusal comes first) -> transformers' greedy reference -> every server
started, each in its own process group -> per server: greedy continuations and the KV numbers it reports ->
throughput, the models in turn within each repeat -> every server stopped (on every way out) -> the result.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from mha2gqa.architecture.layouts import AttentionShape, attention_shape, config_dtype, read_config
from mha2gqa.files.sources import require_safetensors
from mha2gqa.nemotron_nas.blocks import MODEL_TYPE as NEMOTRON_NAS
from mha2gqa.records import provenance
from mha2gqa.runtime.errors import InputError, one_line
from mha2gqa.serving import capacity, client, engine, kvlog, prompts, result, settle
from mha2gqa.serving.children import validate_children
from mha2gqa.serving.options import GREEDY_PROMPT_TOKENS, ServeOptions
from mha2gqa.serving.server import Server, free_port


@dataclass
class Served:
    """One model of the run: where it is, what its config says, its server once started."""

    label: str
    role: str
    path: Path
    shape: AttentionShape
    vocab: int
    server: Server | None = None


@dataclass
class ServePlan:
    models: list[Served]
    engine: engine.Engine
    args: engine.ServerArgs
    logs: Path


def _served(path: str, role: str | None, labels: set[str]) -> Served:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise InputError(f"{path}: no such model directory (serve-bench serves local checkpoints)")
    require_safetensors(folder, "model")
    config = read_config(folder)
    vocab = config.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise InputError(
            f"{path}/config.json has vocab_size={vocab!r}: a served model needs a positive whole vocab_size "
            "(its tokenizer's size)"
        )
    label = folder.resolve().name or "model"
    while label in labels:  # two folders of one name: number the repeats
        label += "'"
    labels.add(label)
    return Served(label, role or provenance.role(folder), folder.resolve(), attention_shape(config), vocab)


def prepare(parent: str, children: list[str], out: str | None, options: ServeOptions) -> ServePlan:
    """Every check that needs neither torch nor a server, then vLLM's Python (InputError, one line each)."""
    options.validate()
    if not children:
        raise InputError("serve-bench needs a parent and at least one conversion of it: PARENT CHILD...")
    labels: set[str] = set()
    models = [_served(parent, "parent", labels)] + [_served(c, None, labels) for c in children]
    validate_children(models[0].path, [m.path for m in models[1:]], [parent, *children])
    for child in models[1:]:
        if child.vocab != models[0].vocab:
            raise InputError(
                f"{child.path} has vocab_size={child.vocab}, its parent {models[0].vocab}: serve-bench compares "
                "conversions of one parent, which keep its tokenizer"
            )
    dtype = options.dtype if options.dtype != "auto" else _parent_dtype(parent, models[0].path)
    cache_bytes = options.kv_cache_bytes()
    for m in models:
        holds = cache_bytes // m.shape.kv_bytes_per_token(dtype_bytes=_DTYPE_BYTES[dtype])
        if holds < options.context:
            raise InputError(
                f"--kv-cache-memory {options.kv_cache_memory} holds {holds:,} tokens of {m.label}'s KV cache, fewer "
                f"than --context {options.context}: raise --kv-cache-memory or lower --context"
            )
    logs = Path(options.logs or f"{out or 'serve-bench'}.logs")
    args = engine.ServerArgs(dtype=dtype, context=options.context, kv_cache_bytes=cache_bytes, eager=options.eager)
    found = engine.find_engine(options.vllm_python)
    for m in models:
        if m.shape.model_type == NEMOTRON_NAS:
            engine.require_plugin(found, f"{'PARENT' if m.role == 'parent' else 'CHILD'} {m.path}")
    return ServePlan(models, found, args, logs)


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _parent_dtype(typed: str, folder: Path) -> str:
    """--dtype auto: the dtype PARENT's config.json names, when it is one the servers and the formula take."""
    named = config_dtype(read_config(folder))
    if named not in _DTYPE_BYTES:
        raise InputError(
            f"--dtype auto: {typed}/config.json names dtype {one_line(named)[:40]!r}, which serve-bench does not "
            f"serve: pass --dtype ({', '.join(_DTYPE_BYTES)})"
        )
    return named


def guarded(server: Server, call: Callable, *args):
    """call(*args), with a server that stopped answering or refused a request turned into one line (InputError)."""
    try:
        return call(*args)
    except client.ServerGone as err:
        server.ensure_alive(grace_s=5.0)  # it died: its exit code and last log line
        raise InputError(f"the server for {server.label} stopped answering ({err}); its log: {server.log}") from None
    except client.ServerRefused as err:
        fix = (  # 400: vLLM's answer to a request it cannot take; another code: not vLLM's completions API
            "check --context, --prompt-tokens and --output-tokens"
            if err.status == 400
            else "is --vllm-python vLLM's (an OpenAI-compatible /v1/completions)?"
        )
        raise InputError(
            f"the server for {server.label} refused a request ({err}): {fix}; its log: {server.log}"
        ) from None
    except client.ServerGarbled as err:
        raise InputError(
            f"the server for {server.label} answered with something that is no OpenAI-compatible completion ({err}): "
            f"is --vllm-python vLLM's, and its port its own? its log: {server.log}"
        ) from None


def start_servers(plan: ServePlan, stack: ExitStack, timeout_s: float) -> None:
    """Start every server at once (their start-ups overlap, with each other and with what the caller does
    meanwhile); each ends with `stack`."""
    env = engine.server_environment()
    for m in plan.models:
        port = free_port()
        command = engine.server_command(plan.engine, str(m.path), m.label, port, plan.args)
        m.server = stack.enter_context(Server(m.label, command, port, plan.logs / f"{m.label}.log", env, timeout_s))


def wait_ready(plan: ServePlan, say) -> None:
    for m in plan.models:
        seconds = m.server.wait_ready()
        say(f"{m.label}: {plan.engine.describe()} ready after {seconds:.0f} s (log: {m.server.log})")


def engine_greedy(plan: ServePlan, greedy_set, tokens: int) -> dict[str, list[list[int]]]:
    """Each server's greedy continuation of every prompt."""
    found = {}
    for m in plan.models:
        found[m.label] = [guarded(m.server, client.greedy, m.server.url, m.label, p, tokens) for _, p in greedy_set]
    return found


def engine_kv(plan: ServePlan) -> dict[str, dict]:
    """The KV numbers each server reported, beside our formula's at the same budget and block size."""
    found = {}
    for m in plan.models:
        try:
            reported = kvlog.engine_kv(m.server.log_text(), client.get_text(m.server.url, "/metrics"))
        except kvlog.Unreadable as err:
            raise InputError(
                f"the server for {m.label} wrote a KV number serve-bench cannot read ({err}): it reads them as vLLM "
                f"writes them (docs/serving.md); is --vllm-python vLLM's? its log: {m.server.log}"
            ) from None
        per_token = m.shape.kv_bytes_per_token(dtype_bytes=_DTYPE_BYTES[plan.args.dtype])
        formula = kvlog.formula_kv(per_token, plan.args.kv_cache_bytes, plan.args.context, reported["block_size"])
        found[m.label] = {"engine": reported, "formula": formula, "match": reported["tokens"] == formula["tokens"]}
    return found


def timed_point(
    plan: ServePlan, batch: list[list[int]], c: int, options: ServeOptions, say, what: str
) -> dict[str, dict]:
    """{label: one point at concurrency c}: within each repeat every model runs `batch` once, the order reversed
    on every other repeat, so a drift of the machine's load falls on all models alike; each run with the
    engine's count of the requests it ran, read from /metrics meanwhile."""
    runs: dict[str, list[dict]] = {m.label: [] for m in plan.models}
    for r in range(options.repeats):
        for m in plan.models if r % 2 == 0 else plan.models[::-1]:
            before = os.getloadavg()
            with capacity.RunningSampler(lambda url=m.server.url: client.get_text(url, "/metrics", 5.0)) as engine_:
                run = guarded(m.server, client.load, m.server.url, m.label, batch, options.output_tokens, c)
            run.update(engine_.summary(), load_before=list(before), load_after=list(os.getloadavg()))
            runs[m.label].append(run)
            say(
                f"  {what} {c}, run {r + 1}/{options.repeats}, {m.label}: {run['output_tokens_per_s']:,.1f} output "
                f"tok/s, {run['tpot_ms'] or 0:,.1f} ms per output token, engine ran {run['running_max'] or 0:.0f} at "
                f"most (load {before[0]:.1f})"
            )
    return {label: _point(c, done) for label, done in runs.items()}


def throughput(plan: ServePlan, timing_prompts: list[list[int]], options: ServeOptions, say) -> dict[str, list[dict]]:
    """{label: [one point per --concurrency]}."""
    points: dict[str, list[dict]] = {m.label: [] for m in plan.models}
    for c in options.concurrency or ():
        for label, point in timed_point(
            plan, timing_prompts[: c * options.waves], c, options, say, "concurrency"
        ).items():
            points[label].append(point)
    return points


def fits(plan: ServePlan, kv: dict[str, dict], options: ServeOptions) -> dict[str, int | None]:
    """{label: the requests of --prompt-tokens + --output-tokens its KV cache runs at once} (the engine's count)."""
    per_request = options.prompt_tokens + options.output_tokens
    return {
        m.label: capacity.requests_fit(
            kv[m.label]["engine"]["tokens"],
            kv[m.label]["engine"]["block_size"],
            per_request,
            kv[m.label]["engine"].get("blocks"),
        )
        for m in plan.models
    }


def settle_servers(plan: ServePlan, options: ServeOptions, say) -> dict:
    """Wait until every server's processes are quiet (settle.py); what was waited, recorded."""
    groups = [m.server.process.pid for m in plan.models]  # each a session leader: its pid is the group's id
    found = settle.wait_quiet(lambda: settle.group_cpu_seconds(groups), options.settle_timeout)
    state = "quiet" if found["settled"] else f"not quiet after --settle-timeout {options.settle_timeout:g} s"
    say(f"servers {state} after {found['waited_s']:.0f} s (cores used per second: {found['cores'][-5:]})")
    return found


def decode_point(plan: ServePlan, timing_prompts, options: ServeOptions, say) -> dict[str, dict] | None:
    """--decode-concurrency requests in flight, every model alike: the decode-only time per output token."""
    c = options.decode_concurrency
    if not c:
        return None
    return timed_point(plan, timing_prompts[: c * options.waves], c, options, say, "decode-only, concurrency")


def capacity_point(plan: ServePlan, timing_prompts, options: ServeOptions, held: dict, say) -> dict:
    """Throughput at a concurrency above what the parent's KV cache fits: {concurrency, why, points} (points
    None, and why, when left out)."""
    c = options.capacity_requests()
    why = "--capacity-concurrency" if c else "--capacity-concurrency 0"
    if c is None:
        c, why = capacity.auto_concurrency(held, plan.models[0].label)
    if not c:
        say(f"capacity-bound throughput left out: {why}")
        return {"concurrency": None, "why": why, "points": None}
    points = timed_point(plan, timing_prompts[: c * options.waves], c, options, say, "capacity-bound, concurrency")
    return {"concurrency": c, "why": why, "points": points}


def _point(concurrency: int, runs: list[dict]) -> dict:
    def median(key):
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "concurrency": concurrency,
        "requests": runs[0]["requests"],
        "output_tokens_per_s": median("output_tokens_per_s"),
        "total_tokens_per_s": median("total_tokens_per_s"),
        "tpot_ms": median("tpot_ms"),
        "steady_tpot_ms": median("steady_tpot_ms"),
        "itl_ms": median("itl_ms"),
        "ttft_ms": median("ttft_ms"),
        "running_max": max((r["running_max"] for r in runs if r["running_max"] is not None), default=None),
        "running_mean": median("running_mean"),
        "waiting_max": max((r["waiting_max"] for r in runs if r["waiting_max"] is not None), default=None),
        "runs": runs,
    }


def serve_bench(
    parent: str,
    children: list[str],
    out: str | None = None,
    options: ServeOptions | None = None,
    say: Callable[[str], None] = print,
    plan: ServePlan | None = None,
) -> dict:
    """Serve PARENT and CHILDREN in vLLM; the result dict (result.py), written to `out` when given. `plan`:
    prepare()'s for the same arguments, when the caller has made it already."""
    options = options or ServeOptions()
    plan = plan or prepare(parent, children, out, options)
    from mha2gqa.eval.model import load_tokenizer
    from mha2gqa.serving.reference import reference_texts

    ids = prompts.probe_ids(load_tokenizer(plan.models[0].path))
    greedy_set = prompts.greedy_prompts(ids, options.prompts_per_domain, GREEDY_PROMPT_TOKENS)
    # the capacity point's count is known once the engines report their caches: prompts for the most auto asks
    most = max([*(options.concurrency or [0]), options.decode_concurrency, options.capacity_requests() or 0])
    if options.capacity_requests() is None:
        most = max(most, capacity.MOST_AUTO)
    count = most * options.waves if options.concurrency else 0  # --concurrency none: no timing at all
    timing_prompts = prompts.load_prompts(ids, count, options.prompt_tokens) if count else []
    load_before = os.getloadavg()
    with ExitStack() as stack:
        start_servers(plan, stack, options.startup_timeout)  # minutes on a CPU: the reference decodes meanwhile
        say(f"transformers' greedy decode of {len(greedy_set)} prompts x {options.greedy_tokens} tokens per model ...")
        references = {
            m.label: reference_texts(m.path, plan.args.dtype, [p for _, p in greedy_set], options.greedy_tokens)
            for m in plan.models
        }
        wait_ready(plan, say)
        texts = engine_greedy(plan, greedy_set, options.greedy_tokens)
        kv = engine_kv(plan)
        held = fits(plan, kv, options)
        quiet = decode = None
        bound = {"concurrency": None, "why": "--concurrency none", "points": None}
        if timing_prompts:
            quiet = settle_servers(plan, options, say)
            decode = decode_point(plan, timing_prompts, options, say)
            bound = capacity_point(plan, timing_prompts, options, held, say)
        points = throughput(plan, timing_prompts, options, say)
        startup = {m.label: m.server.ready_after_s for m in plan.models}
    timed = {"settle": quiet, "fits": held, "decode": decode, "capacity": bound}
    found = result.build(plan, options, greedy_set, references, texts, kv, points, startup, load_before, timed)
    if out is not None:
        result.write(found, Path(out))
    return found
