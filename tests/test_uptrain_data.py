"""Data: packing with EOS between documents, deterministic per-rank batches, held-out eval, schedule."""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import make_tiny_tokenizer
from uptrain_helpers import corpus, recipe_file

from mha2gqa.corpus import textdata
from mha2gqa.corpus.blocks import pack, pack_all
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain import load_recipe
from mha2gqa.uptrain.data import MemoryBatches, StreamBatches, block_hash, build_data, rank_slice
from mha2gqa.uptrain.plan import total_steps
from mha2gqa.uptrain.recipe import OptimConfig
from mha2gqa.uptrain.steps import lr_at

EOS = 2


def test_pack_puts_eos_between_documents_without_padding():
    docs = [[10, 11, 12], [20, 21], [30, 31, 32, 33]]
    blocks = pack_all(docs, EOS, seq_len=4)
    # stream: 10 11 12 E 20 21 E 30 31 32 33 E  -> 3 full blocks of 4, nothing left over
    assert blocks.tolist() == [[10, 11, 12, EOS], [20, 21, EOS, 30], [31, 32, 33, EOS]]
    assert blocks.dtype == torch.int32
    # the tail that does not fill a block is dropped, never padded
    assert pack_all(docs + [[40]], EOS, seq_len=5).tolist() == [[10, 11, 12, EOS, 20], [21, EOS, 30, 31, 32]]
    assert sum(len(c) for c in pack(iter([[1] * 9]), EOS, 5)) == 2
    assert pack_all(docs, EOS, seq_len=4, limit=2).shape == (2, 4)


def _blocks(n=40, seq=8):
    return torch.arange(n * seq, dtype=torch.int32).reshape(n, seq)


def test_memory_batches_are_deterministic_disjoint_between_ranks_and_resumable():
    blocks = _blocks()
    ranks = [MemoryBatches(blocks, micro_batch=3, rank=r, world_size=2, seed=7) for r in range(2)]
    per_epoch = 40 // 6
    assert ranks[0].per_epoch == per_epoch
    seen = [[block_hash(b) for m in range(per_epoch) for b in rk.batch(m)] for rk in ranks]
    assert set(seen[0]).isdisjoint(seen[1])  # several ranks never see the same block
    assert len(set(seen[0]) | set(seen[1])) == per_epoch * 6  # and no block twice within an epoch
    again = MemoryBatches(blocks, 3, 0, 2, seed=7)
    assert torch.equal(again.batch(5), ranks[0].batch(5))
    other_seed = MemoryBatches(blocks, 3, 0, 2, seed=8)
    assert not torch.equal(other_seed.batch(0), ranks[0].batch(0))
    # a resumed iterator continues exactly; the next epoch is a different order
    it = ranks[1].batches(0)
    first = [next(it) for _ in range(per_epoch + 2)]
    resumed = ranks[1].batches(4)
    assert all(torch.equal(next(resumed), first[m]) for m in range(4, per_epoch + 2))
    assert not torch.equal(first[per_epoch], first[0])
    assert first[0].dtype == torch.int64 and first[0].shape == (3, 8)


def test_too_little_data_is_an_input_error():
    with pytest.raises(InputError, match="fewer than one batch"):
        MemoryBatches(_blocks(3), micro_batch=2, rank=0, world_size=2, seed=0)


def test_rank_slice_gives_every_rank_the_same_count():
    blocks = _blocks(7)
    parts = [rank_slice(blocks, r, 3) for r in range(3)]
    assert [len(p) for p in parts] == [2, 2, 2]
    assert sorted(int(p[i, 0]) for p in parts for i in range(2)) == sorted(int(b[0]) for b in blocks[:6])


def test_streaming_ranks_take_disjoint_documents_and_resume_exactly(tmp_path):
    tokenizer = make_tiny_tokenizer()
    data = corpus(tmp_path / "c.jsonl", docs=60)
    source = textdata.resolve("data.train", [str(data)])
    recipe = load_recipe(
        recipe_file(
            tmp_path / "r.yaml", model=str(tmp_path), output_dir="o", data={"train": str(data), "streaming": True}
        ),
        validate_files=False,
    )
    ds = textdata.load_documents(source, recipe.data.text_field, streaming=True)
    streams = [StreamBatches(ds, "text", tokenizer, EOS, 16, 2, rank, 2, seed=3, buffer=16) for rank in range(2)]
    batches = [[b for _, b in zip(range(10), s.batches(0))] for s in streams]
    hashes = [{block_hash(row) for b in bs for row in b} for bs in batches]
    assert hashes[0] and hashes[1] and hashes[0].isdisjoint(hashes[1])
    resumed = streams[0].batches(6)
    assert all(torch.equal(next(resumed), batches[0][m]) for m in range(6, 10))


@pytest.mark.parametrize("streaming", [False, True])
def test_held_out_eval_blocks_never_train(tmp_path, streaming):
    tokenizer = make_tiny_tokenizer()
    data = corpus(tmp_path / "c.jsonl", docs=80)
    recipe = load_recipe(
        recipe_file(
            tmp_path / "r.yaml",
            model=str(tmp_path),
            output_dir="o",
            seq_len=16,
            data={"train": str(data), "eval_blocks": 10, "streaming": streaming},
        ),
        validate_files=False,
    )
    data = build_data(recipe, tokenizer, rank=0, world_size=1, show_progress=False)
    assert data.eval.shape == (10, 16)
    held = {block_hash(b) for b in data.eval}
    trained = {block_hash(row) for _, b in zip(range(30), data.train.batches(0)) for row in b}
    assert trained and held.isdisjoint(trained)
    if not streaming:
        assert data.train_blocks == len(data.train.blocks) and data.train_blocks > 30


def test_separate_eval_file_and_missing_text_field(tmp_path):
    tokenizer = make_tiny_tokenizer()
    train, held = corpus(tmp_path / "t.jsonl", docs=40), corpus(tmp_path / "e.jsonl", docs=20, seed=1)
    recipe = load_recipe(
        recipe_file(
            tmp_path / "r.yaml",
            model=str(tmp_path),
            output_dir="o",
            seq_len=16,
            data={"train": str(train), "eval": str(held), "eval_blocks": 5},
        ),
        validate_files=False,
    )
    data = build_data(recipe, tokenizer, 0, 1, show_progress=False)
    expected = pack_all(
        tokenizer(
            [r["text"] for r in textdata.load_documents(textdata.resolve("e", [str(held)]))], add_special_tokens=False
        )["input_ids"],
        EOS,
        16,
        limit=5,
    )
    assert torch.equal(data.eval, expected)
    recipe.data.text_field = "body"
    with pytest.raises(InputError, match=r"e.jsonl:1: has no 'body' field \(fields: text\): set data.text_field"):
        build_data(recipe, tokenizer, 0, 1, show_progress=False)


def test_budget_and_learning_rate_schedule(tmp_path):
    recipe = load_recipe(
        recipe_file(
            tmp_path / "r.yaml",
            model=str(tmp_path),
            output_dir="o",
            data={"train": "x.txt"},
            budget={"max_steps": None, "alpha": 0.05, "pretrain_tokens": 1_000_000},
        ),
        validate_files=False,
    )
    # 0.05 * 1e6 tokens / (32 seq * 4 batch * 1 accum * 2 ranks) = 195.3 -> 196 steps
    assert total_steps(recipe, world_size=2) == math.ceil(50_000 / 256) == 196
    optim = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1, schedule="cosine")
    assert [lr_at(s, 14, optim) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, 14, optim) == pytest.approx(1.0) and lr_at(13, 14, optim) == pytest.approx(0.1)
    assert lr_at(8, 14, optim) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 4 / 9)))
    linear = OptimConfig(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="linear")
    assert [lr_at(s, 5, linear) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_at(3, 5, OptimConfig(lr=0.5, schedule="constant")) == 0.5


def test_data_files_are_checked_once_when_loaded_and_when_read_otherwise(tmp_path, monkeypatch):
    """load_recipe checks the data files and build_data reads the sources it found (no second walk);
    a recipe loaded without the file checks, or changed since, has them checked when its data is read."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        '{"model_type": "llama", "num_attention_heads": 4, "hidden_size": 32, "num_hidden_layers": 2}'
    )
    path = recipe_file(
        tmp_path / "r.yaml",
        model=str(model),
        output_dir=str(tmp_path / "o"),
        seq_len=16,
        data={"train": str(corpus(tmp_path / "t.jsonl", docs=40)), "eval_blocks": 5},
    )
    recipe, tokenizer = load_recipe(path), make_tiny_tokenizer()
    resolved = []
    resolve = textdata.resolve
    monkeypatch.setattr(textdata, "resolve", lambda key, *a, **kw: resolved.append(key) or resolve(key, *a, **kw))
    assert len(build_data(recipe, tokenizer, 0, 1, show_progress=False).eval) == 5
    assert resolved == []
    gone = tmp_path / "gone.jsonl"
    recipe.data.train = [str(gone)]
    with pytest.raises(InputError, match=f"data.train {gone}: no such file or folder"):
        build_data(recipe, tokenizer, 0, 1, show_progress=False)
    unchecked = load_recipe(path, [f"data.train={gone}"], validate_files=False)
    with pytest.raises(InputError, match=f"data.train {gone}: no such file or folder"):
        build_data(unchecked, tokenizer, 0, 1, show_progress=False)
    # the changed recipe's read, load_recipe's own check of the override, the unchecked recipe's read
    assert resolved == ["data.train", "data.train", "data.train"]
