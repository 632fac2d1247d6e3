"""Calibration statistics and data, mean-norm, and the convert CLI's calibration flags."""

import pytest
import torch
from calibrated_models import write_calibration_text
from click.testing import CliRunner
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model

from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config
from mha2gqa.cli import main
from mha2gqa.convert.calibration import GramAccumulator, collect_statistics, load_source_model
from mha2gqa.convert.methods import LayerContext, mean_layer, mean_norm_layer
from mha2gqa.corpus import textdata
from mha2gqa.corpus.calibration import resolve_calibration, text_ids
from mha2gqa.files import embedded
from mha2gqa.records.provenance import latest
from mha2gqa.runtime.errors import InputError


def test_gram_accumulates_identically_in_one_pass_or_in_chunks():
    x = torch.randn(3, 50, 16, generator=torch.Generator().manual_seed(0))
    whole, pieces = GramAccumulator(16), GramAccumulator(16)
    whole.add(x)
    for chunk in torch.cat([x[0], x[1], x[2]]).split([1, 37, 60, 52]):
        pieces.add(chunk)
    torch.testing.assert_close(pieces.gram, whole.gram)
    ones = torch.cat([x.reshape(-1, 16).double(), torch.ones(150, 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(whole.gram, ones.T @ ones)
    assert whole.gram[-1, -1] == 150


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "llama"
    save_tiny_model(path, "llama")
    make_tiny_tokenizer(path)
    config = read_config(path)
    return path, layout_for(config), attention_shape(config)


def test_statistics_do_not_depend_on_batching_or_layer_slices(tiny, tmp_path):
    path, layout, shape = tiny
    model = load_source_model(path, "cpu")
    ids = torch.randint(4, 128, (700,), generator=torch.Generator().manual_seed(0))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    one = collect_statistics(model, layout, shape, ids, tmp_path / "a", 8, seq_len=128, batch_size=8, progress=False)
    # one sequence per batch, one layer per pass: (64+1)^2 * 8 bytes hold one layer
    sliced = collect_statistics(
        model,
        layout,
        shape,
        ids,
        tmp_path / "b",
        8,
        seq_len=128,
        batch_size=1,
        memory_bytes=65 * 65 * 8,
        progress=False,
    )
    assert one.record["passes"] == 1 and sliced.record["passes"] == 2
    for layer in range(shape.layers):
        torch.testing.assert_close(sliced.layer(layer).gram, one.layer(layer).gram)
        assert one.layer(layer).tokens == 700
    # layer 0's attention input, computed directly: input_layernorm of the embeddings, block by block
    with torch.no_grad():
        blocks = [
            model.model.layers[0].input_layernorm(model.model.embed_tokens(block[None]))[0] for block in ids.split(128)
        ]
    x = torch.cat(blocks).double()
    x1 = torch.cat([x, torch.ones(len(x), 1, dtype=torch.float64)], dim=1)
    torch.testing.assert_close(one.layer(0).gram, x1.T @ x1, rtol=1e-6, atol=1e-6)


def test_calibration_text_ids_take_the_first_n_tokens_and_austen_is_available():
    tokenizer = make_tiny_tokenizer()
    ids = text_ids(tokenizer, iter([SAMPLE_TEXT, SAMPLE_TEXT]), 50)
    assert ids.shape == (50,) and ids.tolist() == tokenizer(SAMPLE_TEXT, add_special_tokens=False)["input_ids"][:50]
    austen = textdata.resolve("--calibration", embedded.expand_corpus_name("austen"))
    assert len(text_ids(tokenizer, textdata.iter_texts(austen, piece_chars=1 << 16), 2000)) == 2000
    with pytest.raises(InputError, match="--calibration-tokens 0 must be at least 1"):
        resolve_calibration("austen", 0, 512)


def test_mean_norm_rescales_each_pooled_head_to_its_group_mean_norm(tiny):
    _, _, shape = tiny
    gen = torch.Generator().manual_seed(0)
    roles = {
        "k.weight": torch.randn(64, 64, generator=gen),
        "k.bias": torch.randn(64, generator=gen),
        "v.weight": torch.randn(64, 64, generator=gen),
    }
    ctx = LayerContext(shape, groups=2, layer=0)
    pristine = {name: tensor.clone() for name, tensor in roles.items()}
    out, mean = mean_norm_layer(roles, ctx), mean_layer(roles, ctx)
    for name, tensor in pristine.items():  # methods must leave the source tensors alone (fp32 views!)
        assert torch.equal(roles[name], tensor), f"mean/mean-norm modified the source's {name} in place"
    for names in (["k.weight", "k.bias"], ["v.weight"]):

        def head_norms(tensors, heads, names=names):
            return sum(tensors[n].reshape(heads, -1).pow(2).sum(1) for n in names).sqrt()

        torch.testing.assert_close(head_norms(out, 2), head_norms(roles, 8).reshape(2, 4).mean(1))
        assert (head_norms(out, 2) > 1.5 * head_norms(mean, 2)).all()  # random heads: the mean shrinks ~1/sqrt(4)
        cosine = torch.nn.functional.cosine_similarity(out[names[0]].reshape(2, -1), mean[names[0]].reshape(2, -1))
        torch.testing.assert_close(cosine, torch.ones(2))  # same direction as the mean
    # identical heads within each group: mean-norm is the mean is any one of them
    same = {
        name: torch.cat([roles[name][:8].repeat(4, 1), roles[name][8:16].repeat(4, 1)])
        for name in ("k.weight", "v.weight")
    }
    torch.testing.assert_close(mean_norm_layer(same, ctx)["k.weight"], roles["k.weight"][:16])


def test_cli_prints_per_layer_errors_and_records_them(tiny, tmp_path):
    path, _, _ = tiny
    cal = write_calibration_text(tmp_path / "cal.txt")
    result = CliRunner().invoke(
        main,
        [
            "convert",
            str(path),
            str(tmp_path / "dst"),
            "-g",
            "2",
            "--method",
            "calibrated",
            "--calibration",
            str(cal),
            "--calibration-tokens",
            "300",
            "-q",
        ],
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].split() == ["layer", "key", "error", "value", "error"]
    assert [line.split()[0] for line in lines[2:4]] == ["0", "1"]
    errors = [float(x) for x in lines[2].split()[1:]]
    record = latest(tmp_path / "dst", "conversion")
    assert [round(record["layers"][0][k], 4) for k in ("key_error", "value_error")] == errors
    assert record["calibration"]["data"] == str(cal) and record["calibration"]["tokens"] == 300
    assert any("by calibrated" in line for line in lines[4:])  # the summary; the check's verdict follows it


def test_cli_calibrated_without_data_plans_the_parents_samples(tiny, tmp_path):
    path, _, _ = tiny
    result = CliRunner().invoke(
        main, ["convert", str(path), str(tmp_path / "dst"), "-g", "2", "--method", "calibrated", "--dry-run"]
    )
    assert result.exit_code == 0, result.output
    assert "stage 1: sample:" in result.output and "tokens sampled from SRC" in result.output
    assert not (tmp_path / "dst").exists()
    result = CliRunner().invoke(main, ["convert", "--help"])
    for flag in (
        "--calibration ",
        "--calibration-tokens",
        "--calibration-memory",
        "--grouping",
        "mean-norm",
        "calibrated",
    ):
        assert flag in result.output
