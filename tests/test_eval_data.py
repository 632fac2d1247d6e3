"""Eval text: files, folders, hub names when offline, identity hashes."""

import pytest
from tiny_models import make_tiny_tokenizer

from mha2gqa.eval.data import SEPARATOR, load_eval_text
from mha2gqa.runtime.errors import InputError


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def test_a_folder_is_its_text_files_in_sorted_order(tmp_path, tok):
    (tmp_path / "b.txt").write_text("second document")
    (tmp_path / "a.txt").write_text("first document")
    (tmp_path / "skip.bin").write_bytes(b"\x00\x01")
    text = load_eval_text(str(tmp_path), tok)
    joined = tok("first document" + SEPARATOR + "second document")["input_ids"]
    assert text.ids.tolist() == joined
    assert text.identity["source"] == "folder" and text.identity["documents"] == 2
    assert text.identity["tokens"] == len(joined)


def test_gzip_text_reads_like_the_plain_file(tmp_path, tok):
    import gzip

    (tmp_path / "plain.txt").write_text("a single man in possession")
    (tmp_path / "packed.txt.gz").write_bytes(gzip.compress(b"a single man in possession"))
    plain, packed = (
        load_eval_text(str(tmp_path / "plain.txt"), tok),
        load_eval_text(str(tmp_path / "packed.txt.gz"), tok),
    )
    assert packed.ids.tolist() == plain.ids.tolist()
    assert load_eval_text(str(tmp_path), tok).identity["documents"] == 2


def test_same_text_same_hash_and_max_tokens_cuts(tmp_path, tok):
    (tmp_path / "t.txt").write_text("It is a truth universally acknowledged.")
    one, two = load_eval_text(str(tmp_path / "t.txt"), tok), load_eval_text(str(tmp_path / "t.txt"), tok)
    assert one.identity["ids_sha256"] == two.identity["ids_sha256"]
    cut = load_eval_text(str(tmp_path / "t.txt"), tok, max_tokens=5)
    assert cut.ids.tolist() == one.ids[:5].tolist() and cut.identity["ids_sha256"] != one.identity["ids_sha256"]


@pytest.mark.parametrize(
    "setup,message",
    [
        (lambda p: (p / "empty").mkdir(), "the folder holds no .txt/.text/.md/.jsonl/.json/.parquet"),
        (lambda p: (p / "fake.txt.gz").write_text("not gzip"), "ends in .gz but is not readable gzip data"),
        (lambda p: (p / "bad.txt").write_bytes(b"\xff\xfe abc"), "not UTF-8 text"),
        (lambda p: (p / "blank.txt").write_text("   \n"), "has no text"),
    ],
)
def test_bad_local_data_is_refused(tmp_path, tok, setup, message):
    setup(tmp_path)
    target = next(tmp_path.iterdir())
    with pytest.raises(InputError, match=message):
        load_eval_text(str(target), tok)


def test_hub_dataset_name_offline_is_refused(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match="--data wikitext: not a local file or folder, and the hub is offline"):
        load_eval_text("wikitext", tok, config="wikitext-2-raw-v1")
