"""Sliding-window perplexity: window edges, and equality with a hand computation token by token."""

import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, make_tiny_model

from mha2gqa.runtime.errors import InputError
from mha2gqa.scoring.perplexity import Window, perplexity, windows


def test_windows_overlapping_score_each_token_once():
    # 10 tokens, context 4, stride 2: each later window re-reads 2 tokens of context.
    assert windows(10, 4, 2) == [Window(0, 4, 3), Window(2, 6, 2), Window(4, 8, 2), Window(6, 10, 2)]


def test_windows_non_overlapping_leave_each_window_start_unscored():
    # stride == context: tokens 4 and 8 open a window and have nothing to be predicted from.
    assert windows(10, 4, 4) == [Window(0, 4, 3), Window(4, 8, 3), Window(8, 10, 1)]


def test_windows_short_text_and_ragged_end():
    assert windows(3, 8, 4) == [Window(0, 3, 2)]  # context longer than the text
    assert windows(11, 4, 3) == [Window(0, 4, 3), Window(3, 7, 3), Window(6, 10, 3), Window(9, 11, 1)]


@pytest.mark.parametrize("n,context,stride", [(50, 16, 5), (37, 8, 8), (64, 64, 32), (23, 6, 1)])
def test_every_target_scored_exactly_once_unless_it_opens_a_window(n, context, stride):
    covered = []
    for w in windows(n, context, stride):
        assert w.end - w.start <= context
        covered += range(w.end - w.scored, w.end)
    unscored_by_design = {k * stride for k in range(1, n) if stride == context and k * stride < n}
    assert sorted(covered) == [p for p in range(1, n) if p not in unscored_by_design]


@pytest.mark.parametrize("context,stride", [(1, 1), (8, 0), (8, 9)])
def test_bad_window_settings_are_refused(context, stride):
    with pytest.raises(InputError, match="--(context|stride)"):
        windows(20, context, stride)


def _window_start_for(p: int, context: int, stride: int) -> int:
    """Independent of `windows`: the first window (start k*stride) whose end is past p."""
    k = 0
    while k * stride + context <= p:
        k += 1
    return k * stride


def _hand_perplexity(model, ids, context, stride):
    """Each target token predicted from its own prefix inside its window: one forward per token."""
    nll, count = 0.0, 0
    for p in range(1, ids.numel()):
        start = _window_start_for(p, context, stride)
        if start == p:  # opens a non-overlapping window: no in-window context
            continue
        with torch.no_grad():
            logits = model(ids[start:p].unsqueeze(0)).logits[0, -1]  # (V,)
        nll -= F.log_softmax(logits.double(), -1)[ids[p]].item()
        count += 1
    return math.exp(nll / count), count


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", seed=3)


@pytest.mark.parametrize("n,context,stride", [(29, 8, 3), (20, 6, 6), (12, 32, 16), (25, 7, 1)])
def test_perplexity_equals_hand_computation(model, n, context, stride):
    ids = torch.randint(4, VOCAB, (n,), generator=torch.Generator().manual_seed(n))
    got = perplexity(model, ids, context, stride)
    want, count = _hand_perplexity(model, ids, context, stride)
    assert got["tokens_scored"] == count
    assert got["perplexity"] == pytest.approx(want, rel=1e-5)
    assert (got["context"], got["stride"]) == (context, stride)


def test_perplexity_does_not_depend_on_batch_size_and_is_deterministic(model):
    ids = torch.randint(4, VOCAB, (61,), generator=torch.Generator().manual_seed(1))
    one = perplexity(model, ids, 16, 4, batch_size=1)
    many = perplexity(model, ids, 16, 4, batch_size=5)
    assert many["tokens_scored"] == one["tokens_scored"] == 60
    assert many["perplexity"] == pytest.approx(one["perplexity"], rel=1e-6)
    assert perplexity(model, ids, 16, 4, batch_size=1) == one
