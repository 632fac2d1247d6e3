"""The calibration input: resolved once in prepare and carried by the plan (refine takes the plan's budget and
never imports prepare), the mix notation and its shares, refusals before anything runs, and the warning when
the text is shorter than asked for."""

import ast
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from mha2gqa.cli import main
from mha2gqa.convert.options import ConvertOptions, RefineOptions
from mha2gqa.convert.prepare import prepare
from mha2gqa.convert.run import convert
from mha2gqa.corpus import textdata
from mha2gqa.corpus.calibration import CalibrationInput, read_calibration, resolve_calibration
from mha2gqa.corpus.mix import parse_spec, part_tokens
from mha2gqa.runtime.errors import InputError

QUICK = RefineOptions(steps=2, lr=2e-3, tokens=256, batch_blocks=2, global_steps=0)


def test_refine_does_not_import_prepare():
    convert = Path(__file__).parent.parent / "mha2gqa" / "convert"
    modules = [convert / "calibration.py", *sorted((convert / "refine").glob("*.py"))]
    assert len(modules) > 5  # the refine package's modules are all read
    for path in modules:
        tree = ast.parse(path.read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert "mha2gqa.convert.prepare" not in imported, path.name


def test_the_calibration_source_is_resolved_once_per_conversion(tmp_path, tiny_src, calibration_file, monkeypatch):
    calls = []
    real = textdata.resolve

    def counted(key, *args, **kwargs):
        calls.append(key)
        return real(key, *args, **kwargs)

    monkeypatch.setattr(textdata, "resolve", counted)
    options = dict(method="calibrated", calibration=calibration_file, calibration_tokens=512, refine=QUICK)
    result = convert(tiny_src, tmp_path / "dst", 2, progress=False, **options)
    # the check after the write reads its probe domains (--data) on its own: not the calibration again
    assert result.refine["layers"] and [key for key in calls if key != "--data"] == ["--calibration"]


def test_the_plan_carries_the_input_and_refines_budget(tiny_src, calibration_file):
    options = ConvertOptions(groups=2, method="calibrated", calibration=calibration_file, calibration_tokens=640)
    plan = prepare(tiny_src, ConvertOptions(**{**options.__dict__, "refine": QUICK}))
    assert isinstance(plan.calibration, CalibrationInput)
    assert (plan.calibration.tokens, plan.calibration.seq_len) == (640, 64)  # the tiny model's 64-token context
    assert plan.calibration.parts[0].entries == (calibration_file,)
    budget = plan.refine_budget
    assert (budget.seq_len, budget.wanted_tokens, budget.blocks) == (64, 256, 4)
    assert budget.fit_blocks + budget.heldout_blocks == budget.blocks and budget.heldout_blocks == 1
    assert prepare(tiny_src, options).refine_budget is None


@pytest.mark.parametrize(
    "spec, expected",
    [
        ("corpus.txt", [("corpus.txt", None)]),
        (["a.txt", "b.txt"], [("a.txt", None), ("b.txt", None)]),
        (["parent:0.5", "austen:0.5"], [("parent", 0.5), ("austen", 0.5)]),
        (["parent:75%", "austen:25%"], [("parent", 0.75), ("austen", 0.25)]),
        ({"parent": 2, "austen": 1}, [("parent", 2), ("austen", 1)]),
    ],
)
def test_the_mix_notation(spec, expected):
    assert parse_spec(spec) == expected


@pytest.mark.parametrize(
    "spec, message",
    [
        (["parent:0.5", "austen"], "--calibration austen has no share while others do: give every entry one"),
        (["parent:0", "austen:1"], "--calibration parent:0: '0' is not a share: a share is a positive number"),
        (["austen:1", "austen:2"], "--calibration austen is given twice in a mix"),
        ({"parent": "half"}, "--calibration parent:half: 'half' is not a share: a share is a positive number"),
        ([], "--calibration is empty"),
        (["parent", "austen"], "--calibration parent samples the model, and cannot be read in order with other text"),
    ],
)
def test_a_bad_mix_is_refused_in_one_line(spec, message):
    with pytest.raises(InputError, match="^" + message.replace("(", r"\(")) as err:
        resolve_calibration(spec, 4096, 512)
    assert "\n" not in str(err.value)


def test_a_path_with_a_colon_is_a_path(tmp_path):
    odd = tmp_path / "notes:2.txt"
    odd.write_text("Some text.\n")
    assert parse_spec(str(odd)) == [(str(odd), None)]


def test_each_part_gets_its_share_in_whole_blocks():
    assert part_tokens([1.0], 1000, 512) == [1000]  # one source: exactly what was asked
    assert part_tokens([0.5, 0.5], 8192, 512) == [4096, 4096]
    assert part_tokens([3, 1], 8192, 512) == [6144, 2048]
    assert sum(part_tokens([1, 1, 1], 8192, 512)) == 8192 - 8192 % 512  # the rounding goes to a part


def test_a_mix_of_two_texts_interleaves_their_blocks_in_proportion(tmp_path, tiny_src):
    (tmp_path / "a.txt").write_text("alpha beta gamma delta. " * 400)
    (tmp_path / "b.txt").write_text("one two three four. " * 400)
    spec = [f"{tmp_path / 'a.txt'}:3", f"{tmp_path / 'b.txt'}:1"]
    data = resolve_calibration(spec, 512, 64)
    assert [part.tokens for part in data.parts] == [384, 128] and [p.share for p in data.parts] == [0.75, 0.25]
    ids, record = read_calibration(data, tiny_src)
    assert len(ids) == 512 and [p["tokens"] for p in record["parts"]] == [384, 128]
    alone_a, _ = read_calibration(resolve_calibration(str(tmp_path / "a.txt"), 384, 64), tiny_src)
    alone_b, _ = read_calibration(resolve_calibration(str(tmp_path / "b.txt"), 128, 64), tiny_src)
    blocks = ids.view(-1, 64)
    a_blocks, b_blocks = alone_a.view(-1, 64), alone_b.view(-1, 64)
    # 6 blocks of a at (i + 0.5) / 6, 2 of b at 0.25 and 0.75: each b after the a it ties with
    source = ["a" if any((block == other).all() for other in a_blocks) else "b" for block in blocks]
    assert source == ["a", "a", "b", "a", "a", "a", "b", "a"]
    assert all((blocks[[i for i, s in enumerate(source) if s == "b"]] == b_blocks).all(1))


def test_an_empty_calibration_file_is_refused_by_the_dry_run(tmp_path, tiny_src):
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    args = ["convert", str(tiny_src), str(tmp_path / "dst"), "--groups", "2", "--method", "calibrated"]
    result = CliRunner().invoke(main, [*args, "--calibration", str(empty), "--dry-run"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [
        f"Error: --calibration {empty} holds no text (empty or only whitespace): give a file with text in it"
    ]
    assert not (tmp_path / "dst").exists()


def test_an_odd_rotary_dims_config_is_refused_by_the_dry_run(tmp_path):
    from tiny_models import make_tiny_tokenizer, save_tiny_model

    save_tiny_model(tmp_path / "src", "llama")
    make_tiny_tokenizer(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    config["partial_rotary_factor"] = 3 / head_dim  # 3 rotated dims: no pairs
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    options = ConvertOptions(groups=2, method="calibrated", calibration="austen", dry_run=True)
    with pytest.raises(InputError, match=r"^rotary dims 3 \(head_dim \d+ x partial_rotary_factor .*\) are odd"):
        prepare(tmp_path / "src", options)


def test_a_short_calibration_text_is_said_in_one_warning_and_recorded(tmp_path, tiny_src, calibration_file):
    args = ["convert", str(tiny_src), str(tmp_path / "dst"), "--groups", "2", "--method", "calibrated", "--quiet"]
    result = CliRunner().invoke(main, [*args, "--calibration", calibration_file, "--calibration-tokens", "100000"])
    assert result.exit_code == 0, result.output
    warning = [line for line in result.output.splitlines() if line.startswith("Warning: --calibration")]
    assert len(warning) == 1 and "fewer than the 100,000 asked for" in warning[0]
    record = json.loads((tmp_path / "dst" / "mha2gqa.json").read_text())["lineage"][-1]["calibration"]
    (part,) = record["parts"]
    assert record["tokens_requested"] == 100000 and part["tokens"] == record["tokens"] < 100000
    card = (tmp_path / "dst" / "README.md").read_text()
    assert f"only {record['tokens']:,} of the 100,000 calibration tokens asked for" in card


def _record(model_dir: Path) -> dict:
    return json.loads((model_dir / "mha2gqa.json").read_text())["lineage"][-1]


def test_parent_samples_are_seeded_recorded_and_reproduced_by_the_cards_command(tmp_path, tiny_src):
    """No data of the user's: the parent's own samples, the same ids for the same seed (their sha256 in
    mha2gqa.json), other ids for another seed, and the card's command makes the same bytes again."""
    base = ["convert", str(tiny_src), "--groups", "2", "--method", "calibrated", "--quiet"]
    base += ["--calibration", "parent", "--calibration-tokens", "512"]
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        result = CliRunner().invoke(main, [*base[:2], str(tmp_path / name), *base[2:], "--seed", seed])
        assert result.exit_code == 0, result.output
    first, again, other = (_record(tmp_path / name)["calibration"] for name in "abc")
    assert first["ids_sha256"] == again["ids_sha256"] != other["ids_sha256"]
    # batch: the most sequences at once (sampling.MOST_SEQUENCES): a tiny model's KV cache is far below the cap
    assert first["sampling"] == {"greedy_tokens": 3, "temperature": 1.0, "top_p": 0.95, "batch": 64,
                                 "chat_share": 0.5, "chat_turn_header": None, "seed": 0, "device": "cpu"}  # fmt: skip
    assert first["tokens"] == 512 and first["parts"] == [{"name": "parent", "share": 1.0, "tokens": 512, "asked": 512}]
    card = (tmp_path / "c" / "README.md").read_text()
    (line,) = [line for line in card.splitlines() if line.startswith("mha2gqa convert ")]
    assert "--calibration parent" in line and "--seed 1" in line
    words = line.split()
    result = CliRunner().invoke(main, [*[str(tmp_path / "d") if w == "OUT" else w for w in words[1:]], "--quiet"])
    assert result.exit_code == 0, result.output
    assert _record(tmp_path / "d")["calibration"]["ids_sha256"] == other["ids_sha256"]
    for shard in (tmp_path / "c").glob("*.safetensors"):
        assert (tmp_path / "d" / shard.name).read_bytes() == shard.read_bytes()


def test_a_mix_of_parent_samples_and_text_is_recorded_with_its_shares(tmp_path, tiny_src, calibration_file):
    spec = {"parent": 1, calibration_file: 1}
    convert(
        tiny_src, tmp_path / "dst", 2, method="calibrated", calibration=spec, calibration_tokens=512, progress=False
    )
    record = _record(tmp_path / "dst")
    parts = record["calibration"]["parts"]
    assert [(p["name"], p["share"], p["tokens"]) for p in parts] == [("parent", 0.5, 256), (calibration_file, 0.5, 256)]
    assert record["calibration"]["data"] == ["parent:1", f"{calibration_file}:1"]
    assert f"--calibration parent:1 --calibration {calibration_file}:1" in record["command"]
    row = [line for line in (tmp_path / "dst" / "README.md").read_text().splitlines() if "calibration data" in line]
    assert "text sampled from the parent (50%), 256 tokens; cal.txt (50%), 256 tokens" in row[0]


def test_a_sweeps_statistics_carry_their_ids_so_refine_reads_no_text_again(tmp_path, tiny_src, monkeypatch):
    """With the parent's samples a second reading is a second sampling: refine on gathered statistics uses
    the ids they were gathered from."""
    from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config
    from mha2gqa.convert import calibration

    config = read_config(tiny_src)
    (tmp_path / "stats").mkdir()
    stats = calibration.calibrate(
        tiny_src, layout_for(config), attention_shape(config), "parent", 512, tmp_path / "stats", progress=False
    )
    calls = []
    monkeypatch.setattr("mha2gqa.corpus.calibration.read_calibration", lambda *args, **kw: calls.append(args))
    result = convert(tiny_src, tmp_path / "dst", 2, method="calibrated", stats=stats, refine=QUICK, progress=False)
    assert result.refine["layers"] and calls == []
    assert _record(tmp_path / "dst")["calibration"]["ids_sha256"] == stats.record["ids_sha256"]
