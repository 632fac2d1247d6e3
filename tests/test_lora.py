"""trainable: lora: adapters on the attention projections, merged into a stock checkpoint in the source
dtype; resume, distillation and two DDP ranks as with full training; QLoRA refused without a GPU."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from test_uptrain_two_ranks import _launch
from transformers import AutoModelForCausalLM, AutoTokenizer
from uptrain_helpers import corpus, metrics, recipe_file, tiny_model_dir

from mha2gqa.records.provenance import latest
from mha2gqa.runtime.errors import InputError
from mha2gqa.uptrain import load_recipe, train
from mha2gqa.uptrain import lora as L
from mha2gqa.uptrain.data import build_data
from mha2gqa.uptrain.distill import kl_teacher_student
from mha2gqa.uptrain.models import load_student

pytest.importorskip("peft")  # in [test]; .ci/run installs it

RANK = 4
ATTENTION = (".q_proj.weight", ".k_proj.weight", ".v_proj.weight", ".o_proj.weight")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    model = tiny_model_dir(root / "model", dtype=torch.bfloat16)  # a bf16 source: the result must stay bf16
    teacher = tiny_model_dir(root / "teacher", seed=1)  # another model: a teacher that is the model is refused
    return {
        "model": model,
        "model32": tiny_model_dir(root / "model32"),
        "teacher": teacher,
        "train": corpus(root / "train.jsonl"),
    }


def _recipe(tmp_path, tiny, overrides=(), **keys):
    keys.setdefault("model", str(tiny["model"]))
    keys.setdefault("output_dir", str(tmp_path / "out"))
    keys.setdefault("trainable", "lora")
    keys.setdefault("lora", {"rank": RANK, "alpha": 8})
    keys.setdefault("optim", {"lr": 2e-2})  # adapters start at zero and want a larger step than full training
    return load_recipe(recipe_file(tmp_path / "r.yaml", data={"train": str(tiny["train"])}, **keys), list(overrides))


def test_lora_run_is_a_merged_stock_checkpoint_in_the_source_dtype(tmp_path, tiny):
    recipe = _recipe(tmp_path, tiny, budget={"max_steps": 10})
    out = train(recipe)
    before, after = load_file(str(tiny["model"] / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert after.keys() == before.keys()  # no adapter tensors left: plain weights
    assert {t.dtype for t in after.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    # the frozen base was held in bf16 as stored (half of fp32), the adapters in fp32
    student = load_student(recipe)
    wrapped = L.add_adapters(student.model, recipe.lora)
    dtypes = {n.split(".")[-3] if "lora_" in n else "base": p.dtype for n, p in wrapped.named_parameters()}
    assert dtypes == {"base": torch.bfloat16, "lora_A": torch.float32, "lora_B": torch.float32}
    changed = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert changed == sorted(k for k in before if k.endswith(ATTENTION)) and len(changed) == 8  # 2 layers x q/k/v/o

    record = latest(out, "uptrain")
    adapter = record["adapter"]
    assert adapter["method"] == "lora" and adapter["rank"] == RANK and adapter["alpha"] == 8 and adapter["merged"]
    assert adapter["target_modules"] == ["self_attn.k_proj", "self_attn.o_proj", "self_attn.q_proj", "self_attn.v_proj"]
    # r x (in + out) per adapted matrix
    expected = sum(RANK * sum(before[k].shape) for k in changed)
    assert adapter["adapter_params"] == record["trainable_params"] == expected

    lines = metrics(out)
    assert lines[-1]["eval_loss"] < lines[0]["eval_loss"] - 0.1  # the adapters learn
    # plain transformers loads it, and its held-out loss is the one the run reported (bf16 rounding aside)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    blocks = build_data(recipe, AutoTokenizer.from_pretrained(out), 0, 1, show_progress=False).eval.long()
    with torch.no_grad():
        loss = sum(model(input_ids=b, labels=b).loss.item() * len(b) for b in blocks.split(4)) / len(blocks)
    assert loss == pytest.approx(record["final_eval_loss"], abs=0.02)


def test_interrupted_and_resumed_lora_run_equals_the_uninterrupted_one(tmp_path, tiny):
    keys = dict(budget={"max_steps": 6}, eval_every=0, save_every=2)
    straight = train(_recipe(tmp_path / "a", tiny, **keys))
    first = train(_recipe(tmp_path / "b", tiny, exit_after_steps=3, **keys))
    assert not (first / "model.safetensors").exists()
    resumed = train(_recipe(tmp_path / "b", tiny, **keys), resume=True)
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    assert latest(resumed, "uptrain")["resumed_from_step"] == 3
    with pytest.raises(InputError, match=r"lora.rank: 4 -> 8"):  # the adapters' shape fixes the run
        train(_recipe(tmp_path / "b", tiny, lora={"rank": 8, "alpha": 8}, **keys), resume=True)


def test_lora_distillation_starts_from_the_teacher(tmp_path, tiny):
    # fp32 student: fresh adapters add zero (B = 0), so the first step's loss is the model's own against the teacher
    recipe = _recipe(
        tmp_path,
        tiny,
        model=str(tiny["model32"]),
        log_every=1,
        eval_every=0,
        budget={"max_steps": 3},
        distill={"teacher": str(tiny["teacher"]), "kl_weight": 0.25, "temperature": 2.0},
    )
    out = train(recipe)
    losses = [ln["loss"] for ln in metrics(out)[1:]]
    first = build_data(recipe, AutoTokenizer.from_pretrained(tiny["model32"]), 0, 1, False).train.batch(0)
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(tiny["model32"], dtype=torch.float32)
        teacher = AutoModelForCausalLM.from_pretrained(tiny["teacher"], dtype=torch.float32)
        lm = model(input_ids=first, labels=first).loss.item()
        kl = kl_teacher_student(model(input_ids=first).logits, teacher(input_ids=first).logits, 2.0).item()
    assert kl > 1e-3 and losses[0] == pytest.approx(0.75 * lm + 0.25 * kl, rel=1e-4)
    assert all(math.isfinite(x) for x in losses) and latest(out, "uptrain")["source"]["teacher"] == str(tiny["teacher"])


def test_qlora_merge_path_equals_the_in_place_merge(tiny):
    """QLoRA merges into a fresh load of the source (a 4-bit base cannot take the merge); on CPU the
    same path runs on a full-precision base and must give the in-place merge's weights."""
    recipe = load_recipe(
        recipe_file(
            tiny["model"].parent / "q.yaml",
            model=str(tiny["model"]),
            output_dir="unused",
            trainable="lora",
            lora={"rank": RANK},
            data={"train": str(tiny["train"])},
        )
    )
    base = AutoModelForCausalLM.from_pretrained(tiny["model"], dtype=torch.float32)
    wrapped = L.add_adapters(base, recipe.lora)
    torch.manual_seed(0)
    for name, p in wrapped.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.05)  # trained adapters are not zero
    fresh = L.merge_into_source(wrapped, tiny["model"], torch.float32).state_dict()
    in_place = wrapped.merge_and_unload().state_dict()
    assert fresh.keys() == in_place.keys()
    for name in fresh:
        torch.testing.assert_close(fresh[name], in_place[name], msg=name)
    assert any(
        not torch.equal(in_place[k], base_w)
        for k, base_w in load_file(str(tiny["model"] / "model.safetensors")).items()
        if k.endswith(ATTENTION)
    )


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"lora": {"load_in_4bit": True}}, "lora.load_in_4bit=true (QLoRA) needs "),
        ({"trainable": "all", "lora": {"rank": 8}}, "lora.* keys are set but trainable=all"),
        ({"lora": {"rank": 0, "dropout": 1.0}}, "lora.rank=0 must be at least 1"),
        ({"lora": {"alpha": -1}}, "lora.alpha=-1.0 must be positive"),
    ],
)
def test_lora_recipe_rules(tmp_path, tiny, keys, message):
    if "load_in_4bit" in keys.get("lora", {}) and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the refusal is for machines without one")
    with pytest.raises(InputError, match=message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")) as err:
        _recipe(tmp_path, tiny, **keys)
    assert "\n" not in str(err.value)


def test_unknown_target_module_is_refused_before_anything_is_written(tmp_path, tiny):
    with pytest.raises(InputError, match=r"lora.target_modules=\['nope'\] do not name modules"):
        train(_recipe(tmp_path, tiny, lora={"target_modules": ["nope"]}))
    assert not (tmp_path / "out").exists()


def test_two_cpu_ranks_train_one_lora_model(tmp_path, tiny):
    recipe = recipe_file(
        tmp_path / "r.yaml",
        model=str(tiny["model"]),
        output_dir=str(tmp_path / "out"),
        data={"train": str(tiny["train"])},
        trainable="lora",
        lora={"rank": RANK},
        save_every=2,
        eval_every=2,
    )
    result = _launch(["--recipe", str(recipe), "trace_samples=true", "budget.max_steps=4"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    record = latest(out, "uptrain")
    assert record["world_size"] == 2 and record["adapter"]["rank"] == RANK
    sums = [
        json.loads((out / "trace" / f"rank{r}.jsonl").read_text().splitlines()[-1])["final_param_sums"] for r in (0, 1)
    ]
    lora_sums = [name for name in sums[0] if "lora_" in name]
    assert lora_sums  # the replicas held adapters ...
    for name in sums[0]:  # ... and DDP kept them identical
        assert sums[0][name] == pytest.approx(sums[1][name], rel=1e-6, abs=1e-6), name
    weights = load_file(str(out / "model.safetensors"))
    assert not any("lora" in k for k in weights) and {t.dtype for t in weights.values()} == {torch.bfloat16}


@pytest.mark.slow  # four child processes, each loading torch: about 1.5 minutes on 2 busy cores
def test_memory_benchmark_runs_at_its_smoke_size(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench" / "train_memory.py"
    done = subprocess.run(
        [sys.executable, str(bench), "--smoke", "--json", str(tmp_path / "m.json")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads((tmp_path / "m.json").read_text())
    measured = {r["mode"]: r for r in found["measured"]}
    assert measured["all"]["grad_bytes"] == measured["all"]["weights_bytes"]  # every weight has a gradient
    assert (
        measured["lora"]["trainable_params"] < measured["kv"]["trainable_params"] < measured["all"]["trainable_params"]
    )
    assert measured["lora"]["adam_bytes"] == 2 * measured["lora"]["grad_bytes"]  # exp_avg + exp_avg_sq
    computed = {r["mode"]: r for r in found["computed_7b"]}
    assert computed["lora"]["fits_24GB"] and not computed["all"]["fits_80GB"]
