"""Every command's stages come from one declaration (mha2gqa/estimates/stages.py; issue 54 item 1): the plan lists,
the estimate prices and the clock times only declared stages, and every declared stage is timed."""

import ast
from pathlib import Path

import pytest

from mha2gqa.estimates import stages
from mha2gqa.estimates.costs import EvalWork, UptrainWork, eval_stages, uptrain_stages
from mha2gqa.estimates.stages import EVAL, Declared, declared, is_declared

PACKAGE = Path(__file__).resolve().parent.parent / "mha2gqa"

EXPECTED = {  # the names the output and the estimates have always used: renaming one is a visible change
    "convert": [
        "start", "load", "sample", "calibrate", "layer losses", "retrieval heads", "merge", "refine", "refine (global)",
        "write", "check", "metadata",
    ],
    "eval": ["start", "load", "quality: ", "retrieval", "kv cache", "decode speed", "attention maps", "lm-eval"],
    "uptrain": ["start", "load", "train", "save"],
    "sweep": ["start", "load", "evaluate parent", "calibrate", "layer losses", "candidate "],
    "demo": [
        "start", "convert", "evaluate parent", "evaluate converted", "uptrain", "evaluate uptrained", "report",
    ],
}  # fmt: skip
MARKS = {"stage"}  # clock.stage(name)
NAMERS = {"Stage", "StageCost", "combined", "_evaluation"}  # the plan's and the estimate's stage, by its name
COMMANDS = {name.upper() for name in stages.COMMANDS} | {"START"}


@pytest.mark.parametrize("command", sorted(EXPECTED))
def test_each_command_lists_its_stages_from_the_one_declaration(command):
    assert [s.name for s in declared(command)] == EXPECTED[command]
    families = [s.name for s in declared(command) if s.family]
    assert families == {"eval": ["quality: "], "sweep": ["candidate "]}.get(command, [])


def _calls(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            on_clock = isinstance(func, ast.Attribute) and "clock" in ast.unparse(func.value)
            if name in MARKS and on_clock or name in NAMERS:
                yield name, node.args[0] if node.args else None, node
            for keyword in node.keywords:  # eval's Measurement(stage=...): eval/run.py times measurement.stage
                if keyword.arg == "stage":
                    yield "stage", keyword.value, node


def _declaration(node) -> Declared | None:
    """The declared stage `node` names: CONVERT.load.name, EVAL.quality.member(domain), START.name."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "member":
        node = node.func.value
    elif isinstance(node, ast.Attribute) and node.attr == "name":
        node = node.value
    else:
        return None
    parts = ast.unparse(node).split(".")
    if parts[0] not in COMMANDS or len(parts) > 2:
        return None
    found = getattr(stages, parts[0])
    return getattr(found, parts[1]) if len(parts) == 2 else found


def _scan():
    """Every stage name marked, priced or planned in the package: [(where, call, argument node)]."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, argument, node in _calls(tree):
            found.append((f"{path.relative_to(PACKAGE)}:{node.lineno}", name, argument))
    return found


def test_no_stage_is_timed_priced_or_planned_under_a_name_of_its_own():
    literal = []
    for where, call, argument in _scan():
        texts = [n for n in ast.walk(argument) if isinstance(n, ast.JoinedStr | ast.Constant)] if argument else []
        if any(isinstance(n, ast.JoinedStr) or isinstance(n.value, str) for n in texts):
            literal.append(f"{where}: {call}({ast.unparse(argument)})")
    assert not literal, "stage names written in place, not taken from estimates/stages.py:\n" + "\n".join(literal)


def test_every_declared_stage_is_timed():
    timed = {id(_declaration(argument)) for _, call, argument in _scan() if call in MARKS and argument is not None}
    clock = ast.parse((PACKAGE / "estimates" / "clock.py").read_text())
    if any(isinstance(n, ast.Name) and n.id == "START" for n in ast.walk(clock)):
        timed.add(id(stages.START))  # every clock starts in the start stage
    from mha2gqa.convert.prepare import _WORK  # convert's executor marks each planned stage that has work

    timed |= {id(s) for s in declared("convert") if s.name in _WORK}
    never = [f"{c}: {s.name!r}" for c in stages.COMMANDS for s in declared(c) if id(s) not in timed]
    assert not never, f"declared but never timed: {never}"


def test_the_scan_sees_a_literal_and_a_declared_name():
    """The checks above can fail: a string in place of a declaration is caught, a declaration is resolved."""
    tree = ast.parse('clock.stage("load")\nclock.stage(EVAL.quality.member(d))\nStageCost(f"x {y}", ())')
    found = list(_calls(tree))
    assert [name for name, _, _ in found] == ["stage", "stage", "StageCost"]
    assert isinstance(found[0][1], ast.Constant) and isinstance(found[2][1], ast.JoinedStr)
    assert _declaration(found[1][1]) is EVAL.quality


def test_eval_and_uptrain_estimates_price_only_declared_stages_with_their_declared_kinds():
    work = EvalWork(1000, 1000, 50, 8000, {"prose": (100, 90)}, 2, 3, 40, 20, attention_tokens=12)
    priced = {"eval": eval_stages(work)}
    priced["uptrain"] = uptrain_stages(UptrainWork(1000, 1000, 4000, 10_000, 2, 100, sampled_tokens=50))
    for command, costs in priced.items():
        for cost in costs:
            assert is_declared(command, cost.name), (command, cost.name)
            (declaration,) = [
                s for s in declared(command) if cost.name.startswith(s.name) and (s.family or s.name == cost.name)
            ]
            assert {p.kind for p in cost.parts} <= set(declaration.kinds), (command, cost.name)
    assert [s.name for s in priced["eval"]] == [
        "start", "load", "quality: prose", "retrieval", "kv cache", "decode speed", "attention maps", "lm-eval",
    ]  # fmt: skip


def test_eval_prices_its_attention_maps_only_when_it_draws_them():
    without = EvalWork(1000, 1000, 50, 8000, {"prose": (100, 90)}, 0)
    assert EVAL.attention_maps.name not in [s.name for s in eval_stages(without)]
    drawn = EvalWork(1000, 1000, 50, 8000, {"prose": (100, 90)}, 0, attention_tokens=12)
    (maps,) = [s for s in eval_stages(drawn) if s.name == EVAL.attention_maps.name]
    assert maps.seconds() > 0
    assert maps.parts[0].work == {"forward": 12 * 2000}  # the model and the reference, each over the text


def test_a_family_builds_its_members_and_a_whole_name_builds_none():
    assert EVAL.quality.member("prose") == "quality: prose"
    assert is_declared("eval", "quality: code") and not is_declared("eval", "quality")
    assert not is_declared("uptrain", "quality: prose")
    with pytest.raises(ValueError, match="not a family"):
        EVAL.load.member("x")


class _Recorder:
    """A clock that keeps the stages marked and the estimate it was given."""

    def __init__(self):
        self.marks, self.estimate = [], None

    def begin(self, estimate):
        self.estimate = estimate()

    def stage(self, name):
        self.marks.append(name)

    def partial(self, fraction):
        pass

    def finish(self):
        return 0.0


CONVERSIONS = {
    "mean, numpy": ["-g", "2"],
    "calibrated, refine, budget": [
        "--kv-budget", "0.5", "--method", "calibrated", "--refine", "--refine-steps", "2", "--refine-global-steps", "2",
        "--calibration", "CAL", "--calibration-tokens", "512",
    ],
    "keep retrieval heads, no check": ["-g", "2", "--keep-retrieval-heads", "--no-check"],
}  # fmt: skip


@pytest.mark.parametrize("args", list(CONVERSIONS.values()), ids=list(CONVERSIONS))
def test_a_conversion_runs_and_prices_exactly_the_stages_its_plan_lists(tmp_path, args):
    """execute marks the plan's stages, in its order, and no other (beyond the process' load); the estimate prices
    those stages with the parts they carry (issue 65 item 1)."""
    from tiny_models import save_tiny_inputs

    from mha2gqa.convert.run import execute, plan_conversion

    root = save_tiny_inputs(tmp_path, num_key_value_heads=4, intermediate_size=256, max_position_embeddings=128)
    words = [str(root / "cal.txt") if word == "CAL" else word for word in args]
    options = _options(words + ["-q"])
    plan = plan_conversion(root / "src", tmp_path / "dst", options)
    clock = _Recorder()
    execute(plan, tmp_path / "dst", clock)
    listed = [s.name for s in plan.stages if not s.skipped]
    process = ["load"] if plan.torch_reason is not None else []
    assert clock.marks == process + listed
    priced = [stage.name for stage in clock.estimate.stages]
    assert priced == ["start"] + process + [s.name for s in plan.stages if s.parts]
    for stage, cost in zip([s for s in plan.stages if s.parts], clock.estimate.stages[1 + len(process) :]):
        assert cost.parts == stage.parts  # priced from what the stage carries, not apart from it
    assert all(s.run is not None for s in plan.stages if not s.skipped and s.name != "refine (global)")


def _options(words):
    """ConvertOptions from command-line words, through the one flag table (as the CLI builds them)."""
    import click

    from mha2gqa.cli.convert_cmd import convert as command
    from mha2gqa.convert.options import options_from_flags

    context = command.make_context("convert", ["SRC", "DST", *words])
    assert isinstance(context, click.Context)
    flags = {k: v for k, v in context.params.items() if k not in ("src", "dst", "plan_tensors")}
    return options_from_flags(flags)
