"""The names people type for a floating dtype, and the one name mha2gqa uses for each.

`--dtype bf16` was refused although torch, the Hub's config.json and safetensors each spell the same
dtype their own way; every command's --dtype reads through `dtype_name`, so one table says them all.
"""

from __future__ import annotations

from mha2gqa.runtime.errors import InputError

# canonical name (config.json's torch_dtype, torch's attribute) -> what else people type for it
ALIASES = {
    "float32": ("fp32", "f32", "float", "single", "torch.float32", "torch.float", "F32"),
    "bfloat16": ("bf16", "torch.bfloat16", "BF16"),
    "float16": ("fp16", "f16", "half", "torch.float16", "torch.half", "F16"),
}
_LOOKUP = {name.lower(): canonical for canonical, names in ALIASES.items() for name in (canonical, *names)}


def dtype_name(value: str | None, flag: str = "--dtype", keep: tuple[str, ...] = ()) -> str | None:
    """`value` as its canonical name (bf16 -> bfloat16); None stays None and the words in `keep` (eval's
    `auto`) stay themselves. Anything else is an InputError naming the value and the names accepted."""
    if value is None:
        return None
    text = str(value).strip()
    if text.lower() in keep:
        return text.lower()
    if text.lower() in _LOOKUP:
        return _LOOKUP[text.lower()]
    known = ", ".join([*keep, *ALIASES])
    raise InputError(f"{flag} {value!r} is unknown: use {known} (or fp32, bf16, fp16, half, torch.bfloat16, ...)")
