"""The embedded default: the vendored corpus, its tokenizer, and the trained MHA model."""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from mha2gqa import InputError
from mha2gqa.files import embedded

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "austen-mha-pretrain.yaml"


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _checksums() -> dict[str, str]:
    lines = (embedded.CORPUS_DIR / "SHA256SUMS").read_text().splitlines()
    return {name: digest for digest, name in (line.split() for line in lines)}


# ---- corpus ----------------------------------------------------------------------------------


def test_corpus_files_decompress_to_the_recorded_texts():
    sums = _checksums()
    assert sorted(sums) == [f"{n}.txt" for n in embedded.NOVELS]
    provenance = (embedded.CORPUS_DIR / "PROVENANCE.md").read_text()
    assert "public domain" in provenance and "Project Gutenberg" in provenance
    for name in embedded.NOVELS:
        raw = gzip.decompress(embedded.novel_path(name).read_bytes())
        assert hashlib.sha256(raw).hexdigest() == sums[f"{name}.txt"], name
        # The provenance table names the same size and digest as the checksum file.
        assert f"| `{name}.txt.gz` | {len(raw)} | `{sums[name + '.txt']}` |" in provenance
        assert len(raw) > 400_000  # a whole novel, not a stub


def test_persuasion_is_held_out_of_training():
    assert embedded.HELDOUT_NOVEL == "persuasion"
    assert embedded.HELDOUT_NOVEL not in embedded.TRAIN_NOVELS
    assert len(embedded.TRAIN_NOVELS) == 5
    assert embedded.heldout_path().name == "persuasion.txt.gz"
    assert [p.name for p in embedded.train_paths()] == [f"{n}.txt.gz" for n in embedded.TRAIN_NOVELS]
    assert embedded.read_novel("persuasion").startswith("Persuasion")


def test_write_corpus_gives_plain_text_for_datasets(tmp_path):
    paths = embedded.write_corpus(tmp_path / "corpus", split="heldout")
    assert [p.name for p in paths] == ["persuasion.txt"]
    text = paths[0].read_text()
    assert text == embedded.read_novel("persuasion")
    assert len(embedded.write_corpus(tmp_path / "corpus", split="train")) == 5
    from datasets import load_dataset

    ds = load_dataset("text", data_files=[str(p) for p in paths], cache_dir=str(tmp_path / "cache"))["train"]
    assert len(ds) == len(text.splitlines())


def test_bad_split_and_novel_names_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="split 'test' is not known: choose one of train, heldout, all"):
        embedded.write_corpus(tmp_path, split="test")
    with pytest.raises(InputError, match="unknown novel 'ulysses'"):
        embedded.novel_path("ulysses")
    (tmp_path / "f").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        embedded.write_corpus(tmp_path / "f")


# ---- tokenizer -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded.tokenizer_dir())


def test_tokenizer_round_trips_text(tokenizer):
    samples = [embedded.read_novel("persuasion")[:20_000], "  Anne Elliot -- café, naïve ✓\n\tend", ""]
    for text in samples:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
    assert 4000 <= len(tokenizer) <= 8200
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    # Byte-level BPE compresses English prose: several characters per token.
    prose = samples[0]
    assert len(prose) / len(tokenizer(prose)["input_ids"]) > 3.0


def test_tokenizer_is_reproduced_by_its_script(tmp_path):
    _load_script("train_tokenizer").main(["--out", str(tmp_path)])
    shipped = json.loads((embedded.tokenizer_dir() / "tokenizer.json").read_text())
    rebuilt = json.loads((tmp_path / "tokenizer.json").read_text())
    assert rebuilt["model"]["merges"] == shipped["model"]["merges"]
    assert rebuilt["model"]["vocab"] == shipped["model"]["vocab"]


# ---- model -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_info():
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        embedded.model_dir(), dtype=torch.float32, output_loading_info=True
    )
    return model.eval(), info


def test_embedded_model_loads_completely_and_is_mha(model_and_info, tokenizer):
    model, info = model_and_info
    assert not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    cfg = model.config
    assert cfg.model_type == "llama"
    assert cfg.num_key_value_heads == cfg.num_attention_heads >= 4
    assert cfg.vocab_size == len(tokenizer)
    size = sum(p.stat().st_size for p in embedded.model_dir().glob("*.safetensors"))
    assert 0 < size <= 31 * 2**20


def test_embedded_model_beats_the_unigram_baseline_by_3x(model_and_info, tokenizer):
    """Perplexity (the package's, as `mha2gqa eval` measures it) on a slice of held-out Persuasion vs an
    add-one unigram model computed here."""
    from mha2gqa.scoring.perplexity import perplexity

    model, _ = model_and_info
    vocab = len(tokenizer)
    counts = torch.zeros(vocab, dtype=torch.float64)
    for name in embedded.TRAIN_NOVELS:
        ids = torch.tensor(tokenizer.backend_tokenizer.encode(embedded.read_novel(name)).ids)
        counts += torch.bincount(ids, minlength=vocab)
    log_p = torch.log((counts + 1) / (counts.sum() + vocab))  # (V,)
    text = embedded.read_novel("persuasion")
    ids = torch.tensor(tokenizer.backend_tokenizer.encode(text[100_000:140_000]).ids)
    x = ids[: (len(ids) // 256) * 256].view(-1, 256)[:8]  # (8, 256) windows
    scored = perplexity(model, x.flatten(), context=256, stride=256, batch_size=8)
    assert scored["tokens_scored"] == 8 * 255 and scored["windows"] == 8  # the same tokens as the unigram's
    unigram_nll = -log_p[x[:, 1:]].mean().item()
    assert scored["perplexity"] <= math.exp(unigram_nll) / 3, (scored["perplexity"], math.exp(unigram_nll))


def test_model_provenance_records_its_pretraining():
    model_dir = embedded.model_dir()
    record = json.loads((model_dir / "mha2gqa.json").read_text())["uptrain"]
    tokens = embedded.pretrain_tokens()
    assert tokens == record["tokens_seen"] == record["steps"] * record["tokens_per_step"] > 1_000_000
    assert record["recipe"]["init_from_config"] and record["recipe"]["model"] is None  # from scratch
    assert all("persuasion" not in path for path in record["recipe"]["data"]["train"])
    assert f"{tokens:,}" in (model_dir / "PROVENANCE.md").read_text()
    rows = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert rows[-1]["step"] == record["steps"]
    evals = [row["eval_loss"] for row in rows if "eval_loss" in row]
    assert len(evals) >= 3 and evals[-1] < evals[0] - 2.0  # it learned, on held-out text


def test_pretrain_recipe_names_its_command_and_holds_out_persuasion(monkeypatch):
    first = RECIPE.read_text().splitlines()[0]
    assert first == f"# mha2gqa uptrain --recipe recipes/{RECIPE.name}"
    from mha2gqa.uptrain import load_recipe

    monkeypatch.chdir(ROOT)  # the recipe's paths are relative to the repository root
    recipe = load_recipe(RECIPE)
    assert recipe.model is None and recipe.init_from_config
    assert sorted(Path(p).name for p in recipe.data.train) == [p.name for p in embedded.train_paths()]
    assert [Path(p).name for p in recipe.data.eval] == [embedded.heldout_path().name]
    assert recipe.seq_len == json.loads((embedded.model_dir() / "config.json").read_text())["max_position_embeddings"]
    # The shipped recipe is the one the shipped model was trained with (nothing drifted since).
    # Sections added to the schema since then (lora) must sit at their defaults, i.e. change nothing.
    from dataclasses import asdict

    from mha2gqa.uptrain.recipe import LoraConfig

    shipped = json.loads((embedded.model_dir() / "mha2gqa.json").read_text())["uptrain"]["recipe"]
    resolved = recipe.to_dict()
    added = {key: resolved.pop(key) for key in set(resolved) - set(shipped)}
    for section, values in resolved.items():  # fields added to a section since: at their no-op defaults
        if isinstance(values, dict) and isinstance(shipped.get(section), dict):
            added |= {f"{section}.{key}": values.pop(key) for key in set(values) - set(shipped[section])}
    assert resolved == shipped
    assert added == {
        "lora": asdict(LoraConfig()),
        "distill.answer_weight": 1.0,
        "eval_retrieval": False,
        "eval_domains": False,
    }


def test_heads_are_distinct_and_the_similarity_measure_sees_copies(model_and_info):
    stats = _load_script("embedded_stats")
    model, _ = model_and_info
    rows = stats.head_similarity(model)
    assert len(rows) == model.config.num_hidden_layers
    assert all(abs(row["k"]) < 0.05 and abs(row["v"]) < 0.05 for row in rows), rows
    pooled = stats.mean_pooled(model, groups=1)  # every head replaced by the mean: all identical
    assert all(
        row["k"] == pytest.approx(1.0) and row["v"] == pytest.approx(1.0) for row in stats.head_similarity(pooled)
    )
    same = stats.mean_pooled(model, groups=model.config.num_key_value_heads)  # groups of one: unchanged
    torch.testing.assert_close(
        same.model.layers[0].self_attn.k_proj.weight, model.model.layers[0].self_attn.k_proj.weight
    )


def test_the_stats_scripts_pooled_model_is_the_converted_one(model_and_info, tmp_path):
    """`embedded_stats.py --pooled G` reports the perplexity of what `mha2gqa convert --groups G` writes."""
    from transformers import AutoModelForCausalLM

    from mha2gqa.convert.run import convert

    stats = _load_script("embedded_stats")
    model, _ = model_and_info
    convert(embedded.model_dir(), tmp_path / "gqa2", groups=2, progress=False)
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa2", dtype=torch.float32).eval()
    ids = torch.tensor([list(range(5, 69))])
    with torch.no_grad():
        torch.testing.assert_close(
            stats.mean_pooled(model, groups=2)(ids).logits, converted(ids).logits, rtol=1e-5, atol=1e-5
        )
        assert (model(ids).logits - converted(ids).logits).abs().max() > 1e-2  # pooling changed something
