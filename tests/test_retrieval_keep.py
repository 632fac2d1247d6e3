"""convert --keep-retrieval-heads (convert/retrieval_keep.py): the parent's retrieval heads scored, the kv heads
they read weighted in the merge and spread over the groups, the record, and the refusals."""

import json
from types import SimpleNamespace

import pytest
import torch
from click.testing import CliRunner
from tiny_models import make_tiny_tokenizer, save_tiny_model

from mha2gqa.architecture.layouts import AttentionShape
from mha2gqa.cli import main as cli
from mha2gqa.convert import retrieval_keep
from mha2gqa.convert.calibrated import calibrated_layer
from mha2gqa.convert.layer_step import transform_layer
from mha2gqa.convert.methods import METHODS, LayerContext, mean_layer
from mha2gqa.convert.options import Grouping, Method
from mha2gqa.convert.retrieval_keep import KeptHeads, spread_order
from mha2gqa.scoring import retrieval_heads

HD, D = 8, 32  # head_dim, hidden
SHAPE = AttentionShape("llama", layers=2, heads=8, kv_heads=4, head_dim=HD, hidden=D)


def _scores(*hot) -> torch.Tensor:
    """(2 layers, 8 query heads) scores of 0.02 with `hot` = ((layer, head, score), ...) set."""
    scores = torch.full((2, 8), 0.02)
    for layer, head, score in hot:
        scores[layer, head] = score
    return scores


def test_the_threshold_is_the_head_scorers():
    assert retrieval_keep.RETRIEVING == retrieval_heads.RETRIEVING


def test_each_kv_heads_mass_is_the_summed_score_of_the_retrieving_query_heads_it_serves():
    kept = KeptHeads(_scores((1, 0, 0.5), (1, 1, 0.25), (1, 5, 0.4), (1, 7, 0.05)), 4, (1, 1), 8.0, 48)
    # query head i reads kv head i // 2: heads 0 and 1 -> kv 0, head 5 -> kv 2; head 7's 0.05 is under 0.1
    torch.testing.assert_close(kept.masses(1), torch.tensor([0.75, 0, 0.4, 0], dtype=torch.float64))
    torch.testing.assert_close(kept.weights(1), torch.tensor([7.0, 1, 4.2, 1], dtype=torch.float64))
    assert kept.weights(0) is None  # a layer without retrieval heads merges as without the option
    assert kept.shared_layers() == [1]  # two retrieval kv heads, one group
    assert KeptHeads(kept.scores, 4, (1, 2), 8.0, 48).shared_layers() == []  # layer 1 has 2 groups
    record = kept.record()
    assert record["retrieving"] == 3 and record["heads"] == 16 and record["weight"] == 8.0
    assert record["found"][0] == {"layer": 1, "head": 0, "kv_head": 0, "score": 0.5}
    assert "in 1 layer (1) they read more kv heads than the 1 group: those share" in kept.summary_line()


def test_the_weighted_mean_leans_toward_the_retrieval_kv_head():
    gen = torch.Generator().manual_seed(0)
    roles = {"k.weight": torch.randn(4 * HD, D, generator=gen), "v.weight": torch.randn(4 * HD, D, generator=gen)}
    masses = torch.tensor([0.0, 0.5, 0.0, 0.0], dtype=torch.float64)
    plain = mean_layer(roles, LayerContext(SHAPE, 1, 0))
    weighted = mean_layer(roles, LayerContext(SHAPE, 1, 0, retrieval_masses=masses, retrieval_weight=8.0))
    heads = roles["k.weight"].reshape(4, HD, D)
    torch.testing.assert_close(plain["k.weight"], heads.mean(0))
    torch.testing.assert_close(weighted["k.weight"], (heads[0] + 5 * heads[1] + heads[2] + heads[3]) / 8)
    # weight 0: the masses spread the groups but weigh nothing
    zero = mean_layer(roles, LayerContext(SHAPE, 1, 0, retrieval_masses=masses, retrieval_weight=0.0))
    torch.testing.assert_close(zero["k.weight"], plain["k.weight"])


def _head_errors(w: torch.Tensor, out: torch.Tensor, maps: torch.Tensor, gram: torch.Tensor) -> list[float]:
    n = maps.shape[0]
    rebuilt = maps @ out.reshape(1, HD, -1).expand(n, HD, -1)
    diff = (w.reshape(n, HD, -1) - rebuilt).double()
    return [float(((d @ gram) * d).sum() / ((h @ gram) * h).sum()) for d, h in zip(diff, w.reshape(n, HD, -1).double())]


def test_the_calibrated_merge_weighted_keeps_the_retrieval_kv_heads_keys():
    """Keys fold into q_proj through each head's map; recovered from the folded queries, the retrieval kv head's
    keys are rebuilt almost exactly when it weighs far more than the others, and worse without the option."""
    from mha2gqa.convert.calibrated import _weighted, augment, merge_keys

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, D, generator=gen)
    xa = torch.cat([x, torch.ones(512, 1)], 1).double()
    gram = xa.T @ xa
    k = augment(torch.randn(4 * HD, D, generator=gen), None)
    for weights, bound in ((None, None), (torch.tensor([1.0, 1e6, 1.0, 1.0]), 1e-4)):
        shared, maps = _weighted(merge_keys, k, weights, gram, 1, HD, HD)
        errors = _head_errors(k, shared, maps, gram)
        if bound is None:
            assert errors[1] > 0.3  # four random heads in one: each loses much
        else:
            assert errors[1] < bound and min(errors[0], errors[2], errors[3]) > 0.3
    # the whole layer runs: the weighted merge is the calibrated method's when the context carries masses
    roles = {
        "q.weight": torch.randn(8 * HD, D, generator=gen),
        "k.weight": k[:, :-1].float(),
        "v.weight": torch.randn(4 * HD, D, generator=gen),
        "o.weight": torch.randn(D, 8 * HD, generator=gen),
    }
    stats = SimpleNamespace(gram=gram, rotary_dims=HD)
    masses = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    plain, _ = calibrated_layer(roles, LayerContext(SHAPE, 1, 0, stats=stats))
    kept, _ = calibrated_layer(
        roles, LayerContext(SHAPE, 1, 0, stats=stats, retrieval_masses=masses, retrieval_weight=8)
    )
    assert not torch.allclose(plain["k.weight"], kept["k.weight"])


def test_retrieval_kv_heads_are_spread_over_the_groups_where_contiguous_groups_would_merge_them():
    gen = torch.Generator().manual_seed(2)
    roles = {
        "q.weight": torch.randn(8 * HD, D, generator=gen),
        "k.weight": torch.randn(4 * HD, D, generator=gen),
        "v.weight": torch.randn(4 * HD, D, generator=gen),
        "o.weight": torch.randn(D, 8 * HD, generator=gen),
    }
    together = torch.tensor([0.6, 0.3, 0.0, 0.0], dtype=torch.float64)  # kv 0 and 1: one contiguous group
    ctx = LayerContext(SHAPE, 2, 0, retrieval_masses=together, retrieval_weight=8.0)
    out, report = transform_layer(METHODS[Method.MEAN], roles, ctx, Grouping.CONTIGUOUS)
    order = report["kv_order"]
    groups = [set(order[:2]), set(order[2:])]
    assert all(len(g & {0, 1}) == 1 for g in groups)  # one retrieval kv head per group
    # each new group leans toward its retrieval kv head: weights 1 + 8 x mass
    first = next(g for g in (order[:2], order[2:]) if 0 in g)
    other = first[1] if first[0] == 0 else first[0]
    heads = roles["k.weight"].reshape(4, HD, D)
    where = 0 if first == order[:2] else 1
    expected = (5.8 * heads[0] + heads[other]) / 6.8
    torch.testing.assert_close(out["k.weight"].reshape(2, HD, D)[where], expected)
    # already apart: transformers' order is kept
    assert spread_order(torch.tensor([0.6, 0.0, 0.3, 0.0], dtype=torch.float64), 2) is None
    _, report = transform_layer(
        METHODS[Method.MEAN], roles, LayerContext(SHAPE, 2, 0, retrieval_masses=torch.tensor([0.6, 0, 0.3, 0.0]))
    )
    assert "kv_order" not in report


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    root = tmp_path_factory.mktemp("keep")
    save_tiny_model(root / "p", "llama", num_key_value_heads=4, max_position_embeddings=512)
    make_tiny_tokenizer().save_pretrained(root / "p")
    return root / "p"


def _convert(parent, dst, *flags):
    run = CliRunner().invoke(cli, ["convert", str(parent), str(dst), "-g", "2", "--no-check", "-q", *flags])
    return run


def test_the_option_scores_the_parent_and_records_the_heads(parent, tmp_path):
    """The real scorer on the tiny parent: 48 questions of 128 and 512 tokens, the record in mha2gqa.json, the flag
    in the command that makes the model again."""
    run = _convert(parent, tmp_path / "d", "--keep-retrieval-heads")
    assert run.exit_code == 0, run.output
    # a random model copies nothing: no head retrieves, and the merge is the plain one, tensor for tensor
    assert "retrieval heads: none of the 16 query heads of SRC scores above 0.1 (48 questions)" in run.output
    record = json.loads((tmp_path / "d" / "mha2gqa.json").read_text())["lineage"][-1]
    kept = record["retrieval_heads"]
    assert kept["questions"] == 48 and kept["weight"] == 8.0 and kept["heads"] == 16
    assert kept["haystack"] == "northangerabbey" and kept["found"] == [] and kept["retrieving"] == 0
    assert "--keep-retrieval-heads" in record["command"]
    plain = _convert(parent, tmp_path / "plain")
    assert plain.exit_code == 0, plain.output
    assert json.loads((tmp_path / "plain" / "mha2gqa.json").read_text())["lineage"][-1]["retrieval_heads"] is None
    from safetensors.torch import load_file

    mine, theirs = load_file(tmp_path / "d" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_a_known_retrieval_head_moves_its_kv_head_into_a_group_of_its_own(parent, tmp_path, monkeypatch):
    """The tiny parent's heads as the scorer would find them if layer 1's query heads 0 and 2 (kv heads 0 and 1,
    one contiguous group) retrieved: they go to different groups, and the model written differs from the
    plain mean's."""

    def known(model, items, device, bar=False):
        return _scores((1, 0, 0.8), (1, 2, 0.6))

    monkeypatch.setattr(retrieval_heads, "head_scores", known)
    run = _convert(parent, tmp_path / "d", "--keep-retrieval-heads", "--retrieval-weight", "4")
    assert run.exit_code == 0, run.output
    record = json.loads((tmp_path / "d" / "mha2gqa.json").read_text())["lineage"][-1]
    found = record["retrieval_heads"]["found"]
    assert [(x["layer"], x["head"], x["kv_head"]) for x in found] == [(1, 0, 0), (1, 2, 1)]
    assert record["retrieval_heads"]["shared_layers"] == [] and record["retrieval_heads"]["weight"] == 4.0
    layer = {row["layer"]: row for row in record["layers"]}[1]
    assert {0, 1} & set(layer["kv_order"][:2]) and {0, 1} & set(layer["kv_order"][2:])
    assert "kv order" in run.output  # the terminal's table shows the layer regrouped
    monkeypatch.undo()
    plain = _convert(parent, tmp_path / "plain")
    from safetensors.torch import load_file

    mine, theirs = load_file(tmp_path / "d" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    assert torch.equal(mine["model.layers.0.self_attn.k_proj.weight"], theirs["model.layers.0.self_attn.k_proj.weight"])
    assert not torch.equal(
        mine["model.layers.1.self_attn.k_proj.weight"], theirs["model.layers.1.self_attn.k_proj.weight"]
    )
    assert plain.exit_code == 0


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--retrieval-weight", "2"], "--retrieval-weight needs --keep-retrieval-heads: add it"),
        (["--keep-retrieval-heads", "--retrieval-weight", "-1"], "--retrieval-weight -1.0 must be a finite number"),
        (["--keep-retrieval-heads", "--retrieval-weight", "nan"], "--retrieval-weight nan must be a finite number"),
        (["--keep-retrieval-heads", "--method", "first"], "--method first does not weigh: use --method mean"),
    ],
)
def test_bad_values_are_refused_and_nothing_is_written(parent, tmp_path, flags, words):
    run = _convert(parent, tmp_path / "d", *flags)
    assert run.exit_code == 2 and words in run.output, run.output
    assert "Traceback" not in run.output and not (tmp_path / "d").exists()


def test_a_parent_without_a_tokenizer_is_refused(parent, tmp_path):
    bare = tmp_path / "bare"
    save_tiny_model(bare, "llama", num_key_value_heads=4)
    run = _convert(bare, tmp_path / "d", "--keep-retrieval-heads")
    assert run.exit_code == 2 and "writes its questions with the source's tokenizer" in run.output, run.output
    assert not (tmp_path / "d").exists()
