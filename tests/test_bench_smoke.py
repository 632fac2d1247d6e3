"""Every bench/ script at its --smoke size, as its own process, on CPU: the scripts keep running against
the package as it changes, and what they print and write has the measured quantities, finite.
(bf16_numpy_pool.py, cli_startup.py, refine.py and train_memory.py have their own tests; eval_gpu.py runs inside
gpu_check.py's, tests/test_gpu_check.py.)"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run_smoke(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, f"bench/{script}", "--smoke", *args], capture_output=True, text=True, cwd=ROOT, timeout=900
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout


def table_rows(stdout: str, first_cell: str) -> list[list[str]]:
    """The cells of a printed markdown table's rows whose first cell matches `first_cell` (a regex)."""
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in stdout.splitlines() if line.startswith("|")
    ]
    return [r for r in rows if re.fullmatch(first_cell, r[0])]


def finite(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_convert_smoke_times_every_job(tmp_path):
    out = run_smoke("convert.py", "--workdir", str(tmp_path))
    rows = table_rows(out, r"\d+\.\d\d GB")
    assert [r[1] for r in rows] == [
        "mha2gqa convert",
        "cp -r",
        "naive (from_pretrained+save_pretrained)",
        "python -c 'import torch'",
        "mha2gqa convert (torch executor)",
    ]
    for row in rows:
        wall, ratio, rss, anon = (float(row[i]) for i in (2, 3, 4, 5))
        assert wall >= 0 and ratio >= 0 and rss > 0 and anon >= 0
    assert rows[0][3] == "1.00"  # the ratios are to convert
    # a plain convert imports no torch (convert/fast.py): its peak RSS is below a bare torch import's
    assert float(rows[0][4]) < float(rows[3][4]) and float(rows[4][4]) > 100
    assert not (tmp_path / "llama-0gb").exists()  # the synthetic checkpoint is removed without --keep


@pytest.mark.slow  # ~60-90 s on a loaded 2-core machine: a paired run, two whole train() runs, a profiled one
def test_uptrain_smoke_reports_every_mode(tmp_path):
    out = run_smoke("uptrain.py", "--json", str(tmp_path / "u.json"))
    assert len(table_rows(out, r"tokens / (wall|process CPU) second")) == 4
    result = json.loads((tmp_path / "u.json").read_text())
    assert result["seq_len"] == 32 and result["batch"] == 2
    assert {len(result["paired_step_seconds"][k]) for k in ("uptrain", "hand")} == {2}  # 4 pairs, 2 warm-up
    for key in ("paired tokens / wall second", "runs tokens / process CPU second"):
        assert finite(result[key]["median_overhead"])
    profile = result["profile"]  # seconds by function, found by the functions themselves (none may be 0)
    for key in ("run_steps", "eval", "forward+loss", "backward", "clip", "adamw"):
        assert finite(profile[key]) and profile[key] > 0, key
    assert profile["run_steps"] > profile["backward"] and finite(profile["overhead"])
    for side in ("uptrain", "hand"):
        assert result["paired tokens / wall second"][side] > 0
        assert all(r[0] > 0 and r[1] > 0 for r in result["runs_intervals"][0][side])


def test_uptrain_gpu_smoke_runs_on_cpu_with_baseline(tmp_path):
    out = run_smoke("uptrain_gpu.py", "--baseline", "--json", str(tmp_path / "g.json"))
    assert "uptrain loop:" in out and "hand-written loop:" in out
    result = json.loads((tmp_path / "g.json").read_text())
    assert result["gpu"] == "cpu (smoke)" and result["compile"] is False and result["seq_len"] == 32
    assert result["matmul_params"] > 0 and result["flops_per_token"] > 6 * result["matmul_params"]
    assert len(result["uptrain_intervals"]) == 1  # 3 intervals: one warm-up and the last (final eval) dropped
    for key in ("uptrain_tok_s", "hand_tok_s", "mfu", "overhead"):
        assert finite(result[key]), key
    assert result["uptrain_tok_s"] > 0 and result["hand_tok_s"] > 0 and result["peak_mem_gib"] is None


def test_calibrated_merge_smoke_rows(tmp_path):
    out = run_smoke("calibrated_merge.py", "--out", str(tmp_path / "m.json"))
    result = json.loads((tmp_path / "m.json").read_text())
    assert result["parent_kv_heads"] == 8 and result["eval_tokens"] == 256 and result["context"] == 64
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["mean", "mean-norm", "calibrated", "calibrated+similarity"]
    assert all(r["kv_heads"] == 2 and finite(r["perplexity"]) and finite(r["key_error"]) for r in rows.values())
    parent = result["parent_perplexity"]
    assert rows["mean"]["perplexity"] > parent  # pooling 8 -> 2 heads loses something
    assert rows["mean"]["gap_closed"] == pytest.approx(0.0)
    assert rows["calibrated"]["perplexity"] < rows["mean"]["perplexity"]  # the point of the method
    assert len(table_rows(out, "2")) == 4


@pytest.mark.slow  # ~95 s on a loaded 2-core machine: three uptrain runs
def test_calibrated_uptrain_smoke_rows(tmp_path):
    out = run_smoke("calibrated_uptrain.py", "--out", str(tmp_path / "u.json"))
    result = json.loads((tmp_path / "u.json").read_text())
    assert finite(result["parent_ppl"]) and result["pretrain_tokens"] == 192
    rows = {r["variant"]: r for r in result["rows"]}
    assert list(rows) == ["mean", "calibrated"]
    for row in rows.values():
        assert row["final_tokens"] == 192 and finite(row["start_ppl"]) and finite(row["final_ppl"])
        assert [t for t, _ in row["curve"]] == [0, 64, 128, 192]  # eval at start and after every step
    assert rows["mean"]["tokens_to_mean_final"] == 192
    assert len(table_rows(out, "2")) == 2


def test_eval_speed_noise_smoke():
    out = run_smoke("eval_speed_noise.py")
    parent, gqa, pair = table_rows(out, "1")
    assert parent[1] == "parent" and gqa[1] == "gqa2" and pair[1] == "gqa2 / parent"
    for row in (parent, gqa):
        cells = re.match(r"([\d.,]+) \(([\d.,]+)-([\d.,]+)\)", row[2]).groups()
        median, low, high = (float(c.replace(",", "")) for c in cells)
        assert 0 < low <= median <= high and int(row[3]) >= 3 and float(row[4]) > 0
    assert pair[6] in ("noise", "faster", "slower") and re.match(r"[\d.]+x \([\d.]+-[\d.]+\)", pair[5])
    assert "load average" in out


def test_calibration_domains_smoke_rows(tmp_path):
    run_smoke("calibration_domains.py", "--sampling", '{"top_p": 0.9}', "--out", str(tmp_path / "c.json"))
    result = json.loads((tmp_path / "c.json").read_text())
    domains = ["prose", "code", "python_docs", "licences"]
    assert list(result["parent"]) == domains
    assert [(r["calibration"], r["stage"]) for r in result["rows"]] == [
        ("austen", "merge"),
        ("austen", "global"),
        ("parent:0.5+austen:0.5", "merge"),
        ("parent:0.5+austen:0.5", "global"),
    ]
    for row in result["rows"]:
        assert list(row["ratio"]) == domains
        assert row["ratio"]["prose"] == pytest.approx(row["perplexity"]["prose"] / result["parent"]["prose"], rel=1e-3)
        logs = [math.log(r) for r in row["ratio"].values()]
        assert row["geometric_mean"] == pytest.approx(math.exp(sum(logs) / 4), rel=1e-3)
        # --sampling swapped the parent's recipe for every sampled calibration, and the rows record it
        assert (row["sampling"] or {}).get("top_p") == (0.9 if "parent" in row["calibration"] else None)


def test_sampling_speed_smoke_times_both_draws():
    rows = [json.loads(line) for line in run_smoke("sampling_speed.py").splitlines() if line.startswith("{")]
    assert [row["batch"] for row in rows] == [4]
    assert set(rows[0]["ms_per_token"]) == {"shipped", "whole_batch"}
    assert all(finite(t) and t > 0 for t in rows[0]["ms_per_token"].values()) and finite(rows[0]["speedup"])


def test_kl_speed_smoke_times_both_gradients_and_compares_them(tmp_path):
    run_smoke("kl_speed.py", "--out", str(tmp_path / "k.json"))
    result = json.loads((tmp_path / "k.json").read_text())
    assert (result["positions"], result["vocab"]) == (8, 300)
    assert set(result["seconds"]) == {"hand_written", "autograd"} and all(len(t) == 2 for t in result["runs"].values())
    assert all(finite(t) and t > 0 for t in result["seconds"].values()) and finite(result["speedup"])
    assert 0 < result["largest_gradient"] and result["largest_gradient_difference"] <= 1e-5 * result["largest_gradient"]


def test_sampling_gpu_smoke_times_three_ways_on_both_paths_of_the_draw():
    rows = [json.loads(line) for line in run_smoke("sampling_gpu.py").splitlines() if line.startswith("{")]
    assert [(row["temperature"], row["wide_rows"]) for row in rows] == [(1.0, 1.0), (0.05, 0.0)]
    for row in rows:
        assert set(row["ms_per_step"]) == {"forward", "cpu_draw", "shipped"}
        assert all(finite(t) and t > 0 for t in row["ms_per_step"].values())


def test_calibration_domains_scores_given_folders_by_the_rows_measure(tmp_path):
    """--score: a folder that is the parent itself scores 1x on every domain, an --extra text beside them (outside
    the probe set's geometric mean), and --openings finds no window collapsed."""
    from mha2gqa.files.embedded import MODEL_DIR, read_novel

    extra = tmp_path / "letters.txt"
    extra.write_text(read_novel("emma")[:20_000])
    args = ["--score", str(MODEL_DIR), "--extra", f"letters={extra}", "--openings", "--out", str(tmp_path / "s.json")]
    run_smoke("calibration_domains.py", *args)
    (row,) = json.loads((tmp_path / "s.json").read_text())["scored"]
    assert row["model"] == str(MODEL_DIR) and row["geometric_mean"] == 1.0 == row["geometric_mean_all"]
    assert row["ratio"] == {"prose": 1.0, "code": 1.0, "python_docs": 1.0, "licences": 1.0, "letters": 1.0}
    openings = row["openings"]
    assert openings["window_ratio"] == dict.fromkeys(row["ratio"], 1.0)
    assert openings["collapsed"] == dict.fromkeys(row["ratio"], 0) and min(openings["windows"].values()) >= 1
    assert {name: len(gaps) for name, gaps in openings["gaps"].items()} == openings["windows"]
    assert all(gap == 0 for gaps in openings["gaps"].values() for gap in gaps)


def test_limits_smoke_times_every_ceiling():
    out = run_smoke("limits.py")
    names = [line.split()[0] for line in out.strip().splitlines()]
    assert names == ["small", "layers", "heads", "width", "experts"]
    assert all(float(line.split()[1]) > 0 for line in out.strip().splitlines())


@pytest.mark.slow  # ~2 min on a quiet 2-core machine: twenty commands, each its own process
def test_estimate_rates_smoke_fits_every_kind_the_commands_time(tmp_path):
    out, runs = tmp_path / "rates.json", tmp_path / "runs.jsonl"
    run_smoke("estimate_rates.py", "--out", str(out), "--runs", str(runs))
    rates = json.loads(out.read_text())
    for kind in ("torch_start", "eval_load", "eval_quality", "calibrate", "sample", "refine", "train", "write_numpy"):
        fixed = rates["kinds"][kind]["fixed"]
        assert finite(fixed[0]) and fixed[0] >= 0, kind
    assert rates["kinds"]["eval_quality"]["per"]["forward"][0] > 0 and rates["probe_s"]["torch"] > 0
    assert rates["measured"]["smoke"] is True and runs.read_text().count("\n") >= 15


@pytest.mark.slow  # ~2 min: seven commands, each a real run at toy sizes
def test_estimate_probe_smoke_sums_up_the_rounds_every_way(tmp_path):
    out = tmp_path / "probe.json"
    stdout = run_smoke("estimate_probe.py", "--out", str(out))
    (run,) = json.loads(out.read_text())["runs"]
    assert run["spinners"] == 0 and len(run["rounds"]) == 11 and run["work_per_round"] > 0
    rows = table_rows(stdout, r"(fastest|2nd|median|mean).*")
    assert len(rows) == 6 and rows[0][0] == "fastest of 11 (shipped)"
    assert all(finite(float(cell)) for row in rows for cell in row[1:])


def test_estimate_check_smoke_reads_each_commands_estimate_and_time(tmp_path):
    out = tmp_path / "check.json"
    stdout = run_smoke("estimate_check.py", "--work", str(tmp_path / "w"), "--out", str(out))
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == [
        "demo --quick",
        "convert, mean",
        "convert, calibrated",
        "convert, calibrated + refine",
        "sweep",
        "eval, with --reference",
        "uptrain",
    ]
    for r in rows:
        assert finite(r["estimate_s"]) and r["wall_s"] > 0 and r["took_line"], r
    assert len(table_rows(stdout, r"(demo|convert|sweep|eval|uptrain).*")) == 7


@pytest.mark.slow
def test_recovery_real_smoke_scores_every_point_of_both_starts(tmp_path, monkeypatch):
    """Both starts converted by the CLI, each distilled once with the shipped recipe (stopped at step 1 and resumed
    to step 2), every point scored against the parent; the second start reads the teacher's samples from the cache,
    and a second run of the same measurement redoes nothing."""
    monkeypatch.setenv("MHA2GQA_CACHE", str(tmp_path / "cache"))  # the samples' cache of this test alone
    args = ["--work", str(tmp_path / "w"), "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
    out = run_smoke("recovery_real.py", *args)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["recipe"] == "distill-parent-cpu" and result["steps"] == [1, 2] and result["kv_from"] == 8
    assert list(result["starts"]) == ["mean", "calibrated"]
    assert "--method calibrated --refine --seed 1" in result["starts"]["calibrated"]["convert"]["command"]
    for entry in result["starts"].values():
        assert [p["tokens"] for p in entry["points"]] == [0, 128, 256]  # 2 blocks of 64 tokens a step
        assert [leg["steps"] for leg in entry["distill"]] == [[0, 1], [1, 2]]
        for point in entry["points"]:
            ratios = point["ratio"]
            assert list(ratios) == list(result["parent"]) == ["prose", "code", "python_docs", "licences"]
            assert ratios["code"] == pytest.approx(point["perplexity"]["code"] / result["parent"]["code"], rel=1e-3)
            assert point["geometric_mean"] == pytest.approx(math.exp(sum(map(math.log, ratios.values())) / 4), rel=1e-3)
        # the checkpoint at step 1 and the final model are different weights: the scores move
        assert len({p["geometric_mean"] for p in entry["points"]}) == 3
        first, last = entry["points"][0]["geometric_mean"], entry["points"][-1]["geometric_mean"]
        assert entry["closing"]["gap_closed"] == pytest.approx(1 - math.log(last) / math.log(first), abs=1e-3)
        assert [h["step"] for h in entry["held_out"]] == [0, 2] and all(
            finite(h["eval_ppl"]) for h in entry["held_out"]
        )
    assert out.count("read from the cache, not sampled again") == 6  # the resumes and the second start
    assert (tmp_path / "r.png").stat().st_size > 10_000
    assert len(table_rows(out, "mean|calibrated")) == 6
    again = run_smoke("recovery_real.py", *args)
    assert "uptrain" not in again and json.loads((tmp_path / "r.json").read_text())["starts"] == result["starts"]


def test_the_openings_summary_counts_collapsed_windows_and_keeps_each_gap():
    import importlib.util

    spec = importlib.util.spec_from_file_location("calibration_domains", ROOT / "bench" / "calibration_domains.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    parent = {"code": [2.0, 2.5, 3.0], "json": [1.0, 1.0]}
    child = {"code": [2.5, 18.0, 3.0], "json": [1.0, 5.5]}
    summary = bench.openings_summary(child, parent)
    assert summary["gaps"] == {"code": [0.5, 15.5, 0.0], "json": [0.0, 4.5]}
    assert summary["collapsed"] == {"code": 1, "json": 1} and summary["windows"] == {"code": 3, "json": 2}
    assert summary["window_ratio"]["code"] == pytest.approx(math.exp(16.0 / 3), rel=1e-4)


def test_sdpa_gqa_path_finds_the_grouped_cache_read_as_it_is_under_the_pinned_transformers(tmp_path):
    """docs/benchmarks.md's reading of the H200 decode numbers rests on these routes: without a mask SDPA gets
    enable_gqa, and a one-token step over a StaticCache's mask folds the query heads (pack_gqa), never repeat_kv.
    A transformers release that routes otherwise fails here, and the docs' explanation with it."""
    out = tmp_path / "routes.json"
    done = subprocess.run(
        [sys.executable, "bench/sdpa_gqa_path.py", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    layers, caches = result["layers"], result["caches"]
    assert caches["dynamic"]["decode"] == {"enable_gqa": layers}
    assert caches["static"]["decode"] == {"pack_gqa": layers}
    assert all(phase.get("repeat_kv", 0) == 0 for cache in caches.values() for phase in cache.values())
    assert "static   decode   pack_gqa 2" in done.stdout


def test_decode_gqa_smoke_times_mha_gqa8_and_mqa_beside_the_bandwidth_limit(tmp_path):
    """bench/decode_gqa.py at toy sizes: every path times the three models in turn, each row's bytes and fraction of
    the measured bandwidth limit are finite, and the grouped path's steps were folded, never handed on."""
    out = tmp_path / "decode.json"
    stdout = run_smoke(
        "decode_gqa.py", "--paths", "grouped,grouped-fused,grouped-sdpa,grouped-matmul,dynamic", "--profile", "--out",
        str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    kernels = {path: found["decode_path"].get("kernel") for path, found in result["paths"].items()}
    assert result["bandwidth"]["limit_gb_s"] > 0 and kernels == {
        "grouped": "fused",  # eval's choice where the C kernel builds, as on every machine the suite runs on
        "grouped-fused": "fused",
        "grouped-sdpa": "sdpa",
        "grouped-matmul": "matmul",
        "dynamic": None,
    }
    for found in result["paths"].values():
        assert [r["model"] for r in found["rows"]] == ["MHA", "GQA-8", "MQA"]
        assert [r["kv_heads"] for r in found["rows"]] == [32, 8, 1]
        for row in found["rows"]:
            assert row["steps"] == 2 * result["size"]["rounds"]  # --steps 2 per round, the warm-up round left out
            assert all(
                finite(row[k]) and row[k] > 0 for k in ("step_s_median", "floor_s", "fraction_of_bandwidth_limit")
            )
        assert found["rows"][0]["speedup_vs_mha"] == 1.0
        assert (
            found["rows"][0]["cache_bytes"]
            == 32 * found["rows"][2]["cache_bytes"]
            == 4 * found["rows"][1]["cache_bytes"]
        )
        assert "aten::mm" in found["profile"]["GQA-8"]
    grouped = result["paths"]["grouped"]["decode_path"]
    layers, steps = result["size"]["layers"], 3 * 2 * (result["size"]["rounds"] + 1)
    assert grouped["cache"] == "static" and grouped["steps"] == {
        "folded": 2 * layers * steps // 3,
        "as_is": layers * steps // 3,
    }
    assert len(table_rows(stdout, r"MHA|GQA-8|MQA")) == 3 * len(kernels) and "load average before" in stdout


def test_decode_paths_gpu_leaves_out_what_would_pass_its_deadline_but_the_default_and_grouped(tmp_path):
    """bench/decode_paths_gpu.py (gpu_check part 7; its full smoke runs in tests/test_gpu_check.py) under a deadline
    already spent: transformers' default and eval's grouped path still run and are profiled; every other path is
    recorded as not reached, or as needing CUDA, never silently dropped."""
    out = tmp_path / "paths.json"
    stdout = run_smoke("decode_paths_gpu.py", "--deadline-s", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert list(result["paths"]) == ["dynamic", "grouped"] and set(result["profile"]) == {"dynamic", "grouped"}
    reasons = {s["what"]: s["reason"] for s in result["skipped"]}
    assert len(reasons) == 12 and reasons["static-compiled"].startswith("not reached: ")
    assert reasons["grouped/cudnn"] == "the cudnn SDPA backend needs CUDA"
    assert result["best"]["per_model"]["GQA-8"]["path"] in ("dynamic", "grouped")
    assert "GQA-8 / MHA" in stdout and "flex: skipped (not reached" in stdout


FAKE_CONVERTER = """import shutil, sys
from pathlib import Path
model, out = Path(sys.argv[1]), Path(sys.argv[sys.argv.index("--outfile") + 1])
shutil.copyfile(model / "model.safetensors", out)  # a stand-in GGUF: the weights' size
"""

# llama-bench's JSON (-o json) for every model and depth: tokens/s falling with the file's size and the depth
FAKE_LLAMA_BENCH = """import json, sys
from pathlib import Path
args = sys.argv[1:]
value = lambda flag: args[args.index(flag) + 1]
models = [args[i + 1] for i, a in enumerate(args) if a == "-m"]
records = [
    {"model_filename": m, "n_depth": int(d), "n_gen": int(value("-n")), "n_prompt": 0, "build_commit": "fake",
     "build_number": 1, "samples_ts": [1e9 / (Path(m).stat().st_size + 1000 * int(d)) * (1 + r / 100)
                                       for r in range(int(value("-r")))]}
    for m in models for d in value("-d").split(",")
]
print(json.dumps(records))
"""


def test_decode_llamacpp_smoke_runs_llama_bench_on_the_pair_side_by_side(tmp_path):
    """bench/decode_llamacpp.py at its toy size, with stand-ins for llama.cpp's converter and llama-bench: it builds
    the parent, converts it, exports both, runs one llama-bench over both per depth, and writes each one's
    median tokens/s, the bytes a token reads and the ratio to the parent at the same depth."""
    converter, bench = tmp_path / "convert_hf_to_gguf.py", tmp_path / "llama-bench"
    converter.write_text(FAKE_CONVERTER)
    bench.write_text(f"#!{sys.executable}\n" + FAKE_LLAMA_BENCH)
    bench.chmod(0o755)
    out = tmp_path / "llamacpp.json"
    stdout = run_smoke(
        "decode_llamacpp.py", "--tokenizer", str(ROOT / "mha2gqa/data/austen-mha"), "--work", str(tmp_path / "w"),
        "--converter", str(converter), "--llama-bench", str(bench), "--weights", "f16", "--groups", "2",
        "--depths", "512,1024", "--reps", "3", "--out", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = {(r["model"], r["depth"]): r for r in result["rows"]}
    assert set(rows) == {(m, d) for m in ("MHA", "GQA-2") for d in (512, 1024)}
    ggufs = [result["models"][m]["gguf"] for m in ("MHA", "GQA-2")]
    # one llama-bench per depth, both models in each: a depth's pair runs side by side
    assert [c[c.index("-d") + 1] for c in result["commands"]] == ["512", "1024"]
    for command in result["commands"]:
        assert command[command.index("-m") :] == ["-m", ggufs[0], "-m", ggufs[1]]
    for (model, depth), row in rows.items():
        size = Path(result["models"][model]["gguf"]).stat().st_size
        assert row["tokens_per_s_median"] == pytest.approx(1e9 / (size + 1000 * depth) * 1.01)  # the middle of 3
        assert 0 < row["fraction_of_bandwidth_limit"] < math.inf
    assert (
        rows["MHA", 1024]["cache_bytes"]
        == 4 * rows["GQA-2", 1024]["cache_bytes"]
        == 2 * rows["MHA", 512]["cache_bytes"]
    )
    ratio = rows["GQA-2", 1024]["tokens_per_s_median"] / rows["MHA", 1024]["tokens_per_s_median"]
    assert rows["GQA-2", 1024]["vs_first"] == pytest.approx(ratio) and ratio > 1
    assert result["engine"]["build_commit"] == "fake" and len(table_rows(stdout, r"512|1024")) == 4


def test_budget_merges_smoke_measures_both_merges_and_every_placement(tmp_path):
    out = run_smoke("budget_merges.py", "--out", str(tmp_path / "b.json"))
    found = json.loads((tmp_path / "b.json").read_text())
    assert set(found["placements"]) == {"0.5 calibrated", "0.5 mean", "0.6667 calibrated", "0.6667 mean"}
    for entry in found["placements"].values():
        assert len(entry["counts"]) == 6 and entry["whole_text"] > 0 and entry["whole_retrieval"] > 0
    assert found["calibrated"]["text"] != found["mean"]["text"]  # the merge is what the losses measure
    assert out.count("layers kept") == 4
