"""Part 5 of bench/gpu_check.py: trainable: lora with lora.load_in_4bit on the embedded model, 5 steps, merged:
the result loads with plain from_pretrained, holds no quantization config, changed only the adapted projections."""

import json

import torch
from gpu_common import MARKS, embedded, load_final, load_tensors, needs, small_recipe, write_recipe

pytestmark = MARKS


def test_qlora(part):
    needs("datasets", "peft", *(() if part.smoke else ("bitsandbytes",)))
    from mha2gqa.records.provenance import latest
    from mha2gqa.uptrain import load_recipe, train

    out = part.work / "run"
    recipe = small_recipe(None, out, part.smoke, model=str(embedded.MODEL_DIR), trainable="lora", save_every=0)
    recipe["lora"] = {"load_in_4bit": not part.smoke}
    if part.smoke:
        part.skip("load_in_4bit (QLoRA)", "needs CUDA and bitsandbytes: plain LoRA through the same code")
    train(load_recipe(write_recipe(part.work / "recipe.yaml", recipe), []))
    merged, loading = load_final(out)
    source = load_tensors(embedded.MODEL_DIR)
    changed = sorted(k for k in merged if k in source and not torch.equal(merged[k], source[k]))
    stage = latest(out, "uptrain")
    config = json.loads((out / "config.json").read_text())
    part.result = result = {
        "loading_problems": loading,
        "quantization_config_left": "quantization_config" in config,
        "saved_dtype": config.get("dtype"),
        "changed_tensors": len(changed),
        "changed_outside_attention": [k for k in changed if ".self_attn." not in k],
        "adapter": stage.get("adapter"),
        "final_eval_loss": stage.get("final_eval_loss"),
        "all_finite": all(bool(torch.isfinite(t).all()) for t in merged.values()),
    }
    assert not any(loading.values()), f"from_pretrained reported {loading}"
    assert not result["quantization_config_left"] and result["all_finite"] and changed, result
    assert not result["changed_outside_attention"], "tensors outside the adapted projections changed"
