"""The CLI answers without importing torch and friends: `--help` and `inspect` load only what they
need. Timing is machine-dependent, so the tests check what was imported (which can fail), and run
bench/cli_startup.py once at its smoke size so the benchmark cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import MODEL_TYPES, save_tiny_model

from mha2gqa.architecture.layouts import attention_shape, layout_for, read_config
from mha2gqa.convert.inspect import _count_on_meta, _count_parameters
from mha2gqa.files import embedded

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "accelerate", "datasets", "matplotlib", "safetensors", "numpy")


def heavy_modules_after(code: str) -> dict:
    """Run `code` in a fresh interpreter; return what it printed last (JSON) and the heavy modules loaded."""
    script = f"import json, sys\n{code}\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return {"heavy": json.loads(done.stdout.splitlines()[-1]), "stdout": done.stdout}


def test_importing_the_cli_imports_nothing_heavy():
    assert heavy_modules_after("import mha2gqa.cli")["heavy"] == []


COMMANDS = ("convert", "inspect", "uptrain", "eval", "report", "demo", "reproduce")


def test_help_lists_every_command_without_torch():
    run = heavy_modules_after("from mha2gqa.cli import main\nmain(['--help'], standalone_mode=False)")
    assert run["heavy"] == []
    for command in COMMANDS:
        assert f"  {command} " in run["stdout"]


def test_every_commands_help_answers_without_torch():
    code = "\n".join(
        [
            "import contextlib, io",
            "from mha2gqa.cli import main",
            "helps = {}",
            f"for command in {COMMANDS!r}:",
            "    out = io.StringIO()",
            "    with contextlib.redirect_stdout(out):",
            "        main([command, '--help'], standalone_mode=False)",
            "    helps[command] = out.getvalue()",
            "print(json.dumps(helps))",
        ]
    )
    run = heavy_modules_after(code)
    assert run["heavy"] == []
    helps = json.loads(run["stdout"].splitlines()[-2])
    assert all(text.startswith("Usage: ") and f" {command} " in text.splitlines()[0] for command, text in helps.items())


def test_inspect_reads_config_and_headers_without_torch():
    code = f"from mha2gqa.cli import main\nmain(['inspect', {str(embedded.model_dir())!r}, '--json'], standalone_mode=False)"
    run = heavy_modules_after(code)
    assert run["heavy"] == []
    info = json.loads(run["stdout"][: run["stdout"].rindex("[")])
    assert (info["heads"], info["kv_heads"], info["parameters"]) == (8, 8, 6_163_712)


def test_convert_help_lists_every_method_without_torch():
    run = heavy_modules_after("from mha2gqa.cli import main\nmain(['convert', '--help'], standalone_mode=False)")
    assert run["heavy"] == []
    text = " ".join(run["stdout"].split())
    assert "mean: mean-pool each group's K/V heads" in text and "first: keep the first K/V head" in text
    from mha2gqa.convert import METHOD_SUMMARIES
    from mha2gqa.convert.methods import METHODS

    assert {name: m.summary for name, m in METHODS.items()} == METHOD_SUMMARIES  # the menu is what runs
    assert all(f"{name}: {summary}" in text for name, summary in METHOD_SUMMARIES.items())


def test_mha2gqa_convert_is_callable_and_imported_on_first_use():
    code = (
        "import mha2gqa\nassert 'mha2gqa.convert' not in sys.modules\n"
        "assert callable(mha2gqa.convert) and 'mha2gqa.convert' in sys.modules\n"
        "import mha2gqa.convert.plan\nfrom mha2gqa import convert\nassert convert is sys.modules['mha2gqa.convert']"
    )
    heavy_modules_after(code)  # the asserts run in a fresh interpreter: nothing imported mha2gqa.convert before
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        import mha2gqa

        _ = mha2gqa.nothing


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_header_count_equals_the_models_parameter_count(tmp_path, model_type):
    """inspect counts stored tensors; transformers counts parameters on the meta device: the same."""
    save_tiny_model(tmp_path, model_type)
    config = read_config(tmp_path)
    layout, shape = layout_for(config), attention_shape(config)
    assert _count_parameters(tmp_path, layout, shape) == _count_on_meta(tmp_path, layout, shape)


def test_the_startup_benchmark_runs_at_its_smoke_size():
    done = subprocess.run(
        [sys.executable, "bench/cli_startup.py", "--smoke"], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("1 rounds, load average")
    row = next(line for line in lines if line.startswith("mha2gqa --help"))
    assert float(row.split()[2]) > 0 and "<= 0.3 s over bare start" in row
