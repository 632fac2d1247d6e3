"""The model code a per-layer child carries, so that stock transformers loads it with one line and no mha2gqa:
`AutoModelForCausalLM.from_pretrained(DST, trust_remote_code=True)`, as NVIDIA's Nemotron-NAS checkpoints load.
The files are mha2gqa's own classes (configuration_decilm.py, modeling_decilm.py and the block_format.py they read),
copied unchanged: they import only torch, transformers and each other. Torch-free.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from mha2gqa.nemotron_nas.block_format import ARCHITECTURE, MODEL_TYPE

HERE = Path(__file__).parent
CODE_FILES = ("block_format.py", "configuration_decilm.py", "modeling_decilm.py")
AUTO_MAP = {
    "AutoConfig": "configuration_decilm.NemotronNasConfig",
    "AutoModelForCausalLM": f"modeling_decilm.{ARCHITECTURE}",
}


def write_remote_code(dst_dir: str | Path, config_dict: dict) -> dict:
    """Copy the model code into `dst_dir` and return what config.json must add for transformers to find it
    ({"auto_map": ...}); the caller writes config.json (config_dict is read, not changed). Refuses a config that is
    not a Nemotron-NAS one: a uniform child loads with transformers' own classes and needs no code."""
    if config_dict.get("model_type") != MODEL_TYPE:
        raise ValueError(f"write_remote_code is for model_type {MODEL_TYPE!r}, not {config_dict.get('model_type')!r}")
    for name in CODE_FILES:
        shutil.copyfile(HERE / name, Path(dst_dir) / name)
    return {"auto_map": dict(AUTO_MAP)}


def load_line(name: str) -> str:
    """The one line that loads a child carrying this code, as its card shows it."""
    return f'AutoModelForCausalLM.from_pretrained("{name}", trust_remote_code=True)'
