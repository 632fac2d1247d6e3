"""Each plot says which tokens it measured: the demo's training curve ended near 191 held-out perplexity
while its table said 158.69, the curve scoring the recipe's first 16 blocks of 512 tokens and the table the
whole held-out novel in 512-token windows, and neither plot said so."""

from __future__ import annotations

import json

from test_report import MEAN2, METRICS_LINES, fake_result, lineage_of, stage

from mha2gqa.report import measured_on, plots
from mha2gqa.report.side_by_side import write_report

RECIPE = {"seq_len": 512, "data": {"train": ["/d/emma.txt"], "eval": ["/d/persuasion.txt"], "eval_blocks": 16}}


def test_the_training_curve_names_the_held_out_blocks(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(METRICS_LINES)
    (tmp_path / "mha2gqa.json").write_text(json.dumps(lineage_of(MEAN2, stage("uptrain", recipe=RECIPE))))
    _, held_out = plots.training_figure(tmp_path / "metrics.jsonl").axes
    lines = held_out.get_title().splitlines()
    assert lines[0] == "Held-out (recipe's data.eval)"
    assert " ".join(lines[1:]) == (
        "measured on at most the first 16 blocks x 512 tokens (8,192) of persuasion.txt, block by block"
    )


def test_the_training_curve_titles_fit_inside_the_figure(tmp_path):
    """The held-out panel's title ran past the figure's right edge and was cut off in the PNG."""
    recipe = {**RECIPE, "data": {**RECIPE["data"], "eval": ["/d/a-held-out-novel-with-a-long-name.txt.gz"]}}
    (tmp_path / "metrics.jsonl").write_text(METRICS_LINES)
    (tmp_path / "mha2gqa.json").write_text(json.dumps(lineage_of(MEAN2, stage("uptrain", recipe=recipe))))
    fig = plots.training_figure(tmp_path / "metrics.jsonl")
    fig.canvas.draw()
    renderer, width = fig.canvas.get_renderer(), fig.bbox.width
    for ax in fig.axes:
        box = ax.title.get_window_extent(renderer)
        assert 0 <= box.x0 and box.x1 <= width, (ax.get_title(), box, width)
    assert len(fig.axes[1].get_title().splitlines()) == 3  # the long line was wrapped, not dropped


def test_held_out_of_train_and_no_recipe_are_said_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(METRICS_LINES)
    assert measured_on.training_eval(tmp_path / "metrics.jsonl") == ""  # no mha2gqa.json: nothing made up
    recipe = {"seq_len": 256, "data": {"train": ["/d/a.txt", "/d/b.txt", "/d/c.txt"], "eval": None, "eval_blocks": 4}}
    (tmp_path / "mha2gqa.json").write_text(json.dumps(lineage_of(MEAN2, stage("uptrain", recipe=recipe))))
    assert measured_on.training_eval(tmp_path / "metrics.jsonl") == (
        "measured on 4 blocks x 256 tokens (1,024) held out of the training text (a.txt, b.txt and 1 more), "
        "block by block"
    )


def test_the_quality_plot_names_the_scored_tokens_and_windows(tmp_path, monkeypatch):
    results = [
        fake_result("parent", "parent", 8, 10.0, 512, {1: 100.0}),
        fake_result("gqa", "converted", 2, 12.0, 128, {1: 200.0}),
    ]
    for r in results:
        r["data"]["path"] = "/d/persuasion.txt"
    titles = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, out: titles.append(fig.axes[0].get_title()) or save(fig, out))
    paths = [tmp_path / f"{r['label']}.json" for r in results]
    for path, r in zip(paths, results):
        path.write_text(json.dumps(r))
    write_report(paths, tmp_path / "report")
    assert (
        "Quality vs KV-cache size\nperplexity on 499 tokens of persuasion.txt, windows of 64 tokens, stride 32"
        in titles
    )
    results[1]["data"]["ids_sha256"] = "other"
    assert measured_on.perplexity(results).startswith("perplexities measured on different texts")
