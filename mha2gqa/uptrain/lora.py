"""`trainable: lora`: low-rank adapters (peft) on the attention projections, merged back into plain
weights at the end, so the result is a stock transformers checkpoint like any other run's.

QLoRA (`lora.load_in_4bit: true`) holds the frozen base in 4-bit NF4 through bitsandbytes, which
needs a CUDA GPU. A 4-bit base cannot take the merge, so the adapters are then merged into a fresh
load of the source checkpoint in its own dtype.
"""

from __future__ import annotations

from pathlib import Path

from mha2gqa.architecture.layouts import layout_for
from mha2gqa.runtime.errors import InputError, first_line
from mha2gqa.runtime.quiet import without_peft_deprecation
from mha2gqa.runtime.units import counted


def target_modules(model, lora) -> list[str]:
    """The modules to adapt: the recipe's, or the attention projections of the model's layout
    (layer-relative names such as self_attn.q_proj, so that no MLP module of the same name matches)."""
    if lora.target_modules:
        return list(lora.target_modules)
    return default_targets(model.config.to_dict())


def default_targets(config: dict) -> list[str]:
    """The attention projections of the config's layout, layer-relative (self_attn.q_proj, ...)."""
    layout = layout_for(config)
    return [
        name
        for name in (
            layout.qkv or layout.q,
            None if layout.qkv else layout.k,
            None if layout.qkv else layout.v,
            layout.o,
            layout.qkv_columns,
        )
        if name
    ]


def load_kwargs(recipe) -> dict:
    """from_pretrained arguments of a QLoRA student (a 4-bit base on this process's GPU); {} otherwise."""
    if recipe.trainable != "lora" or not recipe.lora.load_in_4bit:
        return {}
    import torch
    from accelerate import PartialState
    from transformers import BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return {"quantization_config": quant, "device_map": {"": PartialState().local_process_index}}


def peft_config(model, lora):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=target_modules(model, lora),
        bias="none",
        task_type="CAUSAL_LM",
    )


def add_adapters(model, lora):
    """Wrap `model` with fresh adapters (the base is frozen by peft); raises InputError when a target
    module does not exist."""
    from peft import get_peft_model, prepare_model_for_kbit_training

    config = peft_config(model, lora)
    if lora.load_in_4bit:
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    _validate_targets(model, sorted(config.target_modules))
    try:
        with without_peft_deprecation():
            return get_peft_model(model, config)
    except ValueError as err:  # peft: "Target modules {...} not found in the base model"
        raise InputError(
            f"lora.target_modules={sorted(config.target_modules)} do not name modules of this "
            f"{model.config.model_type} model ({first_line(err, 160)})"
        ) from err


def _validate_targets(model, targets: list[str]) -> None:
    """A target that names only modules LoRA cannot wrap (a whole MLP block, a norm) is said to be
    one, with the Linear layers inside it to name instead: peft would say it matches nothing."""
    import torch

    modules = dict(model.named_modules())
    for target in targets:
        found = [(name, m) for name, m in modules.items() if name == target or name.endswith("." + target)]
        if found and not any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for _, m in found):
            name, module = found[0]
            inner = sorted(
                {child.rsplit(".", 1)[-1] for child, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
            )
            hint = (
                f"name its Linear layers instead ({', '.join(inner)})"
                if inner
                else "name Linear layers (e.g. q_proj, v_proj)"
            )
            raise InputError(
                f"lora.target_modules entry {target!r} matches {counted(len(found), type(module).__name__ + ' module')} "
                f"(e.g. {name}), which are not Linear layers LoRA can adapt: {hint}"
            )


def merged_model(peft_model, lora, source_dir: Path | None, saved_dtype):
    """A plain transformers model with the adapters folded into the weights. A base held as stored
    merges in place (the fp32 update rounded once into the stored dtype); a 4-bit base merges into a
    fresh load of the source in `saved_dtype`."""
    if not lora.load_in_4bit:
        return peft_model.merge_and_unload()
    return merge_into_source(peft_model, source_dir, saved_dtype)


def merge_into_source(peft_model, source_dir: Path, dtype):
    """Copy the trained adapters onto the source checkpoint loaded afresh (CPU, `dtype`), then merge."""
    import torch
    from peft import get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict

    from mha2gqa.files.loading import load_causal_lm

    adapters = {k: v.detach().to("cpu", torch.float32) for k, v in get_peft_model_state_dict(peft_model).items()}
    base = load_causal_lm(source_dir, "the QLoRA run's source", dtype=dtype)
    with without_peft_deprecation():
        fresh = get_peft_model(base, peft_model.peft_config["default"])
    set_peft_model_state_dict(fresh, adapters)
    return fresh.merge_and_unload()


def adapter_record(peft_model, lora) -> dict:
    """What mha2gqa.json records about the adapters that were merged."""
    import peft

    config = peft_model.peft_config["default"]
    return {
        "method": "qlora" if lora.load_in_4bit else "lora",
        "rank": config.r,
        "alpha": config.lora_alpha,
        "dropout": config.lora_dropout,
        "target_modules": sorted(config.target_modules),
        "adapter_params": sum(p.numel() for p in peft_model.parameters() if p.requires_grad),
        "merged": True,
        "peft_version": peft.__version__,
    }
