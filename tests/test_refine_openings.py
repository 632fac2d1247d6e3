"""refine's openings (convert/refine/buffers.py Openings): short sequences whose first tokens cover the vocabulary,
fitted beside the blocks in both stages and counted in the global stage's held-out measure, so that the child
keeps the parent's first-position state (the attention sink) whatever token a window opens with."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from mha2gqa.convert.inputs import OPENING_LENGTH, OPENINGS_PER_STEP, RefineBudget, opening_count
from mha2gqa.convert.refine import RefineOptions
from mha2gqa.convert.refine.buffers import opening_sequences
from mha2gqa.convert.refine.global_stage import ParentTargets, heldout_kl
from mha2gqa.convert.run import convert
from mha2gqa.runtime.errors import InputError
from mha2gqa.scoring.kl import kl_divergence

TEXT = torch.arange(1000, 1400)  # ids a vocabulary of 50,000 mostly lacks: a drawn first token stands out


def test_openings_open_on_any_token_and_continue_with_text():
    openings = opening_sequences(TEXT, 50_000, seed=0, count=64)
    rows = openings.ids
    assert rows.shape == (64, OPENING_LENGTH)
    tails = rows[:, 1:]  # every row's rest is a run of the text, at its own place
    assert bool((tails[:, 1:] - tails[:, :-1] == 1).all()) and bool(((tails >= 1000) & (tails < 1400)).all())
    assert len({int(t) for t in tails[:, 0]}) > 32  # places spread over the text
    drawn, natural = rows[0::2, 0], rows[1::2, 0]
    assert bool(((natural >= 1000) & (natural < 1400)).all())  # half open on the text's own token there
    assert bool((natural == tails[1::2, 0] - 1).all())
    assert int(((drawn < 1000) | (drawn >= 1400)).sum()) >= 28  # half on a token drawn from the whole vocabulary
    assert len(openings.split["heldout"]) == 8 and len(openings.split["fit"]) == 56
    assert openings.per_step == 56  # at most OPENINGS_PER_STEP, never more than the fit set
    assert torch.equal(rows, opening_sequences(TEXT, 50_000, seed=0, count=64).ids)
    assert not torch.equal(rows, opening_sequences(TEXT, 50_000, seed=1, count=64).ids)


def test_the_opening_count_follows_the_blocks_and_the_plan_costs_them():
    assert opening_count(36_864) == 576 and opening_count(64) == 16
    budget = RefineBudget(512, 36_864, blocks=72, heldout_blocks=9)
    assert budget.openings == 576 and budget.opening_tokens == 576 * OPENING_LENGTH
    assert budget.opening_tokens_per_step == 64 * OPENING_LENGTH
    assert budget.heldout_tokens == 9 * 512 + 72 * OPENING_LENGTH  # the last 1/8 of the openings held out too


@pytest.mark.parametrize("steps, checks", [(48, 6), (40, 5), (9, 2), (1, 2), (0, 0)])
def test_the_plan_counts_the_global_stages_checks_and_their_forwards(steps, checks):
    """The start's check, one every 10 steps and the last step's; both models at the first, the converted model alone
    at the rest while the parent's logits fit the memory (9,216 + 1,152 held-out tokens x 49,152 x 4 B = 1.90 GiB)."""
    budget = RefineBudget(512, 73_728, blocks=144, heldout_blocks=18)
    assert budget.heldout_tokens == 10_368 and budget.global_heldout_evals(steps) == checks
    if steps:
        assert budget.global_heldout_forwards(steps, 49_152, 2 << 30) == 10_368 * (2 + (checks - 1))
        assert budget.global_heldout_forwards(steps, 49_152, 1 << 30) == 10_368 * 2 * checks


def test_the_global_stages_heldout_measure_counts_the_openings(tiny_src):
    parent, child, blocks = parent_child_and_blocks(tiny_src)
    vocab = parent.config.vocab_size
    openings = opening_sequences(blocks.reshape(-1), vocab, seed=0, count=16)
    heldout = torch.tensor([3])
    alone = heldout_kl(parent, child, blocks, heldout)
    counted = heldout_kl(parent, child, blocks, heldout, openings)
    assert alone > 0 and counted > alone
    assert heldout_kl(parent, parent, blocks, heldout, openings) < 1e-6
    quarter = heldout_kl(parent, child, blocks, heldout, replace(openings, weight=0.25))
    assert quarter == pytest.approx(alone + 0.25 * (counted - alone), rel=1e-6)
    assert heldout_kl(parent, child, blocks, heldout, replace(openings, weight=0.0)) == pytest.approx(alone)


def test_refine_fits_the_openings_and_records_them(tmp_path, tiny_src, calibration_file):
    record = convert(
        tiny_src,
        tmp_path / "dst",
        1,
        method="mean",
        calibration=calibration_file,
        calibration_tokens=1024,
        refine=RefineOptions(steps=30, lr=3e-3, batch_blocks=4, global_steps=0),
        check=False,
        progress=False,
    ).refine
    opened = record["openings"]
    blocks = (record["fit_tokens"] + record["heldout_tokens"]) // record["sequence_length"]
    assert opened == {
        "sequences": opening_count(blocks * 64),
        "length": 8,
        "heldout": 2,
        "per_step": 14,
        "weight": 0.25,
    }
    layers = [layer for layer in record["layers"] if "kept_merged" not in layer]
    assert layers  # the mean-pooled start is far from exact: every layer has something to fit
    for layer in layers:
        assert layer["opening_heldout_error_after"] < layer["opening_heldout_error_before"], layer


def _layer_errors(tmp_path, tiny_src, calibration_file, weight: float) -> tuple[float, float]:
    """The sums over layers of the held-out error after the layer-wise fit: (blocks, openings)."""
    record = convert(
        tiny_src,
        tmp_path / f"w{weight}",
        1,
        method="mean",
        calibration=calibration_file,
        calibration_tokens=1024,
        refine=RefineOptions(steps=30, lr=3e-3, batch_blocks=4, global_steps=0, opening_weight=weight),
        check=False,
        progress=False,
    ).refine
    assert record["openings"]["weight"] == weight
    layers = record["layers"]
    return sum(r["heldout_error_after"] for r in layers), sum(r["opening_heldout_error_after"] for r in layers)


def test_the_opening_weight_trades_the_openings_against_the_blocks(tmp_path, tiny_src, calibration_file):
    """Weight 0: the openings are measured, not fitted; weighted, they are fitted closer (on held-out openings: 14
    fit openings on this tiny model are overfitted from a weight of about 4) and the blocks less."""
    unweighted, weighted, heavy = (_layer_errors(tmp_path, tiny_src, calibration_file, w) for w in (0.0, 1.0, 8.0))
    assert weighted[1] < 0.8 * unweighted[1]
    assert unweighted[0] < heavy[0]


@pytest.mark.parametrize("weight", [-0.5, float("nan"), float("inf"), "1", True])
def test_a_bad_opening_weight_is_refused_naming_the_flag(weight):
    with pytest.raises(InputError, match=r"--refine-opening-weight .* must be a finite number, 0 or more"):
        RefineOptions(opening_weight=weight).validate()


def test_the_heldout_openings_are_measured_a_step_of_rows_at_a_time(tiny_src):
    """Many held-out openings (a large --refine-tokens) are run OPENINGS_PER_STEP rows at a time, so the logits
    held at once do not grow with the tokens, and the mean KL over their positions is the one of all at once."""
    parent, child, blocks = parent_child_and_blocks(tiny_src)
    vocab = parent.config.vocab_size
    openings = replace(opening_sequences(blocks.reshape(-1), vocab, seed=0, count=1200), weight=1.0)
    held = openings.split["heldout"]
    assert len(held) == 150  # three batches: 64, 64, 22
    rows_seen = []
    measured = heldout_kl(Counting(parent, rows_seen), Counting(child, rows_seen), blocks, torch.tensor([3]), openings)
    block_kl = heldout_kl(parent, child, blocks, torch.tensor([3]))
    with torch.no_grad():
        rows = openings.ids[held]
        at_once = float(kl_divergence(parent(rows, use_cache=False).logits, child(rows, use_cache=False).logits))
    assert measured - block_kl == pytest.approx(at_once, rel=1e-5)
    assert sorted(rows_seen[2:]) == sorted([OPENINGS_PER_STEP, OPENINGS_PER_STEP, 22] * 2)  # after the block's 1+1


@pytest.mark.parametrize("memory, parent_forwards", [(1 << 30, 1 + 3), (1000, 2 * (1 + 3))])
def test_the_parents_heldout_logits_are_kept_between_checks_when_they_fit(tiny_src, memory, parent_forwards):
    """Two checks: within --refine-memory the parent runs at the first only (its held-out block, its three batches of
    openings), over it at both; the KL is the same to the bit either way, and the same as without ParentTargets."""
    parent, child, blocks = parent_child_and_blocks(tiny_src)
    openings = replace(opening_sequences(blocks.reshape(-1), parent.config.vocab_size, seed=0, count=1200), weight=1.0)
    parent_rows, child_rows = [], []
    counted_parent, counted_child = Counting(parent, parent_rows), Counting(child, child_rows)
    targets = ParentTargets(counted_parent, memory)
    first, second = (
        heldout_kl(counted_parent, counted_child, blocks, torch.tensor([3]), openings, targets) for _ in "ab"
    )
    assert len(parent_rows) == parent_forwards and len(child_rows) == 2 * (1 + 3)
    assert targets.keep == (memory == 1 << 30)
    assert first == second == heldout_kl(parent, child, blocks, torch.tensor([3]), openings)
    held_positions = 32 + 150 * OPENING_LENGTH
    assert targets.positions == held_positions
    assert sum(t.numel() for t in targets.kept.values()) == (
        held_positions * parent.config.vocab_size if targets.keep else 0
    )


def parent_child_and_blocks(src):
    """The tiny model, a copy with one layer's v_proj halved, and 4 blocks of 32 random tokens."""
    parent = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    child = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        child.model.layers[0].self_attn.v_proj.weight.mul_(0.5)
    blocks = torch.randint(parent.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    return parent, child, blocks


class Counting(torch.nn.Module):
    """A model that notes how many rows each forward was given."""

    def __init__(self, model, seen: list):
        super().__init__()
        self.model, self.seen = model, seen

    def forward(self, ids, **kwargs):
        self.seen.append(len(ids))
        return self.model(ids, **kwargs)
