"""The sweep plot's log axis has a labelled tick at or below its lowest point and one at or above its
highest: the axis used to start labelling at 300, so the parent's 244.9 could not be read off it."""

from __future__ import annotations

import pytest

from mha2gqa.report import plots, sweep_plots


def _record(parent: float, candidates: list[float]) -> dict:
    rows = [
        {"name": f"kv{g}-mean", "method": "mean", "groups": g, "kv_bytes_per_token": 256 * g, "perplexity": p}
        for g, p in zip((4, 2, 1), candidates)
    ]
    return {
        "parent": {"kv_bytes_per_token": 2048, "perplexity": parent},
        "candidates": rows,
        "settings": {"methods": ["mean"]},
        "source": {"kv_heads": 8},
    }


def _labelled_ticks(record: dict, tmp_path, monkeypatch) -> tuple[list[float], tuple[float, float]]:
    """The y values that carry a label in the drawn plot, and the axis' limits."""
    seen = {}
    save = plots._save

    def keep(fig, out):
        fig.canvas.draw()
        ax = fig.axes[0]
        low, high = ax.get_ylim()
        labelled = [
            t.get_position()[1]
            for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True)
            if t.get_text() and low <= t.get_position()[1] <= high
        ]
        seen.update(ticks=sorted(labelled), limits=(low, high))
        return save(fig, out)

    monkeypatch.setattr(plots, "_save", keep)
    sweep_plots.quality_plot(record, tmp_path / "q.png")
    return seen["ticks"], seen["limits"]


@pytest.mark.parametrize(
    "parent, candidates",
    [(244.9, [310.0, 2400.0, 19800.0]), (130.6, [131.2, 133.0, 139.9]), (33.0, [116.0, 900.0, 13593.0])],
    ids=["wide", "narrow", "real-model"],
)
def test_labelled_ticks_cover_every_point(tmp_path, monkeypatch, parent, candidates):
    ticks, (low, high) = _labelled_ticks(_record(parent, candidates), tmp_path, monkeypatch)
    assert ticks[0] <= parent and ticks[-1] >= max(candidates), (ticks, low, high)
    assert 2 <= len(ticks) <= 8 and low <= min(ticks) and max(ticks) <= high


def test_log_ticks_are_round_and_few():
    assert sweep_plots.log_ticks(244.9, 20000) == [200, 500, 1000, 2000, 5000, 10000, 20000]
    assert sweep_plots.log_ticks(130.6, 139.9) == [130, 140]
    assert sweep_plots.log_ticks(0.5, 0.9) == [0.5, 0.6, 0.7, 0.8, 0.9]
    assert len(sweep_plots.log_ticks(1.5, 1e9)) <= 8


def test_the_plot_names_the_tokens_the_parent_and_candidates_were_scored_on(tmp_path, monkeypatch):
    record = _record(244.9, [310.0, 2400.0, 19800.0])
    record["parent"]["result"] = {
        "data": {"source": "file", "path": "/d/persuasion.txt", "ids_sha256": "abc"},
        "perplexity": {"perplexity": 244.9, "tokens_scored": 8191, "context": 512, "stride": 256},
    }
    titles = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, out: titles.append(fig.axes[0].get_title()) or save(fig, out))
    sweep_plots.quality_plot(record, tmp_path / "q.png")
    assert (
        titles[0].splitlines()[1] == "perplexity on 8,191 tokens of persuasion.txt, windows of 512 tokens, stride 256"
    )
