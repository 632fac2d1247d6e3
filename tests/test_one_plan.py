"""One conversion plan for any kv-head counts (issue 65): --groups, --kv-heads-per-layer and --kv-budget go through
the same prepare and execute. Per-layer counts work with every method, grouping and --refine; the bytes of the
per-layer conversions stay those of the second pipeline they replaced (pinned at 43c2481); a layer converted at
count g holds the tensors the uniform conversion to g gives it."""

from __future__ import annotations

import hashlib
import json

import pytest
from click.testing import CliRunner
from safetensors import safe_open
from tiny_models import SAMPLE_TEXT, make_tiny_tokenizer, save_tiny_model

from mha2gqa.cli import main
from mha2gqa.files import jsontext
from mha2gqa.nemotron_nas.remote_code import AUTO_MAP

# sha256 of model.safetensors and config.json as 43c2481 (convert/per_layer.py, budget_run.py) wrote them for this
# parent (tiny llama: seed 0, 3 layers, 8 heads, 4 kv heads, MLP 256) and these flags (the budget's then default
# merge, mean without refine, now spelled out: a budget's default is calibrated + refine)
PINNED = {
    ("--kv-heads-per-layer", "4,2,1"): (
        "cb306c02013b2a32f1603adad64d0c92fca3f4e08e4607592d6b7fe59b7102a4",
        "660887aa8f63758387d9ecf3c12794914a4ccfb90ef5236a13f25634bce7813f",
    ),
    ("--kv-heads-per-layer", "2,1,2", "--dtype", "bfloat16"): (
        "1360acbf26924c5c3c090b860d49db748f89b9e85326ef91cba3fa137d9ab2da",
        "11de6f6b8d60db67321bbacca5ea1bc9aed612a163feb58f4c7feae0f58bc43f",
    ),
    ("--kv-budget", "0.5", "--method", "mean", "--no-refine", "--calibration", "CAL", "--calibration-tokens", "128"): (
        "3c676c36f9ef829addc5b6fd55d46caf8c0a9c25aa9af7c34302e9756c9f787b",
        "2d4b267c5536916a6f7454c6633fdd897db4e827e238bb62eccd2e8b0fda945c",
    ),
}


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    root = tmp_path_factory.mktemp("one-plan")
    src = root / "llama"
    save_tiny_model(src, "llama", intermediate_size=256, num_key_value_heads=4, num_hidden_layers=3,
                    max_position_embeddings=64)  # fmt: skip
    make_tiny_tokenizer(src)
    (root / "cal.txt").write_text(SAMPLE_TEXT * 20)
    return src


def _convert(parent, dst, *args):
    words = [str(parent.parent / "cal.txt") if word == "CAL" else word for word in args]
    result = CliRunner().invoke(main, ["convert", str(parent), str(dst), "-q", "--no-check", *words])
    assert result.exit_code == 0, result.output
    return result


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("args", list(PINNED), ids=["counts", "counts-bf16", "budget"])
def test_per_layer_bytes_are_the_second_pipelines(parent, tmp_path, args):
    """The weights byte for byte; config.json too, but for the auto_map that points stock transformers at the model
    code a per-layer child now carries (issue 69)."""
    _convert(parent, tmp_path / "dst", *args)
    weights, config = PINNED[args]
    assert _sha(tmp_path / "dst" / "model.safetensors") == weights
    written = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert written.pop("auto_map") == AUTO_MAP and (tmp_path / "dst" / "modeling_decilm.py").is_file()
    assert hashlib.sha256((jsontext.model_config(written, indent=2) + "\n").encode()).hexdigest() == config


def _layer_tensors(path, layer: int) -> dict:
    prefix = f"model.layers.{layer}.self_attn."
    with safe_open(path / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}


METHODS = [
    ("--method", "mean"),
    ("--method", "first"),
    ("--method", "random", "--seed", "3"),
    ("--method", "mean-norm"),
    ("--method", "calibrated", "--calibration", "CAL", "--calibration-tokens", "512"),
    ("--method", "mean", "--grouping", "similarity", "--calibration", "CAL", "--calibration-tokens", "512"),
]


@pytest.mark.parametrize("method", METHODS, ids=["mean", "first", "random", "mean-norm", "calibrated", "similarity"])
def test_each_layer_holds_what_the_uniform_conversion_to_its_count_gives(parent, tmp_path, method):
    """The layer-by-layer reference: layer i of --kv-heads-per-layer 4,2,1 equals layer i of --groups counts[i]
    (the parent's own count: its tensors unchanged), for every method and grouping."""
    counts = (4, 2, 1)
    _convert(parent, tmp_path / "per-layer", "--kv-heads-per-layer", ",".join(map(str, counts)), *method)
    config = json.loads((tmp_path / "per-layer" / "config.json").read_text())
    assert [8 // b["attention"]["n_heads_in_group"] for b in config["block_configs"]] == list(counts)
    for layer, count in enumerate(counts):
        reference = parent if count == 4 else tmp_path / f"g{count}"
        if count != 4 and not reference.exists():
            _convert(parent, reference, "--groups", str(count), *method)
        got, expected = _layer_tensors(tmp_path / "per-layer", layer), _layer_tensors(reference, layer)
        assert set(got) == set(expected)
        for name, tensor in got.items():
            assert tensor.equal(expected[name]), name


def test_budget_with_the_best_tools_plans_runs_and_reproduces(parent, tmp_path):
    """--kv-budget with the calibrated merge and --refine: its dry run lists the layer-losses stage before the merge,
    the run records the choice, and the card's Reproduce line (the chosen counts) writes the same bytes."""
    args = ["--kv-budget", "0.5", "--method", "calibrated", "--refine", "--refine-steps", "3"]
    args += ["--refine-global-steps", "2", "--calibration", "CAL", "--calibration-tokens", "256"]
    dry = _convert(parent, tmp_path / "dry", *args, "--dry-run").output
    stages = [line.split(":")[1].strip() for line in dry.splitlines() if line.startswith("stage ")]
    assert stages == ["calibrate", "layer losses", "merge", "refine", "refine (global)", "write", "check", "metadata"]
    assert "kv heads per layer chosen within 6 of 12" in dry and not (tmp_path / "dry").exists()
    _convert(parent, tmp_path / "dst", *args)
    record = json.loads((tmp_path / "dst" / "mha2gqa.json").read_text())["lineage"][-1]
    counts = record["kv_heads_per_layer"] if "kv_heads_per_layer" in record else [record["groups"]] * 3
    assert sum(counts) <= 6 and record["kv_budget"]["budget_kv_heads"] == 6 and record["refine"]["layers"]
    words = record["command"].split()
    target = (
        ["--groups", str(counts[0])] if len(set(counts)) == 1 else ["--kv-heads-per-layer", ",".join(map(str, counts))]
    )
    assert "--kv-budget" not in words and words[4:6] == target  # the chosen counts: no losses measured again
    again = [str(parent.parent / "cal.txt") if w.endswith("cal.txt") else w for w in words[4:]]
    _convert(parent, tmp_path / "again", *again)
    assert _sha(tmp_path / "again" / "model.safetensors") == _sha(tmp_path / "dst" / "model.safetensors")


@pytest.mark.parametrize(
    ("given", "merge", "refined"),
    [
        ((), "calibrated", True),  # a budget's default: our best merge
        (("--method", "mean"), "mean", True),  # each unset one takes the budget's default
        (("--no-refine",), "calibrated", False),
        (("--method", "mean", "--no-refine"), "mean", False),
        (("CONFIG",), "mean", False),  # a --config file's method: mean, refine: false is given, not unset
    ],
)
def test_a_budget_merges_with_calibrated_and_refine_unless_told(parent, tmp_path, given, merge, refined):
    """--kv-budget alone plans the calibrated merge and --refine (BUDGET_DEFAULTS); a --method or --refine the user
    gave, on the command line or in --config, stands; --groups keeps mean without refine."""
    if given == ("CONFIG",):
        config = tmp_path / "c.yaml"
        config.write_text("method: mean\nrefine: false\n")
        given = ("--config", str(config))
    dry = _convert(parent, tmp_path / "dst", "--kv-budget", "0.5", "--calibration", "CAL", *given, "--dry-run").output
    stages = {line.split(":")[1].strip(): line for line in dry.splitlines() if line.startswith("stage ")}
    assert stages["merge"].split(": ", 2)[2].startswith(f"{merge} to the kv heads per layer"), stages["merge"]
    assert ("refine" in stages) is refined
    uniform = _convert(parent, tmp_path / "u", "--groups", "2", "--dry-run").output
    assert "merge: mean over groups of 2" in uniform and "stage 2: refine" not in uniform


def _refusal_parents(root):
    """Parents a --kv-budget cannot convert: a qwen2 (no per-layer format), a per-layer child, one kv head."""
    save_tiny_model(root / "qwen", "qwen2", intermediate_size=256, num_key_value_heads=4)
    save_tiny_model(root / "one", "llama", intermediate_size=256, num_key_value_heads=1)
    src = root / "llama"
    save_tiny_model(src, "llama", intermediate_size=256, num_key_value_heads=4)
    _convert(src, root / "child", "--kv-heads-per-layer", "4,1")
    for name in ("qwen", "one", "child", "llama"):
        make_tiny_tokenizer(root / name)
        (root / "cal.txt").write_text(SAMPLE_TEXT * 8)
        (root / "eval.txt").write_text(SAMPLE_TEXT * 2)
    return root


@pytest.mark.parametrize("command", ["convert", "sweep"])
def test_a_budget_refusal_names_the_flag_typed(tmp_path, command):
    """convert --kv-budget and sweep --kv-budgets refused on a qwen2 parent, a per-layer child and a one-kv-head
    parent: one line naming the flag the user typed, never --kv-heads-per-layer (issue 69 item 2)."""
    root = _refusal_parents(tmp_path)
    flag = "--kv-budget" if command == "convert" else "--kv-budgets"
    cases = [("qwen", "model_type 'qwen2'"), ("child", "Nemotron-NAS checkpoint")]
    if command == "convert":  # a sweep refuses a one-kv-head parent by its --groups first
        cases.append(("one", "one kv head in every layer already"))
    for name, words in cases:
        out = tmp_path / f"out-{name}"
        if command == "convert":
            args = ["convert", str(root / name), str(out), flag, "0.5", "-q"]
        else:
            args = ["sweep", str(root / name), "--groups", "1", flag, "0.5", "--calibration", str(root / "cal.txt"),
                    "--data", str(root / "eval.txt"), "--out", str(out), "-q"]  # fmt: skip
        result = CliRunner().invoke(main, args)
        assert result.exit_code == 2, (name, result.output)
        assert flag + ":" in result.output or flag + " " in result.output, (name, result.output)
        assert words in result.output and "--kv-heads-per-layer:" not in result.output, (name, result.output)
        assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--calibration-tokens", "1000"], "--calibration-tokens 1000: no stage of this conversion reads"),
        (["--refine-steps", "7"], "--refine-steps 7 sets --refine, which is off"),
        (["--refine-memory", "2GiB"], "--refine-memory 2GiB sets --refine, which is off"),
    ],
)
def test_a_value_no_stage_reads_is_refused_not_dropped(parent, tmp_path, extra, words):
    """An explicit value is honoured or refused for a stated reason, never dropped (issue 69 item 1)."""
    result = CliRunner().invoke(main, ["convert", str(parent), str(tmp_path / "dst"), "-g", "2", "-q", *extra])
    assert result.exit_code == 2 and words in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "dst").exists()
