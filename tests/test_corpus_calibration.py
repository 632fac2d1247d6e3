"""The one calibration read (corpus/calibration.py) and the one mix builder (corpus/blocks.mix_blocks).

The mix orders are pinned as the corpus hashes are (tests/test_corpus_blocks.py): each order's bytes on fixed
parts, computed with the code before the orders were named (blocks.interleave for SPREAD, torch.cat for
uptrain's pool, IN_TURN; the code at 485a012), so that naming them changed no byte."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch

import mha2gqa
from mha2gqa.corpus.blocks import MixOrder, mix_blocks, spread
from mha2gqa.corpus.calibration import read_calibration, resolve_calibration, text_files
from mha2gqa.corpus.mix import renamed
from mha2gqa.files import embedded


def _parts(counts=(7, 3, 2, 1), seq_len=16) -> list[torch.Tensor]:
    """Blocks whose every id says its part and place: part p's ids start at 1000 p."""
    return [torch.arange(n * seq_len, dtype=torch.long).view(n, seq_len) + 1000 * p for p, n in enumerate(counts)]


def _sha(blocks: torch.Tensor) -> str:
    return hashlib.sha256(f"{tuple(blocks.shape)} {blocks.dtype};".encode() + blocks.numpy().tobytes()).hexdigest()


BEFORE = {  # the code at 485a012: blocks.interleave(_parts()) and torch.cat(_parts())
    MixOrder.SPREAD: "79affd2da28ae6a37c95481633d07bfaf8c85fe778010cf4117d8a899c7c27b9",
    MixOrder.IN_TURN: "b1b7f192eb4eb5b8935b93d10ec44618bf65768f92e33576882cadf393cd5bbc",
}


@pytest.mark.parametrize("order", list(MixOrder), ids=lambda order: order.name)
def test_each_mix_order_makes_the_bytes_it_made_before_it_was_named(order):
    assert set(BEFORE) == set(MixOrder)  # a new order comes with its pin
    assert _sha(mix_blocks(_parts(), order)) == BEFORE[order]


def test_the_spread_order_spreads_each_part_and_the_in_turn_order_keeps_them_whole():
    # 6 blocks of a at (i + 0.5) / 6, 2 of b at 0.25 and 0.75: each b after the a it ties with
    assert [part for part, _ in spread([6, 2])] == [0, 0, 1, 0, 0, 0, 1, 0]
    mixed = mix_blocks(_parts((2, 1)), MixOrder.IN_TURN)
    assert (mixed[:, 0] // 1000).tolist() == [0, 0, 1]
    assert mix_blocks(_parts((0,)), MixOrder.SPREAD).shape == (0, 16)


def test_a_text_calibration_never_loads_the_parent(tmp_path, tiny_src):
    (tmp_path / "a.txt").write_text("alpha beta gamma delta. " * 400)

    def no_parent():
        raise AssertionError("a calibration of text alone loaded the parent")

    ids, record = read_calibration(resolve_calibration(str(tmp_path / "a.txt"), 200, 64), tiny_src, 0, no_parent)
    assert len(ids) == 200 and record["parts"][0]["files"] == [str(tmp_path / "a.txt")] and "sampling" not in record


def test_the_parents_samples_load_it_once_and_need_a_loader(tmp_path, tiny_src):
    from mha2gqa.convert.calibration import load_source_model

    (tmp_path / "a.txt").write_text("alpha beta gamma delta. " * 400)
    calibration = resolve_calibration({"parent": 1, str(tmp_path / "a.txt"): 1}, 256, 64)
    with pytest.raises(ValueError, match="read_calibration needs load_parent"):
        read_calibration(calibration, tiny_src, progress=False)
    loads = []

    def load():
        loads.append(1)
        return load_source_model(tiny_src, "cpu", progress=False)

    ids, record = read_calibration(calibration, tiny_src, 0, load, progress=False)
    again, _ = read_calibration(calibration, tiny_src, 0, load, progress=False)
    assert loads == [1, 1] and len(ids) == 256 and torch.equal(ids, again)
    assert [p["name"] for p in record["parts"]] == ["parent", str(tmp_path / "a.txt")]
    assert record["sampling"]["seed"] == 0 and record["sampling"]["device"] == "cpu"


def test_the_notation_helpers_read_a_spec_as_the_resolver_does(tmp_path):
    novels = [str(p) for p in embedded.train_paths()]
    assert text_files(["parent:0.5", "austen:0.5"]) == novels
    assert text_files("parent") == []
    assert renamed(["parent:0.5", "a.txt:50%"], str.upper, "calibration") == ["PARENT:0.5", "A.TXT:0.5"]
    assert renamed(["a.txt", "b.txt"], str.upper, "calibration") == ["A.TXT", "B.TXT"]


# Reading a calibration spec: its notation parsed, 'austen' expanded, its text tokenized. corpus/ owns it.
READS_A_SPEC = re.compile(r"(?<!def )\b(parse_spec|expand_corpus_name|first_ids)\(|def read_ids\(")
LEFT = {"uptrain/data_spec.py": "data.train, a recipe's own mix of texts, read by uptrain (no calibration)"}


def test_no_package_module_outside_corpus_reads_a_calibration_spec():
    package = Path(mha2gqa.__file__).parent
    found = {
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if not path.relative_to(package).parts[0] == "corpus" and READS_A_SPEC.search(path.read_text())
    }
    assert found == set(LEFT), "read a calibration spec with mha2gqa.corpus.calibration"
    assert READS_A_SPEC.search("    pairs = parse_spec(out['calibration'], 'calibration')")  # the shapes it finds
    assert not READS_A_SPEC.search("def expand_corpus_name(spec, flag):")  # the helper's own definition
