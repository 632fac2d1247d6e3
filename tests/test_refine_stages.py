"""convert --refine's stages, the layer-wise attention fit and the global stage (every refined parameter
against the parent's next-token distribution): exact models stay exact, each stage lowers the held-out error
of the one before, and the cost stays linear in depth. (Determinism with --seed, and the checkpoint refine
writes: tests/test_refine.py.)"""

import copy

import pytest
import torch
from calibrated_models import save_redundant_model
from tiny_models import make_tiny_tokenizer, save_tiny_model
from transformers import AutoModelForCausalLM

from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config
from mha2gqa.convert.calibration import calibrate
from mha2gqa.convert.options import RefineOptions
from mha2gqa.convert.refine.global_stage import GlobalFit, fit_global
from mha2gqa.convert.run import convert
from mha2gqa.files.embedded import HELDOUT_NOVEL, expand_corpus_name, read_novel
from mha2gqa.records.provenance import latest
from mha2gqa.scoring.kl import kl_divergence

# initializer_range 0.1: attention that matters (at the default 0.02 mean-pooling to one kv head moves the
# logits by a KL of 1e-5, too little to rank stages by).
SMALL = dict(max_position_embeddings=64, num_hidden_layers=2, initializer_range=0.1)
ATTENTION = RefineOptions(steps=30, lr=3e-3, global_steps=0)
GLOBAL = RefineOptions(steps=30, lr=3e-3, global_steps=20, global_lr=2e-4)
CALIBRATION = dict(calibration=expand_corpus_name("austen"), calibration_tokens=2048, progress=False)


@pytest.fixture(scope="module")
def tiny_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "llama"
    save_tiny_model(src, "llama", **SMALL)
    make_tiny_tokenizer(src)
    return src


@pytest.fixture(scope="module")
def tiny_stats(tmp_path_factory, tiny_src):
    """Calibration statistics gathered once, shared by the conversions (as a sweep passes them)."""
    config = read_config(tiny_src)
    out = tmp_path_factory.mktemp("stats")
    return calibrate(
        tiny_src, layout_for(config), attention_shape(config), CALIBRATION["calibration"], 2048, out, progress=False
    )


def heldout_kl(model_dir, src) -> float:
    """KL(parent || model) per token on held-out text (Persuasion, which the calibration never reads)."""
    from transformers import AutoTokenizer

    text = read_novel(HELDOUT_NOVEL)[:20000]
    ids = torch.tensor(AutoTokenizer.from_pretrained(src)(text, add_special_tokens=False)["input_ids"][:1024])
    blocks = ids.view(16, 64)
    parent, model = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (src, model_dir))
    with torch.no_grad():
        return float(kl_divergence(parent(blocks).logits, model(blocks).logits))


def test_exact_model_stays_exact_under_every_stage(tmp_path):
    src = tmp_path / "src"
    save_redundant_model(src, "llama", groups=2, **SMALL)
    result = convert(src, tmp_path / "dst", 2, method="calibrated", refine=GLOBAL, **CALIBRATION)
    for row in result.refine["layers"]:
        assert row["fit_error_after"] < 1e-9 and row["heldout_error_after"] < 1e-9, row
    assert result.refine["global"] is None  # nothing was refined, so nothing to fit together
    ids = torch.arange(4, 68)[None]
    parent, converted = (
        AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (src, tmp_path / "dst")
    )
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, parent(ids).logits, rtol=1e-4, atol=1e-4)


def test_each_stage_beats_the_one_before_on_heldout_text(tmp_path, tiny_src, tiny_stats):
    errors = {}
    records = {}
    for name, options in [("merge", None), ("attention", ATTENTION), ("global", GLOBAL)]:
        done = convert(tiny_src, tmp_path / name, 1, method="mean", stats=tiny_stats, refine=options, progress=False)
        errors[name], records[name] = heldout_kl(tmp_path / name, tiny_src), done.refine
    print("held-out KL to the parent:", {name: f"{value:.4e}" for name, value in errors.items()})
    assert records["merge"] is None
    assert errors["merge"] > errors["attention"] > errors["global"]
    assert errors["attention"] < 0.5 * errors["merge"]  # the layer-wise fit at least halves the merge's error
    for row in records["attention"]["layers"]:  # per layer, on the held-out calibration blocks too
        assert row["heldout_error_after"] < row["heldout_error_before"], row
        assert row["fit_error_after"] < row["fit_error_before"], row
    record = latest(tmp_path / "attention", "conversion")["refine"]  # mha2gqa.json keeps the same record
    assert record["layers"] == records["attention"]["layers"] and record["heldout_tokens"] > 0
    # The global stage's own record: measured on the held-out calibration blocks, by check.
    checks = records["global"]["global"]["checks"]
    print("global stage held-out KL by step:", [(c["step"], f"{c['heldout_kl']:.4e}") for c in checks])
    best = min(c["heldout_kl"] for c in checks)
    assert best < checks[0]["heldout_kl"] and records["global"]["global"]["best_step"] > 0


def test_the_layerwise_stage_runs_each_layer_a_fixed_number_of_times(tmp_path, calibration_file):
    """The layer-wise stage alone: each decoder layer (parent and converted) runs the same number of times, no
    prefix re-runs (with the global stage on, the next test: the same counts whatever the depth)."""
    calls: dict[int, int] = {}
    counting = {"on": False}

    def count(module, args, output):
        if counting["on"] and type(module).__name__.endswith("DecoderLayer"):
            calls[id(module)] = calls.get(id(module), 0) + 1

    def refine_counted(*args, **kwargs):  # counts the refine stage only, not the calibration before it
        counting["on"] = True
        try:
            return refine_attention(*args, **kwargs)
        finally:
            counting["on"] = False

    from mha2gqa.convert import refine

    refine_attention = refine.refine_attention
    src = tmp_path / "src"
    save_tiny_model(src, "llama", num_hidden_layers=4, max_position_embeddings=64)
    make_tiny_tokenizer(src)
    handle = torch.nn.modules.module.register_module_forward_hook(count)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(refine, "refine_attention", refine_counted)
            record = convert(
                src,
                tmp_path / "dst",
                2,
                calibration=calibration_file,
                calibration_tokens=1024,
                refine=RefineOptions(steps=2, batch_blocks=4, global_steps=0),  # the layer-wise stage alone
                progress=False,
            ).refine
    finally:
        handle.remove()
    blocks = (record["fit_tokens"] + record["heldout_tokens"]) // record["sequence_length"]
    opened = record["openings"]  # the openings go through the same passes, as many tokens a forward as blocks
    assert opened["sequences"] == max(16, blocks * record["sequence_length"] // 64) and opened["length"] == 8
    batches = -(-blocks // 4) + -(-opened["sequences"] // (4 * record["sequence_length"] // opened["length"]))
    assert len(calls) == 8  # 4 parent layers + 4 converted layers
    # Completed layer forwards. parent: one single-sequence pass for the layer arguments (blocks, openings) +
    # the targets passes (the first layer's inputs come from passes stopped before layer 0); converted: the
    # advance passes (+ one re-run where a refit is rejected; its capture pass stops after the attention, so
    # the layer never completes there).
    assert batches > 2
    assert list(calls.values()).count(batches + 2) == 4, calls
    assert set(calls.values()) <= {batches, batches + 2, 2 * batches}, calls
    assert sum(calls.values()) <= 4 * (batches + 2) + 4 * 2 * batches


def test_cost_stays_linear_in_depth(tmp_path):
    """With the global stage on, every decoder layer of a model runs the same number of times,
    whatever the depth: no stage re-runs a prefix per layer."""
    counts = {}
    for depth in (2, 4):
        calls: dict[int, int] = {}

        def count(module, args, output, calls=calls):
            if type(module).__name__.endswith("DecoderLayer"):
                calls[id(module)] = calls.get(id(module), 0) + 1

        src = tmp_path / f"src{depth}"
        save_tiny_model(src, "llama", max_position_embeddings=64, num_hidden_layers=depth)
        make_tiny_tokenizer(src)
        options = RefineOptions(steps=2, batch_blocks=4, global_steps=2)
        handle = torch.nn.modules.module.register_module_forward_hook(count)
        try:
            convert(
                src,
                tmp_path / f"dst{depth}",
                2,
                method="mean",
                refine=options,
                check=False,  # the check runs both models again; this counts the conversion's own passes
                **{**CALIBRATION, "calibration_tokens": 1024},
            )
        finally:
            handle.remove()
        assert len(calls) == 2 * depth  # the parent's layers and the converted model's
        counts[depth] = sorted(calls.values())
    # Per layer, the same number of calls whatever the depth: the parent's layers all alike (kwargs pass,
    # targets pass, the global stage's forwards); the converted ones too, up to one re-run of a layer whose
    # attention refit is rejected: 4 batches of 4 blocks and 1 of the 16 openings here.
    batches = 5
    for depth, values in counts.items():
        assert values.count(values[0]) >= depth, (depth, values)  # the parent's layers
    assert counts[2][0] == counts[4][0], counts
    converted = {depth: values[depth:] for depth, values in counts.items()}
    assert max(converted[4]) - min(converted[4]) <= batches and min(converted[4]) == min(converted[2]), counts


def test_cli_runs_every_stage_and_prints_their_errors(tmp_path, tiny_src):
    from click.testing import CliRunner

    from mha2gqa.cli import main

    args = ["convert", str(tiny_src), str(tmp_path / "dst"), "-g", "1", "--method", "mean", "--calibration", "austen"]
    args += ["--calibration-tokens", "1024", "--refine", "--refine-steps", "3"]
    args += ["--refine-global-steps", "2", "--refine-global-lr", "2e-4", "-q"]
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert "held-out after" in done.output and "all layers together: held-out KL" in done.output
    record = latest(tmp_path / "dst", "conversion")["refine"]
    assert "mlp_output" not in record["options"] and record["global"]["steps"] == 2 and record["global"]["lr"] == 2e-4
    bad = CliRunner().invoke(main, args[:-5] + ["--refine-global-steps", "-1"])
    assert bad.exit_code == 2 and "Error: --refine-global-steps -1 must be 0 or more" in bad.output
    assert not (tmp_path / "dst2").exists()


def test_refine_mlp_is_no_longer_an_option(tmp_path, tiny_src):
    """The block stage went to bench/ (it lost on held-out text on a real model): click refuses the flag."""
    from click.testing import CliRunner

    from mha2gqa.cli import main

    args = ["convert", str(tiny_src), str(tmp_path / "dst"), "-g", "1", "--calibration", "austen", "--refine"]
    done = CliRunner().invoke(main, args + ["--refine-mlp"])
    assert done.exit_code == 2 and "No such option '--refine-mlp'" in done.output
    assert not (tmp_path / "dst").exists()


def two_random_models():
    """A random parent and a random one-kv-head student of it (far apart: a large KL), and 6 blocks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    parent, start = (LlamaForCausalLM(config).eval().requires_grad_(False) for _ in range(2))
    return parent, start, torch.randint(0, 64, (6, 32)), {"fit": torch.arange(4), "heldout": torch.arange(4, 6)}


def test_global_stage_trains_bfloat16_weights_through_float32_masters():
    """On a GPU the parent loads in its checkpoint's dtype (bfloat16, float16), and so do the refined
    parameters, whose bfloat16 spacing near 0.05 is 2.4e-4: Adam steps of lr 1e-4 applied to them
    directly mostly round away. Through float32 masters the bfloat16 run follows the float32 one: its
    weights end where float32 training puts them, up to bfloat16 rounding."""
    parent, start, blocks, split = two_random_models()
    ends = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = copy.deepcopy(start).to(dtype)
        params = [p for name, p in model.named_parameters() if ".self_attn." in name]
        fit = GlobalFit(steps=12, lr=1e-4, batch_blocks=2, heldout_every=12)
        record = fit_global(
            parent.to(dtype), model, params, blocks, split, fit, torch.Generator().manual_seed(0), False
        )
        assert record["best_step"] == 12, record  # the KL fell: the trained weights are kept
        ends[dtype] = torch.cat([p.detach().float().flatten() for p in params])
    before = torch.cat([p.detach().flatten() for n, p in start.named_parameters() if ".self_attn." in n])
    moved = (ends[torch.float32] - before).norm()
    off = (ends[torch.bfloat16] - ends[torch.float32]).norm()
    rounding = (before.bfloat16().float() - before).norm()
    print(
        f"float32 training moved the weights by {moved:.4f}; bfloat16 ends {off:.4f} from it (rounding {rounding:.4f})"
    )
    assert off < 0.5 * moved and off < 3 * rounding


def test_global_stage_stops_after_patience_checks_without_a_gain_and_keeps_the_best(monkeypatch):
    """Held-out KL by check 1.0, 0.9 (best), 0.95, 0.92: after `patience` (2) checks without a gain on the
    best the stage stops, and the weights of the best check are the ones left in place."""
    from mha2gqa.convert.refine import global_stage

    parent, model, blocks, split = two_random_models()
    params = [p for name, p in model.named_parameters() if ".self_attn." in name]
    values, seen = iter([1.0, 0.9, 0.95, 0.92, 0.5, 0.4]), []

    def scripted_heldout_kl(*args):
        seen.append([p.detach().clone() for p in params])
        return next(values)

    monkeypatch.setattr(global_stage, "heldout_kl", scripted_heldout_kl)
    fit = GlobalFit(steps=40, lr=1e-3, batch_blocks=2, heldout_every=5)
    record = fit_global(parent, model, params, blocks, split, fit, torch.Generator().manual_seed(0), progress=False)
    assert [c["step"] for c in record["checks"]] == [0, 5, 10, 15] and record["best_step"] == 5
    assert all(torch.equal(p, kept) for p, kept in zip(params, seen[1], strict=True))
    assert not any(torch.equal(p, later) for p, later in zip(params, seen[3], strict=True))


def test_mini_batches_are_seeded_epochs_of_the_fit_blocks_and_never_short():
    """Both Adam stages draw their order here: each epoch a permutation of the fit blocks, a batch that would
    come out short taking the next epoch's first blocks instead, the same order for the same seed."""
    from mha2gqa.convert.refine.buffers import mini_batches

    fit = torch.arange(3, 8)  # 5 fit blocks, batches of 2
    drawn = [b.tolist() for b, _ in zip(mini_batches(fit, 2, torch.Generator().manual_seed(0)), range(5))]
    assert all(len(b) == 2 for b in drawn)
    flat = sum(drawn, [])
    assert sorted(flat[:5]) == fit.tolist() and sorted(flat[5:10]) == fit.tolist()  # two whole epochs
    generator = torch.Generator().manual_seed(0)
    first, second = (fit[torch.randperm(5, generator=generator)].tolist() for _ in range(2))
    assert flat == first + second
    again = [b.tolist() for b, _ in zip(mini_batches(fit, 2, torch.Generator().manual_seed(0)), range(5))]
    assert again == drawn
    assert [b.tolist() for b, _ in zip(mini_batches(fit, 9, torch.Generator().manual_seed(0)), range(1))] == [first]


def test_the_global_stage_takes_its_settings_from_the_refine_options():
    from mha2gqa.convert.refine import GlobalFit

    options = RefineOptions(global_steps=3, global_lr=5e-4, batch_blocks=2, global_precision="float32")
    parent, model, blocks, split = two_random_models()
    params = [p for name, p in model.named_parameters() if ".self_attn." in name]
    fit = GlobalFit.of(options)
    record = fit_global(parent, model, params, blocks, split, fit, torch.Generator().manual_seed(0), progress=False)
    assert (record["steps"], record["lr"], record["batch_blocks"]) == (3, 5e-4, 2)
    assert (record["betas"], record["clip"], record["decay"]) == ([0.9, 0.95], 1.0, False)
    assert [c["step"] for c in record["checks"]] == [0, 3]  # the last step is always checked
    assert record["precision"] == "float32"


def test_global_stage_fits_in_bfloat16_autocast_and_checks_in_float32():
    """--refine-global-precision bfloat16: the fit steps' linear layers compute in bfloat16 while the held-out checks
    (which pick the step kept) and the parameters stay float32, and the fit still lowers the held-out KL."""
    parent, model, blocks, split = two_random_models()
    params = [p for name, p in model.named_parameters() if ".self_attn." in name]
    seen = []  # (grad enabled: a fit step, else a check; the q projection's output dtype)
    model.model.layers[0].self_attn.q_proj.register_forward_hook(
        lambda module, args, out: seen.append((torch.is_grad_enabled(), out.dtype))
    )
    fit = GlobalFit.of(RefineOptions(global_steps=6, global_lr=1e-2, batch_blocks=2, global_precision="bfloat16"))
    assert fit.autocast == torch.bfloat16
    record = fit_global(parent, model, params, blocks, split, fit, torch.Generator().manual_seed(0), progress=False)
    assert record["precision"] == "bfloat16 autocast"
    assert {dtype for fitting, dtype in seen if fitting} == {torch.bfloat16}
    assert {dtype for fitting, dtype in seen if not fitting} == {torch.float32}
    assert all(p.dtype == torch.float32 for p in params)
    assert record["checks"][-1]["heldout_kl"] < record["checks"][0]["heldout_kl"]
