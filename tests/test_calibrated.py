"""The calibrated merge: exact where the source's heads are foldable copies, never worse than mean-pooling
on the calibration data, and its key maps commute with RoPE."""

import pytest
import torch
from calibrated_models import commuting_map, save_redundant_model, write_calibration_text
from tiny_models import make_tiny_tokenizer, save_tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from mha2gqa.convert.calibrated import fold_queries, merge_keys, merge_values, projection_gram, relative_error
from mha2gqa.convert.run import convert
from mha2gqa.records.provenance import latest
from mha2gqa.runtime.errors import InputError

F64 = torch.float64


def logits(model_dir, ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def ids_for_test(seed=1):
    return torch.randint(4, 128, (2, 48), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def calibration_file(tmp_path_factory):
    return write_calibration_text(tmp_path_factory.mktemp("cal") / "cal.txt")


# (model_type, overrides, groups): full RoPE with biases, head_dim from config, partial rotary (phi,
# stablelm), fused qkv (phi3), a GQA source (kv 4 -> 2), MQA (kv 8 -> 1).
CASES = [
    ("llama", {}, 2),
    ("llama", {"num_key_value_heads": 4}, 2),
    ("llama", {}, 1),
    ("qwen2", {}, 4),
    ("gemma", {}, 2),
    ("gemma2", {}, 2),
    ("mistral", {}, 2),
    ("phi", {}, 2),
    ("phi3", {}, 2),
    ("stablelm", {"qk_layernorm": False}, 2),
]


@pytest.mark.parametrize(
    "model_type,overrides,groups",
    CASES,
    ids=[f"{c[0]}-{c[2]}{'-gqa' if c[1].get('num_key_value_heads') else ''}" for c in CASES],
)
def test_calibrated_merge_reproduces_parent_where_mean_does_not(
    tmp_path, calibration_file, model_type, overrides, groups
):
    src = tmp_path / "src"
    save_redundant_model(src, model_type, groups=groups, **overrides)
    ids = ids_for_test()
    parent = logits(src, ids)
    calibrated = convert(
        src,
        tmp_path / "cal",
        groups=groups,
        method="calibrated",
        calibration=str(calibration_file),
        calibration_tokens=400,
        progress=False,
    )
    convert(src, tmp_path / "mean", groups=groups, method="mean", progress=False)
    torch.testing.assert_close(logits(tmp_path / "cal", ids), parent, rtol=1e-4, atol=1e-4)
    assert (logits(tmp_path / "mean", ids) - parent).abs().max() > 1e-2  # mean-pooling loses the planted maps
    assert all(row["key_error"] < 1e-10 and row["value_error"] < 1e-10 for row in calibrated.layers)
    record = latest(tmp_path / "cal", "conversion")
    assert record["method"] == "calibrated" and len(record["layers"]) == 2
    assert record["calibration"]["tokens"] == 400


def test_errors_are_reported_for_mean_too_and_calibrated_is_lower(tmp_path, calibration_file):
    src = tmp_path / "src"
    save_tiny_model(src, "llama")
    make_tiny_tokenizer(src)
    runs = {
        method: convert(
            src,
            tmp_path / method,
            groups=2,
            method=method,
            calibration=str(calibration_file),
            calibration_tokens=300,
            progress=False,
        ).layers
        for method in ("mean", "calibrated")
    }
    for mean_row, cal_row in zip(runs["mean"], runs["calibrated"]):
        assert 0 < cal_row["key_error"] < mean_row["key_error"] < 2
        assert 0 < cal_row["value_error"] < mean_row["value_error"] < 2


def random_setup(n=8, groups=2, hd=8, d=12, tokens=300, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(tokens, d, generator=gen, dtype=F64), torch.ones(tokens, 1, dtype=F64)], dim=1)
    w = torch.randn(n * hd, d + 1, generator=gen, dtype=F64)
    return x, x.T @ x, w


def mean_error(w, gram, groups, hd):
    n = w.shape[0] // hd
    mean = w.reshape(groups, n // groups, hd, -1).mean(1).reshape(groups * hd, -1)
    return relative_error(w, mean, torch.eye(hd, dtype=F64).expand(n, hd, hd), gram)


@pytest.mark.parametrize("rot", [0, 4, 8])
def test_merge_never_loses_more_than_mean(rot):
    # The mean is one member of each family the merge optimises over (v = 1/sqrt(r), E = [I..I]/sqrt(r)).
    _, gram, w = random_setup()
    shared, maps = merge_keys(w, gram, 2, 8, rot)
    assert relative_error(w, shared, maps, gram) < mean_error(w, gram, 2, 8)
    shared, maps = merge_values(w, gram, 2, 8)
    assert relative_error(w, shared, maps, gram) < mean_error(w, gram, 2, 8)


def test_value_error_is_the_energy_outside_the_top_subspace():
    _, gram, w = random_setup()
    shared, maps = merge_values(w, gram, 2, 8)
    eig = torch.linalg.eigvalsh(projection_gram(w.reshape(2, 32, -1), gram))  # (G, r*hd) ascending
    expected = eig[:, :-8].sum() / eig.sum()
    assert relative_error(w, shared, maps, gram) == pytest.approx(float(expected), rel=1e-9)


def rope_rotation(hd, rot, angle):
    half = rot // 2
    freqs = angle / (10000 ** (torch.arange(half, dtype=F64) / half))
    m = torch.eye(hd, dtype=F64)
    i = torch.arange(half)
    m[i, i], m[i, i + half], m[i + half, i], m[i + half, i + half] = freqs.cos(), -freqs.sin(), freqs.sin(), freqs.cos()
    return m


def test_key_maps_commute_with_rope_and_preserve_scores():
    hd, rot = 8, 6
    _, gram, w = random_setup(hd=hd)
    _, maps = merge_keys(w, gram, 2, hd, rot)
    for angle in (0.3, 2.0, 17.0):
        rope = rope_rotation(hd, rot, angle)
        torch.testing.assert_close(maps @ rope, rope @ maps)
    # scores: q . (M_j k) == (M_j^T q) . k, whatever the positions
    q = torch.randn(8 * hd, 13, dtype=F64)  # one query head per kv head
    k = torch.randn(hd, 1, dtype=F64)
    folded = fold_queries(q, maps).reshape(8, hd, 13)
    for j in range(8):
        before = q.reshape(8, hd, 13)[j].T @ rope_rotation(hd, rot, 5.0).T @ rope_rotation(hd, rot, 2.0) @ maps[j] @ k
        after = folded[j].T @ rope_rotation(hd, rot, 5.0).T @ rope_rotation(hd, rot, 2.0) @ k
        torch.testing.assert_close(after, before)


def test_without_rope_keys_merge_exactly_under_any_invertible_maps():
    hd, gen = 8, torch.Generator().manual_seed(3)
    _, gram, base = random_setup(n=2, hd=hd)
    heads = [
        base[:hd],
        torch.randn(hd, hd, generator=gen, dtype=F64) @ base[:hd],
        base[hd:],
        torch.randn(hd, hd, generator=gen, dtype=F64) @ base[hd:],
    ]
    w = torch.cat(heads)  # two groups of two, the second head of each an invertible map of the first
    shared, maps = merge_keys(w, gram, 2, hd, rot=0)
    assert relative_error(w, shared, maps, gram) < 1e-20
    shared, maps = merge_keys(w, gram, 2, hd, rot=hd)  # with RoPE a general map is not foldable
    assert relative_error(w, shared, maps, gram) > 1e-3


def test_rope_key_merge_is_exact_for_commuting_maps():
    hd, rot, gen = 8, 8, torch.Generator().manual_seed(4)
    _, gram, base = random_setup(n=1, hd=hd)
    w = torch.cat([commuting_map(hd, rot, gen) @ base for _ in range(4)])
    shared, maps = merge_keys(w, gram, 1, hd, rot)
    assert relative_error(w, shared, maps, gram) < 1e-20


@pytest.mark.parametrize("model_type,reason", [("qwen3", "q_norm/k_norm"), ("olmo2", "all heads together")])
def test_pre_rope_norms_are_refused_in_one_line(tmp_path, calibration_file, model_type, reason):
    save_tiny_model(tmp_path / "src", model_type)
    with pytest.raises(InputError, match=reason) as err:
        convert(tmp_path / "src", tmp_path / "dst", groups=2, method="calibrated", calibration=str(calibration_file))
    assert "\n" not in str(err.value) and "--method mean" in str(err.value)
    assert not (tmp_path / "dst").exists()


def test_calibrated_without_calibration_samples_the_parent(tmp_path):
    """No data of the user's: the default calibration is three quarters the parent's own samples, a quarter
    the embedded novels, 128 x hidden tokens in all, and the dry run lists the sampling stage; they need the
    source's tokenizer."""
    save_tiny_model(tmp_path / "src", "llama")
    with pytest.raises(InputError, match="--calibration needs the source's tokenizer"):
        convert(tmp_path / "src", tmp_path / "dst", groups=2, method="calibrated")
    make_tiny_tokenizer(tmp_path / "src")
    plan = convert(tmp_path / "src", tmp_path / "dst", groups=2, method="calibrated", dry_run=True).plan
    hidden = AutoConfig.from_pretrained(tmp_path / "src").hidden_size
    assert plan.calibration.spec == ["parent:0.75", "austen:0.25"] and plan.calibration.tokens == 128 * hidden
    assert [part.tokens for part in plan.calibration.parts] == [96 * hidden, 32 * hidden]
    assert [stage.name for stage in plan.stages][:2] == ["sample", "calibrate"]
    assert "--calibration parent:0.75 --calibration austen:0.25 --calibration-tokens" in plan.command()
    assert not (tmp_path / "dst").exists()


def test_bf16_source_keeps_its_dtype_and_dry_run_gathers_nothing(tmp_path, calibration_file, monkeypatch):
    save_redundant_model(tmp_path / "src", "llama", groups=2)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "src").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    make_tiny_tokenizer(tmp_path / "bf16")
    calls = []
    monkeypatch.setattr("mha2gqa.corpus.calibration.read_calibration", lambda *args, **kw: calls.append(args))
    plan = convert(
        tmp_path / "bf16", tmp_path / "dry", groups=2, method="calibrated", calibration=calibration_file, dry_run=True
    ).tensors  # dry run: the data is checked (it exists, its format is known) but not read
    assert any("q_proj" in out.name for out in plan.output_tensors()) and not (tmp_path / "dry").exists()
    assert calls == []
    monkeypatch.undo()
    convert(
        tmp_path / "bf16",
        tmp_path / "dst",
        groups=2,
        method="calibrated",
        calibration=str(calibration_file),
        calibration_tokens=300,
        progress=False,
    )
    out = AutoModelForCausalLM.from_pretrained(tmp_path / "dst", dtype="auto")
    assert {p.dtype for p in out.parameters()} == {torch.bfloat16}
    ids = ids_for_test()
    parent = logits(tmp_path / "bf16", ids)
    torch.testing.assert_close(logits(tmp_path / "dst", ids), parent, rtol=0.05, atol=0.05)
    # negative control: the tolerance is tight enough that mean-pooling the same bf16 source fails it
    convert(tmp_path / "bf16", tmp_path / "mean", groups=2, method="mean", progress=False)
    assert not torch.allclose(logits(tmp_path / "mean", ids), parent, rtol=0.05, atol=0.05)
