"""Agreement with a reference: KL(reference || model) and top-1 agreement."""

import pytest
import torch
import torch.nn.functional as F
from tiny_models import VOCAB, make_tiny_model

from mha2gqa.runtime.errors import InputError
from mha2gqa.scoring.agreement import agreement
from mha2gqa.scoring.perplexity import perplexity

IDS = torch.randint(4, VOCAB, (40,), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def models():
    return make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1, num_key_value_heads=2)


def test_model_against_itself_has_zero_kl_and_full_agreement(models):
    model, _ = models
    agree, ppl, ref_ppl = agreement(model, model, IDS, context=16, stride=8)
    assert agree["kl_mean"] == pytest.approx(0.0, abs=1e-7)
    assert agree["top1_agreement"] == 1.0
    assert agree["tokens"] == 39
    assert ppl["perplexity"] == ref_ppl["perplexity"]


def test_kl_and_agreement_against_another_model_match_a_direct_computation(models):
    model, reference = models
    agree, ppl, ref_ppl = agreement(model, reference, IDS, context=40, stride=20)  # one window: all 39 targets
    with torch.no_grad():
        logp = F.log_softmax(model(IDS[None]).logits[0, :-1].double(), -1)  # (39, V)
        ref_logp = F.log_softmax(reference(IDS[None]).logits[0, :-1].double(), -1)
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
    top1 = (logp.argmax(-1) == ref_logp.argmax(-1)).double().mean().item()
    assert kl > 1e-4
    assert agree["kl_mean"] == pytest.approx(kl, rel=1e-4)
    assert agree["top1_agreement"] == pytest.approx(top1)
    # The same pass also gives both perplexities, equal to separate runs.
    assert ppl["perplexity"] == pytest.approx(perplexity(model, IDS, 40, 20)["perplexity"], rel=1e-6)
    assert ref_ppl["perplexity"] == pytest.approx(perplexity(reference, IDS, 40, 20)["perplexity"], rel=1e-6)


def test_reference_with_another_vocabulary_is_refused(models):
    model, _ = models
    other = make_tiny_model("llama", vocab_size=VOCAB * 2)
    with pytest.raises(InputError, match="vocab_size=256"):
        agreement(model, other, IDS, 16, 8)
