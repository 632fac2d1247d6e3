"""mha2gqa.corpus.textdata: one set of formats and one set of errors for calibration, eval and uptrain."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma

import pytest
from click.testing import CliRunner

from mha2gqa.cli import main
from mha2gqa.corpus import textdata
from mha2gqa.files import embedded
from mha2gqa.runtime.errors import InputError

DOCS = ["It is a truth universally acknowledged.", "Emma Woodhouse, handsome, clever, and rich."]


def _jsonl(docs, field="text") -> str:
    return "".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs))


def _parquet(path, docs, field="text"):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({field: docs, "id": list(range(len(docs)))}), path)


def _texts(spec, **kwargs) -> list[str]:
    return list(textdata.iter_texts(textdata.resolve("--data", spec), **kwargs))


# every format reads to the same documents
WRITERS = {
    "plain.jsonl": lambda p: p.write_text(_jsonl(DOCS)),
    "records.json": lambda p: p.write_text(json.dumps([{"text": d} for d in DOCS])),
    "lines.json": lambda p: p.write_text(_jsonl(DOCS)),
    "table.parquet": lambda p: _parquet(p, DOCS),
    "c.jsonl.gz": lambda p: p.write_bytes(gzip.compress(_jsonl(DOCS).encode())),
    "c.jsonl.bz2": lambda p: p.write_bytes(bz2.compress(_jsonl(DOCS).encode())),
    "c.jsonl.xz": lambda p: p.write_bytes(lzma.compress(_jsonl(DOCS).encode())),
}


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_every_record_format_gives_the_same_documents_by_both_readers(tmp_path, name):
    WRITERS[name](tmp_path / name)
    assert _texts(str(tmp_path / name)) == DOCS
    ds = textdata.load_documents(textdata.resolve("data.train", str(tmp_path / name)))
    assert [row["text"] for row in ds] == DOCS  # `datasets` (uptrain) reads the same records


@pytest.mark.parametrize(
    "suffix,compress",
    [
        (".txt", bytes),
        (".md", bytes),
        (".text", bytes),
        (".txt.gz", gzip.compress),
        (".txt.bz2", bz2.compress),
        (".txt.xz", lzma.compress),
    ],
)
def test_a_text_file_is_one_document_exactly_as_written(tmp_path, suffix, compress):
    text = "Chapter 1\n\nIt is a truth \u2014 universally acknowledged.\n"
    (tmp_path / f"novel{suffix}").write_bytes(compress(text.encode("utf-8")))
    assert _texts(str(tmp_path / f"novel{suffix}")) == [text]
    ds = textdata.load_documents(textdata.resolve("data.train", str(tmp_path / f"novel{suffix}")))
    assert [row["text"] for row in ds] == [text]


def test_a_folder_is_its_known_files_in_sorted_order_recursively(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "z.txt").write_text("third")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "a2.jsonl").write_text(_jsonl(["second"]))
    (tmp_path / "notes.bin").write_bytes(b"\xff\x00")  # unknown suffixes in a folder are skipped
    source = textdata.resolve("--data", str(tmp_path))
    assert source.folder and [p.name for p in source.files] == ["a.txt", "a2.jsonl", "z.txt"]
    assert _texts(str(tmp_path)) == ["first", "second", "third"]


def test_pieces_cut_at_line_ends_and_a_blank_line_ends_each_document(tmp_path):
    lines = [f"line {i} of a long novel\n" for i in range(400)]
    (tmp_path / "a.txt").write_text("".join(lines))
    (tmp_path / "b.jsonl").write_text(_jsonl(["record one", "record two\n"]))
    (tmp_path / "c.txt").write_text("no newline at the end")
    pieces = _texts(str(tmp_path), piece_chars=1000, end_with_blank_line=True)
    assert len(pieces) > 5 and all(p.endswith("\n") for p in pieces)
    assert "".join(pieces) == "".join(lines) + "\n" + "record one\n\n" + "record two\n\n" + "no newline at the end\n\n"


def test_the_embedded_corpus_name_is_the_five_training_novels():
    assert embedded.expand_corpus_name("austen") == [str(p) for p in embedded.train_paths()]
    assert embedded.expand_corpus_name("corpus.txt") == "corpus.txt"
    first = next(iter(_texts(embedded.expand_corpus_name("austen"), piece_chars=1 << 16)))
    assert embedded.read_novel("emma").startswith(first)


def test_a_field_other_than_text(tmp_path):
    (tmp_path / "c.jsonl").write_text(_jsonl(DOCS, field="body"))
    _parquet(tmp_path / "t.parquet", DOCS, field="body")
    assert _texts(str(tmp_path / "c.jsonl"), field="body") == DOCS
    assert _texts(str(tmp_path / "t.parquet"), field="body") == DOCS


# the fault cases: each is one InputError line naming the file, what is wrong and the fix
FAULTS = {
    "binary file": ("model.txt", lambda p: p.write_bytes(bytes(range(256)) * 4), "model.txt: not UTF-8 text"),
    "NUL bytes": ("weights.txt", lambda p: p.write_bytes(b"abc\0\0\0def"), "weights.txt: holds NUL bytes"),
    "invalid jsonl": (
        "bad.jsonl",
        lambda p: p.write_text(_jsonl(DOCS) + "{not json\n"),
        r"bad.jsonl:3 is not valid JSON",
    ),
    "invalid json array": ("bad.json", lambda p: p.write_text('[{"text": "a"}, '), r"bad.json is not valid JSON"),
    "missing field": (
        "c.jsonl",
        lambda p: p.write_text(_jsonl(DOCS, field="body")),
        r"c.jsonl:1: has no 'text' field \(fields: body, id\)",
    ),
    "not an object": ("c.jsonl", lambda p: p.write_text('["a list"]\n'), r"c.jsonl:1: a list, not a JSON object"),
    "missing column": ("t.parquet", lambda p: _parquet(p, DOCS, field="body"), r"t.parquet: has no 'text' column"),
    "not parquet": ("t.parquet", lambda p: p.write_text("hello"), r"t.parquet: not a parquet file"),
    "not gzip": (
        "fake.txt.gz",
        lambda p: p.write_text("not gzip"),
        r"fake.txt.gz: ends in .gz but is not readable gzip",
    ),
    "truncated xz": (
        "cut.txt.xz",
        lambda p: p.write_bytes(lzma.compress(b"x" * 1000)[:20]),
        r"cut.txt.xz: ends in .xz",
    ),
    "unknown extension": ("data.csv", lambda p: p.write_text("a,b\n"), r"data.csv: unknown suffix \(use .txt/"),
    "empty folder": ("empty", lambda p: p.mkdir(), r"empty: the folder holds no .txt/"),
    "folder of unknowns": (
        "bins",
        lambda p: (p.mkdir(), (p / "x.bin").write_bytes(b"\0")),
        r"bins: the folder holds no",
    ),
}


@pytest.mark.parametrize("case", sorted(FAULTS))
def test_a_bad_file_is_one_line_naming_it(tmp_path, case):
    name, make, message = FAULTS[case]
    make(tmp_path / name)
    with pytest.raises(InputError, match=message) as err:
        _texts(str(tmp_path / name))
    assert "\n" not in str(err.value) and str(err.value).startswith(f"--data {tmp_path / name}")


@pytest.mark.parametrize("case", ["binary file", "invalid jsonl", "missing field", "not parquet", "not gzip"])
def test_uptrain_reader_refuses_the_same_files_with_the_same_line(tmp_path, case):
    name, make, message = FAULTS[case]
    make(tmp_path / name)
    with pytest.raises(InputError, match=message):
        textdata.load_documents(textdata.resolve("data.train", str(tmp_path / name)))


def test_missing_paths_hub_names_and_mixed_formats(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(InputError, match=r"--data ./nope.txt: no such file or folder"):
        textdata.resolve("--data", "./nope.txt")
    with pytest.raises(InputError, match=r"--data wikitext: not a local file or folder, and the hub is offline"):
        textdata.resolve("--data", "wikitext")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.jsonl").write_text(_jsonl(["b"]))
    problems: list[str] = []
    assert textdata.resolve("data.train", [str(tmp_path)], problems, one_format=True) is None
    assert problems == ["data.train mixes formats (json, text): use files of one format"]
    assert _texts(str(tmp_path)) == ["a", "b"]  # plain reading takes a mix
    problems = []
    textdata.resolve("data.train", ["./gone.jsonl", "org/name"], problems)
    assert problems == [
        "data.train ./gone.jsonl: no such file or folder",
        "data.train org/name: not a local path, and a hub dataset must be the only entry",
    ]
    # validating a recipe for another machine accepts missing local paths and hub names
    assert textdata.resolve("data.train", ["./gone.jsonl"], validate_files=False).files[0].name == "gone.jsonl"
    assert textdata.resolve("data.train", "org/name", validate_files=False).hub == "org/name"


def test_zst_without_zstandard_says_what_to_install(tmp_path):
    # zstandard is not a dependency: either it reads, or the line says how to get it
    (tmp_path / "c.txt.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    try:
        import zstandard  # noqa: F401
    except ImportError:
        with pytest.raises(InputError, match=r"c.txt.zst: reading .zst needs the zstandard package"):
            _texts(str(tmp_path / "c.txt.zst"))
    else:
        with pytest.raises(InputError, match=r"c.txt.zst: ends in .zst"):
            _texts(str(tmp_path / "c.txt.zst"))


def test_cli_eval_and_convert_print_one_line_and_write_nothing(tmp_path):
    (tmp_path / "bad.jsonl").write_text("{oops\n")
    runner = CliRunner()
    result = runner.invoke(
        main,
        [
            "eval",
            str(embedded.model_dir()),
            "--data",
            str(tmp_path / "bad.jsonl"),
            "--out",
            str(tmp_path / "r.json"),
            "--speed",
            "off",
        ],
    )
    assert result.exit_code == 2, result.output
    assert f"Error: --data {tmp_path / 'bad.jsonl'}:1 is not valid JSON" in result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "r.json").exists()
    (tmp_path / "blob.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(128, 256)))
    result = runner.invoke(
        main,
        [
            "convert",
            str(embedded.model_dir()),
            str(tmp_path / "out"),
            "--groups",
            "2",
            "--method",
            "calibrated",
            "--calibration",
            str(tmp_path / "blob.txt"),
            "--quiet",
        ],
    )
    assert result.exit_code == 2, result.output
    assert f"Error: --calibration {tmp_path / 'blob.txt'}: not UTF-8 text" in result.output
    assert not (tmp_path / "out").exists()


def test_persuasion_reads_to_the_same_text_and_ids_as_before_the_merge():
    """Pinned from the reader this module replaced (eval/data.py at 1b20d04): results stay comparable."""
    from transformers import AutoTokenizer

    from mha2gqa.eval.data import load_eval_text

    tok = AutoTokenizer.from_pretrained(embedded.model_dir())
    identity = load_eval_text(str(embedded.heldout_path()), tok, max_tokens=16384).identity
    assert identity["text_sha256"] == "8061549557aebd2fd6e353d18d9197cb707029112bd52d4d8b174583a925848a"
    assert identity["ids_sha256"] == "f369479732f1197f7077be733cc42b5f99bb8c734abf9b5b56319d194d95dda7"


def test_cli_calibration_austen_reads_the_five_training_novels(tmp_path):
    result = CliRunner().invoke(
        main,
        [
            "convert",
            str(embedded.model_dir()),
            str(tmp_path / "out"),
            "--groups",
            "4",
            "--calibration",
            "austen",
            "--calibration-tokens",
            "256",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "out" / "mha2gqa.json").read_text())
    calibration = json.dumps(record)  # wherever the provenance layout keeps it
    assert all(str(p) in calibration for p in embedded.train_paths()) and '"tokens": 256' in calibration


def test_a_fault_past_the_checked_head_is_still_one_line(tmp_path):
    """The head check reads 64 Ki characters; a bad line after them surfaces from `datasets` (loading) or
    from the stream (streaming), and both become one InputError naming the key."""
    good = _jsonl([f"document {i} " + "word " * 40 for i in range(400)])
    assert len(good) > 70_000
    (tmp_path / "late.jsonl").write_text(good + "{broken\n")
    source = textdata.resolve("data.train", str(tmp_path / "late.jsonl"))
    with pytest.raises(InputError, match=r"^data.train: `datasets` could not read the files \(.*\): check that each"):
        textdata.load_documents(source)
    stream = textdata.load_documents(source, streaming=True)
    with pytest.raises(InputError, match=r"^data.train: a file could not be read while streaming"):
        list(textdata.dataset_texts(stream, "text", "data.train"))
    with pytest.raises(InputError, match=r"late.jsonl:401 is not valid JSON"):
        _texts(str(tmp_path / "late.jsonl"))


def test_eval_reads_jsonl_now(tmp_path):
    from tiny_models import make_tiny_tokenizer

    from mha2gqa.eval.data import SEPARATOR, load_eval_text

    tok = make_tiny_tokenizer()
    (tmp_path / "held.jsonl").write_text(_jsonl(DOCS))
    text = load_eval_text(str(tmp_path / "held.jsonl"), tok)
    assert text.ids.tolist() == tok(SEPARATOR.join(DOCS))["input_ids"]
    assert text.identity["documents"] == 2 and text.identity["source"] == "file"


def test_python_api_takes_paths_and_lists_for_calibration(tmp_path):
    from pathlib import Path

    from mha2gqa.convert.run import convert

    novels = [Path(p) for p in embedded.expand_corpus_name("austen")][:2]
    result = convert(
        embedded.model_dir(),
        tmp_path / "out",
        groups=4,
        method="calibrated",  # a plain merge's command leaves out the calibration it does not use
        calibration=novels,
        calibration_tokens=128,
        progress=False,
    )
    assert result.dst == tmp_path / "out"
    conversion = json.loads((tmp_path / "out" / "mha2gqa.json").read_text())["lineage"][-1]
    assert conversion["calibration"]["data"] == [str(p) for p in novels]  # Paths recorded as text
    assert f"--calibration {novels[0]} --calibration {novels[1]} " in conversion["command"]
