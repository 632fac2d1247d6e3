"""mha2gqa.json: one schema, one chaining rule (each file holds its source's lineage plus its own
stage), the role read from the lineage, and files of the old schema still read."""

import json

import pytest
from tiny_models import save_tiny_model

from mha2gqa.convert.run import convert
from mha2gqa.files import embedded
from mha2gqa.records import provenance
from mha2gqa.runtime.errors import InputError


def test_parent_converted_uptrained_reads_back_as_a_list(tmp_path):
    save_tiny_model(tmp_path / "parent", "llama")
    assert provenance.lineage(tmp_path / "parent") == [] and provenance.role(tmp_path / "parent") == "parent"

    convert(tmp_path / "parent", tmp_path / "gqa", groups=2, progress=False)
    assert provenance.role(tmp_path / "gqa") == "converted"
    written = provenance.append(tmp_path / "gqa", "uptrain", {"steps": 3}, source=tmp_path / "gqa")
    assert written == json.loads((tmp_path / "gqa" / provenance.FILE_NAME).read_text())
    assert not list(tmp_path.glob("gqa/.*tmp"))  # the atomic write's temporary file is gone

    stages = provenance.lineage(tmp_path / "gqa")
    assert [s["stage"] for s in stages] == ["conversion", "uptrain"]
    assert (stages[0]["source"], stages[0]["groups"], stages[0]["source_kv_heads"]) == (str(tmp_path / "parent"), 2, 8)
    assert stages[1]["steps"] == 3 and all(s["version"] and s["date"] for s in stages)
    assert provenance.role(tmp_path / "gqa") == "uptrained"
    assert provenance.latest(tmp_path / "gqa", "conversion") == stages[0]
    assert written["schema"] == provenance.SCHEMA and written["tool"] == "mha2gqa"


def test_converting_an_uptrained_model_again_makes_it_converted(tmp_path):
    """The role looks at what came after the last conversion, not at which keys exist."""
    save_tiny_model(tmp_path / "a", "llama")
    convert(tmp_path / "a", tmp_path / "b", groups=4, progress=False)
    provenance.append(tmp_path / "b", "uptrain", {"steps": 1}, source=tmp_path / "b")
    convert(tmp_path / "b", tmp_path / "c", groups=2, progress=False)
    assert [s["stage"] for s in provenance.lineage(tmp_path / "c")] == ["conversion", "uptrain", "conversion"]
    assert provenance.role(tmp_path / "c") == "converted"
    assert provenance.latest(tmp_path / "c", "conversion")["groups"] == 2


def test_a_model_trained_from_scratch_is_a_parent(tmp_path):
    provenance.append(tmp_path, "uptrain", {"steps": 5})
    assert [s["stage"] for s in provenance.lineage(tmp_path)] == ["uptrain"]
    assert provenance.role(tmp_path) == "parent"


def test_the_embedded_models_old_file_still_reads():
    """Written by the uptrain loop before schema 2: {"uptrain": {..., "mha2gqa_version"}}."""
    [stage] = provenance.lineage(embedded.model_dir())
    assert stage["stage"] == "uptrain" and stage["tokens_seen"] == 1_228_800 and stage["version"] == "0.1.0"
    assert "mha2gqa_version" not in stage and provenance.role(embedded.model_dir()) == "parent"


def test_old_nested_and_carried_files_give_the_same_list():
    """Old convert nested the source's file under parent_provenance; old uptrain carried the source's
    keys forward and nested an earlier uptrain record under uptrain.previous."""
    pretrain = {"uptrain": {"steps": 1, "mha2gqa_version": "0.0.9"}}
    again = {"uptrain": {"steps": 2, "previous": pretrain["uptrain"]}}
    converted = {"tool": "mha2gqa", "version": "0.1.0", "conversion": {"groups": 2}, "parent_provenance": again}
    uptrained = {**converted, "uptrain": {"steps": 3}}
    uptrained_twice = {**converted, "uptrain": {"steps": 4, "previous": uptrained["uptrain"]}}
    stages = provenance.lineage_of(uptrained_twice)
    assert [(s["stage"], s.get("steps", s.get("groups"))) for s in stages] == [
        ("uptrain", 1),
        ("uptrain", 2),
        ("conversion", 2),
        ("uptrain", 3),
        ("uptrain", 4),
    ]
    assert stages[0]["version"] == "0.0.9" and stages[2]["version"] == "0.1.0"
    assert all("previous" not in s and "parent_provenance" not in s for s in stages)
    roles = [provenance.role_of(r) for r in (pretrain, again, converted, uptrained, uptrained_twice)]
    assert roles == ["parent", "parent", "converted", "uptrained", "uptrained"]


def test_appending_to_a_source_with_an_old_file_writes_the_new_schema(tmp_path):
    source, out = tmp_path / "src", tmp_path / "out"
    source.mkdir(), out.mkdir()
    (source / provenance.FILE_NAME).write_text(json.dumps({"conversion": {"groups": 2}}))
    written = provenance.append(out, "uptrain", {"steps": 1}, source=source)
    assert [s["stage"] for s in written["lineage"]] == ["conversion", "uptrain"]
    assert "conversion" not in written and "parent_provenance" not in written


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "is not valid JSON"),
        ("[1, 2]", "is a JSON list, not an object"),
        ('{"lineage": [{"stage": "pretrain"}]}', "'lineage' must be a list of stages"),
    ],
)
def test_a_broken_file_is_one_clear_error(tmp_path, content, message):
    (tmp_path / provenance.FILE_NAME).write_text(content)
    with pytest.raises(InputError, match=message) as err:
        provenance.role(tmp_path)
    assert "delete it" in str(err.value) and "\n" not in str(err.value)


def test_unknown_stage_is_refused(tmp_path):
    with pytest.raises(ValueError, match="stage 'train'"):
        provenance.append(tmp_path, "train", {})
    assert not (tmp_path / provenance.FILE_NAME).exists()


def test_a_broken_source_file_stops_convert_before_anything_is_written(tmp_path):
    save_tiny_model(tmp_path / "src", "llama")
    (tmp_path / "src" / provenance.FILE_NAME).write_text("{oops")
    with pytest.raises(InputError, match="mha2gqa.json is not valid JSON"):
        convert(tmp_path / "src", tmp_path / "dst", groups=2, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_broken_source_file_stops_uptrain_before_training(tmp_path):
    from uptrain_helpers import corpus, recipe_file, tiny_model_dir

    from mha2gqa.uptrain import load_recipe, train

    model = tiny_model_dir(tmp_path / "model")
    (model / provenance.FILE_NAME).write_text('{"lineage": "none"}')
    recipe = load_recipe(
        recipe_file(
            tmp_path / "r.yaml",
            model=str(model),
            output_dir=str(tmp_path / "out"),
            data={"train": str(corpus(tmp_path / "train.jsonl", docs=40))},
            budget={"max_steps": 2},
        )
    )
    with pytest.raises(InputError, match="'lineage' must be a list of stages"):
        train(recipe)
    assert not (tmp_path / "out").exists()  # nothing written
