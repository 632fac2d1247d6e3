"""The eval options lm-eval users reach for: --batch-size auto, a chat template for instruct models, and
per-example logs (--log-samples)."""

import json

import pytest
from click.testing import CliRunner
from tiny_models import SAMPLE_TEXT
from uptrain_helpers import tiny_model_dir

from mha2gqa.cli import main
from mha2gqa.eval import batching, evaluate
from mha2gqa.runtime.errors import InputError

QUICK = dict(context=32, stride=16, speed_preset="off", progress=False)
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lmeval-users")
    tiny_model_dir(root / "model")
    (root / "text.txt").write_text(SAMPLE_TEXT * 2)
    chat = tiny_model_dir(root / "chat")
    config = json.loads((chat / "tokenizer_config.json").read_text())
    (chat / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return root


def test_batch_size_auto_picks_a_batch_and_leaves_the_numbers_alone(tiny, monkeypatch):
    one = evaluate(tiny / "model", str(tiny / "text.txt"), batch_size=1, **QUICK)
    auto = evaluate(tiny / "model", str(tiny / "text.txt"), batch_size="auto", **QUICK)
    assert 1 < auto["batch_size"]["windows"] <= batching.MAX_AUTO_BATCH and "batch_size" not in one
    assert auto["perplexity"]["perplexity"] == pytest.approx(one["perplexity"]["perplexity"], rel=1e-5)
    # little free memory: a smaller batch, never below one
    monkeypatch.setattr(batching, "free_bytes", lambda device: 0)
    assert evaluate(tiny / "model", str(tiny / "text.txt"), batch_size="auto", **QUICK)["batch_size"]["windows"] == 1


def test_batch_size_auto_on_the_command_line_and_a_bad_value_refused(tiny, tmp_path):
    out = tmp_path / "r.json"
    common = ["eval", str(tiny / "model"), "--data", str(tiny / "text.txt"), "--context", "32", "--speed", "off", "-q"]
    ran = CliRunner().invoke(main, [*common, "--batch-size", "auto", "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    assert json.loads(out.read_text())["batch_size"]["asked"] == "auto"
    bad = CliRunner().invoke(main, [*common, "--batch-size", "many"])
    assert bad.exit_code == 2 and "'many' is neither a whole number nor auto" in bad.output
    with pytest.raises(InputError, match="--batch-size 0 must be at least 1"):
        evaluate(tiny / "model", str(tiny / "text.txt"), batch_size=0, **QUICK)


def test_chat_template_and_per_example_logs_through_lm_eval(tiny, tmp_path):
    log = tmp_path / "samples.jsonl"
    r = evaluate(
        tiny / "chat", None, lm_eval_tasks=["persuasion_cloze"], lm_eval_limit=2, chat_template=True,
        log_samples=str(log), speed_preset="off", progress=False,
    )  # fmt: skip
    section = r["lm_eval"]
    assert section["chat_template"] is True and section["samples_log"] == str(log)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == 2 and {line["task"] for line in lines} == {"persuasion_cloze"}
    assert [line["doc_id"] for line in lines] == [0, 1] and all("resps" in line for line in lines)
    # the prompt went through the template: its role marker is in the request lm-eval logged
    assert all("user: " in json.dumps(line["arguments"]) for line in lines)


def test_chat_template_and_log_samples_are_refused_where_they_cannot_apply(tiny, tmp_path):
    with pytest.raises(InputError, match="this tokenizer has no chat template"):
        evaluate(tiny / "model", None, lm_eval_tasks=["persuasion_cloze"], chat_template=True, speed_preset="off")
    with pytest.raises(InputError, match="--chat-template applies to lm-eval's examples: add --lm-eval-tasks"):
        evaluate(tiny / "chat", None, chat_template=True, speed_preset="off")
    with pytest.raises(InputError, match="--log-samples applies to lm-eval's examples"):
        evaluate(tiny / "chat", None, log_samples=str(tmp_path / "s.jsonl"), speed_preset="off")
