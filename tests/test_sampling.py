"""The parent's samples (`--calibration parent`): the chat-turn header read from the tokenizer's template,
the share of sequences that open with it, interleaved with the random starts, and the same ids for the
same seed."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from mha2gqa.corpus.sampling import SamplingRecipe, chat_turn_header, sample_ids

USER_TURN = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def parent_and_tokenizer(tiny_src):
    from tiny_models import make_tiny_tokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_src, dtype=torch.float32).eval()
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = USER_TURN
    return model, tokenizer


def test_the_chat_turn_header_is_what_the_template_writes_before_the_request(parent_and_tokenizer):
    _, tokenizer = parent_and_tokenizer
    header = chat_turn_header(tokenizer, seq_len=64)
    assert tokenizer.decode(header).replace(" ", "").replace("▁", "") == "<s>user:"
    assert chat_turn_header(tokenizer, seq_len=len(header) * 4 - 1) is None  # longer than a quarter of a block


@pytest.mark.parametrize("template", [None, "{{ raise_exception('no lone user turns') }}", "{{ 'fixed text' }}"])
def test_no_template_a_failing_one_or_one_without_the_request_gives_no_header(parent_and_tokenizer, template):
    from tiny_models import make_tiny_tokenizer

    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = template
    assert chat_turn_header(tokenizer, seq_len=64) is None


def test_a_share_of_the_sequences_open_with_the_header_spread_among_the_random_starts(parent_and_tokenizer):
    model, tokenizer = parent_and_tokenizer
    header = chat_turn_header(tokenizer, 32)
    recipe = SamplingRecipe(batch=3, chat_share=0.25)
    ids = sample_ids(model, tokenizer, tokens=8 * 32, seq_len=32, seed=0, recipe=recipe, progress=False)
    rows = ids.view(8, 32)
    opens = [bool(torch.equal(row[: len(header)], header)) for row in rows]
    # 2 of 8 are chat turns, placed as calibration mixes place their parts: at (i + 0.5) / n of the run
    assert [i for i, o in enumerate(opens) if o] == [2, 6]
    assert all(int(token) not in tokenizer.all_special_ids for row in rows[[0, 1, 3, 4, 5, 7]] for token in row[:1])
    again = sample_ids(model, tokenizer, tokens=8 * 32, seq_len=32, seed=0, recipe=recipe, progress=False)
    other = sample_ids(model, tokenizer, tokens=8 * 32, seq_len=32, seed=1, recipe=recipe, progress=False)
    assert torch.equal(ids, again) and not torch.equal(ids, other)


def test_without_a_template_or_with_share_0_every_sequence_starts_at_random(parent_and_tokenizer):
    model, tokenizer = parent_and_tokenizer
    header = chat_turn_header(tokenizer, 32)
    plain = sample_ids(model, tokenizer, 4 * 32, 32, 0, SamplingRecipe(chat_share=0.0), progress=False)
    assert not any(torch.equal(row[: len(header)], header) for row in plain.view(4, 32))


def test_the_nucleus_is_drawn_from_the_narrow_rows_candidates_and_the_wide_rows_full_sort():
    from mha2gqa.corpus.sampling import NUCLEUS_CANDIDATES, nucleus_draw

    vocab = 4 * NUCLEUS_CANDIDATES
    probs = torch.full((3, vocab), 0.02 / (vocab - 2))
    probs[0, [7, 9]] = torch.tensor([0.70, 0.28])  # a nucleus of two tokens
    probs[1] = 1.0 / vocab  # flat: its nucleus (95% of the vocabulary) is wider than the candidates
    probs[2, [5, 3000]] = torch.tensor([0.28, 0.70])
    logits = probs.log().repeat(200, 1)  # 200 draws of each row in one batch
    recipe = SamplingRecipe()
    chosen = nucleus_draw(logits, recipe, torch.Generator().manual_seed(0)).view(200, 3)
    assert set(chosen[:, 0].tolist()) == {7, 9} and set(chosen[:, 2].tolist()) == {5, 3000}
    assert 0.55 < (chosen[:, 0] == 7).float().mean() < 0.85  # in proportion to the parent's probabilities
    assert len(set(chosen[:, 1].tolist())) > 150 and chosen[:, 1].max() >= NUCLEUS_CANDIDATES  # the whole vocabulary
    assert torch.equal(chosen.view(-1), nucleus_draw(logits, recipe, torch.Generator().manual_seed(0)))
