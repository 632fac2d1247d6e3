"""A per-layer child (Nemotron-NAS, kv heads 8,1,4,1,2,8) served by the real vLLM through mha2gqa's plugin (marker
`vllm`): serve-bench starts vLLM's server, a process of its own that gets our config class only from the
`vllm.general_plugins` entry point, with no --trust-remote-code; the engine's greedy text equals transformers' (our
class) on every probe prompt, and the KV tokens it reports equal the formula's, which sums each layer's kv heads.
Run it in a venv with vLLM and mha2gqa installed (the entry point exists only once installed), as .ci/vllm does:
`python -m pytest -m vllm tests/vllm` (docs/serving.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fault_helpers import cli
from serving_helpers import EMBEDDED

pytestmark = pytest.mark.vllm

KV_HEADS = [8, 1, 4, 1, 2, 8]  # 24 kv heads over 6 layers: half of the parent's 48
HEAD_DIM, FLOAT32 = 32, 4


def test_a_per_layer_child_serves_in_vllm_as_transformers_decodes_it_with_the_summed_kv_formula(tmp_path):
    child = tmp_path / "per-layer"
    counts = ",".join(map(str, KV_HEADS))
    convert = [sys.executable, "-m", "mha2gqa", "convert", str(EMBEDDED), str(child), "--kv-heads-per-layer", counts]
    subprocess.run([*convert, "-q"], check=True, capture_output=True)
    config = json.loads((child / "config.json").read_text())
    # The child ships its model code for stock transformers (auto_map, issue 69); vLLM must not need it: the
    # server runs without --trust-remote-code and gets the config class from our plugin (checked in its log below).
    assert config["model_type"] == "nemotron-nas" and set(config["auto_map"]) == {"AutoConfig", "AutoModelForCausalLM"}
    out = tmp_path / "serve.json"
    args = ["serve-bench", EMBEDDED, child, "--vllm-python", sys.executable, "--eager", "--context", "512"]
    args += ["--concurrency", "1", "--repeats", "1", "--prompt-tokens", "32", "--output-tokens", "16"]
    found = cli(*args, "--startup-timeout", "600", "--out", out)
    assert found.exit_code == 0, found.output
    data = json.loads(out.read_text())
    parent, per_layer = data["models"]
    assert per_layer["greedy"]["equal"] == len(per_layer["greedy"]["prompts"]) == 8, per_layer["greedy"]["prompts"]
    assert parent["greedy"]["equal"] == 8
    summed = 2 * sum(KV_HEADS) * HEAD_DIM * FLOAT32  # 6,144 bytes a token; a uniform 8 kv heads: 12,288
    assert per_layer["kv"]["formula"]["bytes_per_token"] == summed
    assert per_layer["kv"]["engine"]["tokens"] == per_layer["kv"]["formula"]["tokens"], per_layer["kv"]
    assert parent["kv"]["engine"]["tokens"] == parent["kv"]["formula"]["tokens"], parent["kv"]
    block = parent["kv"]["engine"]["block_size"]
    ratio = data["comparison"][0]
    assert ratio["formula_ratio"] == 2.0
    assert abs(ratio["kv_tokens_ratio"] - 2.0) <= 2 * block / parent["kv"]["engine"]["tokens"], ratio
    assert data["warnings"] == []
    log = open(per_layer["log"]).read()  # the engine logs its config once: our class came from the plugin
    assert "trust_remote_code=False" in log and "trust_remote_code=True" not in log
