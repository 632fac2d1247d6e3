"""A per-layer child loads with stock transformers and one line, where mha2gqa is not installed: the model code
write_remote_code copies in, named by config.json's auto_map, gives our registered class's logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from click.testing import CliRunner
from tiny_models import make_tiny_tokenizer, save_tiny_model

from mha2gqa.cli import main
from mha2gqa.files.loading import load_causal_lm
from mha2gqa.nemotron_nas.remote_code import CODE_FILES, load_line, write_remote_code

TINY = dict(intermediate_size=256, num_key_value_heads=4, num_hidden_layers=3, max_position_embeddings=64)

# Run in a Python started with -I (no PYTHONPATH, no user site, not the current folder) whose every import of
# mha2gqa fails, as in a venv without it (the editable install's finder sits on sys.meta_path: ours comes first).
LOADER = """
import importlib.abc, sys

class HideMha2gqa(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mha2gqa":
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the test)")

sys.meta_path.insert(0, HideMha2gqa())
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
assert not [m for m in sys.modules if m.split(".")[0] == "mha2gqa"]
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
print(type(model).__module__, type(model).__name__, [layer.self_attn.k_proj.out_features for layer in model.model.layers])
"""


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """A --kv-heads-per-layer 4,2,1 child with the code written in, as convert's writer does."""
    root = tmp_path_factory.mktemp("remote")
    save_tiny_model(root / "llama", "llama", **TINY)
    make_tiny_tokenizer(root / "llama")
    dst = root / "nas"
    run = CliRunner().invoke(main, ["convert", str(root / "llama"), str(dst), "--kv-heads-per-layer", "4,2,1", "-q"])
    assert run.exit_code == 0, run.output
    config = json.loads((dst / "config.json").read_text())
    added = write_remote_code(dst, config)
    (dst / "config.json").write_text(json.dumps({**config, **added}))
    return dst


def test_write_remote_code_copies_the_files_and_names_them(child):
    config = json.loads((child / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_decilm.NemotronNasConfig",
        "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM",
    }
    assert sorted(p.name for p in child.glob("*.py")) == sorted(CODE_FILES)
    for name in CODE_FILES:  # self-contained: nothing of mha2gqa imported
        assert "mha2gqa" not in [line.split()[1].split(".")[0] for line in (child / name).read_text().splitlines()
                                 if line.startswith(("import ", "from "))]  # fmt: skip


def test_stock_transformers_loads_it_without_mha2gqa(child, tmp_path):
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-I", "-c", LOADER, str(child), str(tmp_path / "ids.pt"), str(tmp_path / "logits.pt")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    module, name, widths = run.stdout.split(maxsplit=2)
    assert module.startswith("transformers_modules.") and name == "DeciLMForCausalLM"
    assert widths.strip() == "[32, 16, 8]"  # each layer's own kv heads (head_dim 8)
    with torch.no_grad():
        ours = load_causal_lm(child)(ids).logits  # mha2gqa's registered class
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), ours)


def test_a_uniform_config_gets_no_code(tmp_path):
    with pytest.raises(ValueError, match="model_type 'nemotron-nas'"):
        write_remote_code(tmp_path, {"model_type": "llama"})
    assert not list(tmp_path.iterdir())


def test_load_line():
    assert load_line("me/child") == 'AutoModelForCausalLM.from_pretrained("me/child", trust_remote_code=True)'


def test_the_card_gives_the_line_that_loads_it(child, tmp_path):
    """The card of a child carrying the code says trust_remote_code=True; the true KV ratio (768 B -> 448 B: 1.71x,
    not rounded to 2x); a uniform child's card gives the plain line."""
    from mha2gqa.records.card import render

    text = render(child, None, "me/nas")
    assert 'AutoModelForCausalLM.from_pretrained("me/nas", trust_remote_code=True)' in text
    assert "768 B → 448 B (1.71× smaller" in text
    uniform = tmp_path / "gqa"
    run = CliRunner().invoke(
        main, ["convert", str(child.parent / "llama"), str(uniform), "-g", "2", "-q", "--no-check"]
    )
    assert run.exit_code == 0, run.output
    plain = render(uniform, None, "me/gqa")
    assert 'AutoModelForCausalLM.from_pretrained("me/gqa")' in plain and "trust_remote_code" not in plain
