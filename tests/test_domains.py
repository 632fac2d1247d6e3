"""Quality on several domains: eval measures each text of --data apart, sums them up in one geometric mean,
report shows them per domain, and the probe set shipped in the package is the default --data."""

import gzip
import hashlib
import json
import math

import pytest
from click.testing import CliRunner
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_family, save_tiny_model

from mha2gqa.cli import main
from mha2gqa.corpus import probe as probe_set
from mha2gqa.eval import evaluate
from mha2gqa.eval.domains import geomean, pooled_perplexity
from mha2gqa.eval.schema import load_result
from mha2gqa.files import embedded
from mha2gqa.report import write_report
from mha2gqa.runtime.errors import InputError

QUICK = dict(context=32, stride=16, speed_preset="off", progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = save_tiny_family(tmp_path_factory.mktemp("domains"), {"parent": 4, "gqa": 2})
    (root / "prose.txt").write_text(SAMPLE_TEXT * 2)
    (root / "code.txt").write_text("def f(x):\n    return [i * x for i in range(10)]\n" * 40)
    return root


def _two(tiny):
    return [f"prose={tiny / 'prose.txt'}", f"code={tiny / 'code.txt'}"]


def test_each_domain_is_measured_apart_and_summed_up_in_a_geometric_mean(tiny):
    r = evaluate(tiny / "gqa", _two(tiny), reference=tiny / "parent", **QUICK)
    assert list(r["domains"]) == ["prose", "code"]
    alone = evaluate(tiny / "gqa", f"code={tiny / 'code.txt'}", reference=tiny / "parent", **QUICK)
    assert r["domains"]["code"] == alone["domains"]["code"]  # a domain's numbers do not depend on the others
    assert alone["perplexity"] == alone["domains"]["code"]["perplexity"]  # one text: the old top-level numbers
    ratios = {
        name: d["perplexity"]["perplexity"] / d["agreement"]["reference_perplexity"] for name, d in r["domains"].items()
    }
    expected = math.sqrt(ratios["prose"] * ratios["code"])
    assert r["quality"]["geomean_perplexity_ratio"] == pytest.approx(expected, rel=1e-12)
    worst = max(ratios, key=ratios.get)
    assert (r["quality"]["worst_domain"], r["quality"]["worst_ratio"]) == (worst, ratios[worst])
    # The top level pools both texts token-weighted: exp of the mean nll over every scored token.
    parts = [d["perplexity"] for d in r["domains"].values()]
    nll = sum(p["nll_per_token"] * p["tokens_scored"] for p in parts) / sum(p["tokens_scored"] for p in parts)
    assert r["perplexity"]["perplexity"] == pytest.approx(math.exp(nll))
    assert r["data"]["source"] == "domains" and r["data"]["tokens"] == sum(
        d["data"]["tokens"] for d in r["domains"].values()
    )


def test_geomean_and_pool_by_hand():
    assert geomean([2.0, 0.5]) == pytest.approx(1.0)  # 2x worse on one domain, 2x better on another
    assert geomean([1.38, 10.3]) == pytest.approx(3.770, abs=1e-3)  # the SmolLM2 numbers: 3.8x
    assert geomean([]) is None and geomean([1.0, None]) is None
    pooled = pooled_perplexity(
        {
            "a": {"perplexity": {"nll_per_token": 1.0, "tokens_scored": 3, "context": 8, "stride": 4, "windows": 1}},
            "b": {"perplexity": {"nll_per_token": 2.0, "tokens_scored": 1, "context": 8, "stride": 4, "windows": 2}},
        }
    )
    assert pooled["perplexity"] == pytest.approx(math.exp(1.25)) and pooled["windows"] == 3


def test_the_report_shows_every_domain_and_old_results_still_load(tiny, tmp_path):
    parent, gqa = tmp_path / "parent.json", tmp_path / "gqa.json"
    evaluate(tiny / "parent", _two(tiny), out=parent, **QUICK)
    r = evaluate(tiny / "gqa", _two(tiny), reference=tiny / "parent", out=gqa, **QUICK)
    old = json.loads(gqa.read_text())
    for key in ("domains", "quality"):
        del old[key]  # a result written before domains were measured
    (tmp_path / "old.json").write_text(json.dumps(old))
    written = write_report([parent, gqa, tmp_path / "old.json"], tmp_path / "report")
    md = written["markdown"].read_text()
    assert "## Quality per domain" in md
    base = json.loads(parent.read_text())
    rows = json.loads(written["json"].read_text())["rows"]
    ratios = [
        r["domains"][n]["perplexity"]["perplexity"] / base["domains"][n]["perplexity"]["perplexity"]
        for n in ("prose", "code")
    ]
    assert rows[1]["domains_ratio"] == pytest.approx(math.sqrt(ratios[0] * ratios[1]))
    assert rows[1]["domain:code:perplexity"] == {
        "perplexity": r["domains"]["code"]["perplexity"]["perplexity"],
        "ratio": ratios[1],
    }
    assert rows[2]["domains_ratio"] is None and rows[2]["domain:code:perplexity"] is None  # the old file: dashes
    table = md.split("## Quality per domain")[1].split("\n\n")[1].splitlines()
    assert table[0].startswith("| model | prose ppl (× baseline) ↓ | prose KL ↓ | prose top-1 ↑ | code ppl")
    assert f"({ratios[1]:.2f}×)" in table[3]


def test_one_text_gives_the_report_it_always_gave(tiny, tmp_path):
    """A single --data text: no per-domain table and no geo-mean column, so earlier reports read the same."""
    paths = [tmp_path / "p.json", tmp_path / "g.json"]
    evaluate(tiny / "parent", str(tiny / "prose.txt"), out=paths[0], **QUICK)
    evaluate(tiny / "gqa", str(tiny / "prose.txt"), reference=tiny / "parent", out=paths[1], **QUICK)
    md = write_report(paths, tmp_path / "report")["markdown"].read_text()
    assert "per domain" not in md and "geo-mean" not in md


def test_the_probe_set_is_the_default_data_of_eval(tiny, tmp_path):
    out = tmp_path / "r.json"
    ran = CliRunner().invoke(
        main, ["eval", str(tiny / "gqa"), "--speed", "off", "-q", "--max-tokens", "400", "--out", str(out)]
    )
    assert ran.exit_code == 0, ran.output
    result = load_result(out)
    assert list(result["domains"]) == list(probe_set.DOMAINS)
    for name, d in result["domains"].items():
        assert d["data"]["path"] == str(probe_set.PROBE_DIR / f"{name}.txt.gz") and d["data"]["tokens"] == 400
    assert "prose: perplexity" in ran.output and "code: perplexity" in ran.output


def test_the_probe_set_is_what_its_provenance_says_and_apart_from_the_calibration_corpus():
    sums = dict(line.split()[::-1] for line in (probe_set.PROBE_DIR / "SHA256SUMS").read_text().splitlines())
    total = 0
    for name, path in probe_set.probe_paths().items():
        text = gzip.decompress(open(path, "rb").read())
        assert hashlib.sha256(text).hexdigest() == sums[f"{name}.txt"]
        assert 50_000 <= len(text) <= 100_000
        total += open(path, "rb").seek(0, 2)
    assert total < 400_000  # a few hundred KB in the package
    prose = gzip.decompress(open(probe_set.probe_paths()["prose"], "rb").read()).decode()
    novels = [gzip.decompress(p.read_bytes()).decode() for p in embedded.train_paths()]
    assert all(prose[1000:1200] not in novel for novel in novels)  # Persuasion: the `austen` corpus holds it out
    assert prose[1000:1200] in gzip.decompress(embedded.heldout_path().read_bytes()).decode()


def test_texts_with_one_name_are_refused():
    with pytest.raises(InputError, match="two texts are named 'held'"):
        probe_set.parse_domains(["a/held.txt", "b/held.txt.gz"])
    assert probe_set.parse_domains(["x=a=b.txt", "probe"])["x"] == "a=b.txt"
    assert probe_set.parse_domains(None) is None and list(probe_set.parse_domains("probe")) == list(probe_set.DOMAINS)


def _candidate(name, groups, ratios, kv):
    from mha2gqa.eval.domains import geomean as g

    return {"name": name, "groups": groups, "method": "calibrated", "perplexity": 100 * g(ratios.values()),
            "perplexity_change": g(ratios.values()) - 1, "kv_bytes_per_token": kv, "kv_saving": 1024 / kv,
            "model": None, "domains": {n: {"perplexity": 100 * r, "ratio": r} for n, r in ratios.items()},
            "domains_ratio": g(ratios.values()), "worst_domain": max(ratios, key=ratios.get),
            "worst_ratio": max(ratios.values())}  # fmt: skip


def test_the_recommendation_refuses_a_candidate_broken_on_one_domain():
    from mha2gqa.sweep.recommend import recommend

    settings = {"methods": ["calibrated"], "tolerance": 0.5, "calibration": "austen", "calibration_tokens": 4096,
                "seed": 0, "refine": None, "data": ["probe"]}  # fmt: skip
    # kv1: fine on average (geo-mean 1.37 <= 1.5) but 4x the parent's on code: broken (cap 1 + 2 x 0.5 = 2).
    kv1 = _candidate("kv1-calibrated", 1, {"prose": 0.9, "code": 4.0, "python_docs": 0.9, "licences": 0.9}, 256)
    kv2 = _candidate("kv2-calibrated", 2, {"prose": 1.2, "code": 1.9, "python_docs": 1.3, "licences": 1.1}, 512)
    assert kv1["domains_ratio"] < 1.5 and kv1["kv_bytes_per_token"] < kv2["kv_bytes_per_token"]
    record = {"settings": settings, "parent": {"perplexity": 100.0}, "candidates": [kv1, kv2], "source": {"path": "m"}}
    found = recommend(record)
    assert found["per_method"] == {"calibrated": "kv2-calibrated"}  # the larger cache, good on every domain
    assert found["refused"]["kv1-calibrated"] == "broken on code (4.00x the parent's, above 2.00x)"
    assert "refused kv1-calibrated (broken on code" in found["summary"]
    assert "no domain above 2.00x" in found["summary"]
    # The same numbers as one text (a record without domains) keep the old rule: the perplexity alone.
    flat = [{k: v for k, v in r.items() if k != "domains"} for r in (kv1, kv2)]
    assert recommend({**record, "candidates": flat})["per_method"] == {"calibrated": "kv1-calibrated"}


def test_the_probe_set_is_the_default_data_of_sweep(tmp_path):
    from mha2gqa.report.sweep_pages import write_pages
    from mha2gqa.sweep import SweepOptions, sweep

    src = tmp_path / "src"
    save_tiny_model(src, "llama", hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=4)
    make_tiny_tokenizer(src)
    (tmp_path / "cal.txt").write_text(SAMPLE_TEXT * 8)
    options = SweepOptions(calibration=str(tmp_path / "cal.txt"), out=str(tmp_path / "out"), groups=(1,), methods=("mean",),
                           max_tokens=200, calibration_tokens=400, progress=False)  # fmt: skip
    assert options.data == (probe_set.PROBE,)
    record = sweep(src, options, echo=lambda _: None, pages=write_pages)
    assert list(record["parent"]["domains"]) == list(probe_set.DOMAINS)
    (row,) = record["candidates"]
    assert set(row["domains"]) == set(probe_set.DOMAINS)
    assert row["domains_ratio"] == pytest.approx(geomean(d["ratio"] for d in row["domains"].values()))
    md = (tmp_path / "out" / "sweep.md").read_text()
    assert "| code ppl (× parent) ↓ |" in md and f"({row['domains']['code']['ratio']:.2f}×)" in md


def test_the_model_card_shows_every_domain(tiny, tmp_path):
    from uptrain_helpers import tiny_model_dir

    from mha2gqa.convert.run import convert

    src = tiny_model_dir(tmp_path / "src")
    dst = tmp_path / "gqa"
    convert(src, dst, groups=2, progress=False)
    r = evaluate(dst, _two(tiny), reference=src, out=dst / "eval.json", **QUICK)
    card = (dst / "README.md").read_text()
    ratios = r["quality"]["perplexity_ratios"]
    line = next(line for line in card.splitlines() if line.startswith("- [eval.json](eval.json): "))
    prose = r["domains"]["prose"]["perplexity"]["perplexity"]
    assert f"prose {prose:.2f} ({ratios['prose']:.2f}x)" in line
    assert f"geometric mean of the ratios to the reference {r['quality']['geomean_perplexity_ratio']:.2f}x" in line
