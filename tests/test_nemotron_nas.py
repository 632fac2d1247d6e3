"""Per-layer kv heads written as Nemotron-NAS (DeciLM) checkpoints: the format (what vLLM's nemotron_nas.py reads),
our model class (registered with the Auto classes, no remote code), and `convert --kv-heads-per-layer`."""

from __future__ import annotations

import copy as copy_module
import json
import pickle
import re
import shlex
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from tiny_models import make_tiny_tokenizer, save_tiny_model

from mha2gqa import convert
from mha2gqa.cli import main
from mha2gqa.files.loading import load_causal_lm
from mha2gqa.nemotron_nas.blocks import ffn_mult_for, ffn_mult_to_intermediate_size, nemotron_nas_config
from mha2gqa.runtime.errors import InputError

# hidden 64, MLP 256 (a width the format can state: ffn_mult 6.0), 8 query heads, 4 kv heads, 3 layers
TINY = dict(intermediate_size=256, num_key_value_heads=4, num_hidden_layers=3, max_position_embeddings=64)


@pytest.fixture(scope="module")
def parent(tmp_path_factory):
    src = tmp_path_factory.mktemp("nas") / "llama"
    save_tiny_model(src, "llama", **TINY)
    make_tiny_tokenizer(src)
    return src


def per_layer(src, dst, counts: str, *extra: str):
    return CliRunner().invoke(main, ["convert", str(src), str(dst), "--kv-heads-per-layer", counts, "-q", *extra])


def ids(seed: int = 0, length: int = 24) -> torch.Tensor:
    return torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(seed))


def test_written_config_is_nvidias_format(parent, tmp_path):
    """model_type, architectures, one block per layer with n_heads_in_group = heads / kv heads and an ffn_mult the
    readers' formula turns back into the parent's MLP width; no uniform num_key_value_heads; Llama weight names."""
    result = per_layer(parent, tmp_path / "dst", "4,2,1")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert config["model_type"] == "nemotron-nas" and config["architectures"] == ["DeciLMForCausalLM"]
    assert "num_key_value_heads" not in config and "intermediate_size" not in config
    assert [b["attention"]["n_heads_in_group"] for b in config["block_configs"]] == [2, 4, 8]
    for block in config["block_configs"]:
        assert block["attention"]["no_op"] is False and block["attention"]["replace_with_linear"] is False
        assert block["ffn"]["no_op"] is False and block["ffn"]["replace_with_linear"] is False
        assert ffn_mult_to_intermediate_size(block["ffn"]["ffn_mult"], config["hidden_size"]) == 256
    with safe_open(tmp_path / "dst" / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    with safe_open(parent / "model.safetensors", "pt") as f:
        assert set(shapes) == set(f.keys())  # the names vLLM's loader maps: model.layers.N.self_attn.k_proj.weight
    for layer, count in enumerate((4, 2, 1)):
        assert shapes[f"model.layers.{layer}.self_attn.k_proj.weight"] == (count * 8, 64)
        assert shapes[f"model.layers.{layer}.self_attn.v_proj.bias"] == (count * 8,)
        assert shapes[f"model.layers.{layer}.self_attn.q_proj.weight"] == (64, 64)
    record = json.loads((tmp_path / "dst" / "mha2gqa.json").read_text())["lineage"][-1]
    assert record["kv_heads_per_layer"] == [4, 2, 1] and record["format"] == "nemotron-nas"
    assert record["kv_bytes_per_token"] == 2 * (4 + 2 + 1) * 8 * 4
    assert (tmp_path / "dst" / "tokenizer.json").is_file()
    card = (tmp_path / "dst" / "README.md").read_text()
    assert "OUT --kv-heads-per-layer 4,2,1" in card and "4 → 4,2,1 (per layer)" in card


def test_uniform_counts_write_what_groups_writes(parent, tmp_path):
    """One plan for any counts: --kv-heads-per-layer 2,2,2 is --groups 2, config and tensors byte for byte (a stock
    Llama, no Nemotron-NAS format for counts that do not differ)."""
    assert per_layer(parent, tmp_path / "list", "2,2,2", "--no-check").exit_code == 0
    assert (
        CliRunner().invoke(main, ["convert", str(parent), str(tmp_path / "g"), "-g", "2", "-q", "--no-check"]).exit_code
        == 0
    )
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "list" / name).read_bytes() == (tmp_path / "g" / name).read_bytes(), name


def test_uniform_counts_equal_transformers_llama(parent, tmp_path):
    """All layers at 2 kv heads: our class on a Nemotron-NAS checkpoint (--groups 2's tensors, its config.json
    stated per block) gives the logits and the greedy text of transformers' Llama on convert --groups 2."""
    convert(parent, tmp_path / "gqa", 2, progress=False, check=False)
    shutil.copytree(tmp_path / "gqa", tmp_path / "nas")
    config = json.loads((tmp_path / "gqa" / "config.json").read_text())
    stated = nemotron_nas_config(dict(config, num_key_value_heads=4), [2, 2, 2])
    (tmp_path / "nas" / "config.json").write_text(json.dumps(stated))
    nas, llama = load_causal_lm(tmp_path / "nas"), load_causal_lm(tmp_path / "gqa")
    assert type(nas).__name__ == "DeciLMForCausalLM" and type(llama).__name__ == "LlamaForCausalLM"
    prompt = ids()
    with torch.no_grad():
        torch.testing.assert_close(nas(prompt).logits, llama(prompt).logits)
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    nas_tokens, llama_tokens = nas.generate(prompt, **kwargs), llama.generate(prompt, **kwargs)
    assert nas_tokens.shape[1] == prompt.shape[1] + 16
    assert torch.equal(nas_tokens, llama_tokens)
    tokenizer = make_tiny_tokenizer()
    assert tokenizer.batch_decode(nas_tokens) == tokenizer.batch_decode(llama_tokens)


def test_per_layer_logits_equal_layer_by_layer_reference(parent, tmp_path):
    """Counts 4,2,1: layer i computed by layer i of transformers' Llama converted uniformly to counts[i] (the parent
    for 4), the hidden state carried from layer to layer by hand, gives the per-layer model's logits."""
    assert per_layer(parent, tmp_path / "nas", "4,2,1").exit_code == 0
    for groups in (2, 1):
        convert(parent, tmp_path / f"gqa{groups}", groups, progress=False, check=False)
    references = [load_causal_lm(parent), load_causal_lm(tmp_path / "gqa2"), load_causal_lm(tmp_path / "gqa1")]
    nas = load_causal_lm(tmp_path / "nas")
    prompt = ids(1)
    with torch.no_grad():
        base = references[0].model
        hidden = base.embed_tokens(prompt)
        positions = torch.arange(prompt.shape[1]).unsqueeze(0)
        rotary = base.rotary_emb(hidden, position_ids=positions)
        for layer, reference in enumerate(references):  # no mask: sdpa's causal path, as in a forward without padding
            hidden = reference.model.layers[layer](hidden, position_embeddings=rotary, position_ids=positions)
        expected = references[0].lm_head(base.norm(hidden))
        torch.testing.assert_close(nas(prompt).logits, expected)
        # and the counts matter: the uniform 2-head model is not the per-layer one
        assert (references[1](prompt).logits - expected).abs().max() > 1e-3


def test_cache_and_attention_implementation_follow_the_layers(parent, tmp_path):
    """The cache holds each layer's own kv heads; eager attention (set after loading) gives sdpa's logits."""
    assert per_layer(parent, tmp_path / "nas", "4,2,1").exit_code == 0
    nas = load_causal_lm(tmp_path / "nas")
    prompt = ids(2)
    with torch.no_grad():
        out = nas(prompt, use_cache=True)
        assert [layer.keys.shape[1] for layer in out.cache.layers] == [4, 2, 1]
        nas.set_attn_implementation("eager")
        assert {layer.self_attn.config._attn_implementation for layer in nas.model.layers} == {"eager"}
        torch.testing.assert_close(nas(prompt).logits, out.logits, atol=1e-5, rtol=1e-5)


def test_eval_kv_formula_sums_the_layers(parent, tmp_path):
    from mha2gqa.eval.kvcache import measure_kv_cache
    from mha2gqa.eval.model import shape_of

    assert per_layer(parent, tmp_path / "nas", "4,1,2").exit_code == 0
    nas = load_causal_lm(tmp_path / "nas")
    shape = shape_of(nas.config)
    assert shape.layer_kv_heads == (4, 1, 2) and shape.kv_bytes_per_token() == 2 * 7 * 8 * 4
    measured = measure_kv_cache(nas, shape)
    assert measured["match"] and measured["measured_bytes_per_token"] == 2 * 7 * 8 * 4


@pytest.mark.parametrize(
    "counts, extra, message",
    [
        ("4,2", (), "gives 2 counts but SRC has 3 layers"),
        ("4,3,1", (), "layer 1's 3 must divide num_key_value_heads=4 (valid: 1, 2, 4)"),
        ("4,4,4", (), "nothing to convert"),
        ("4,x,1", (), "one positive integer per layer"),
        ("4,2,1", ("--groups", "2"), "--groups and --kv-heads-per-layer both give the kv heads: give one"),
        ("4,2,1", ("--kv-budget", "0.5"), "--kv-heads-per-layer and --kv-budget both give the kv heads"),
    ],
)
def test_bad_requests_are_one_line_and_write_nothing(parent, tmp_path, counts, extra, message):
    result = per_layer(parent, tmp_path / "dst", counts, *extra)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert not (tmp_path / "dst").exists()


def test_parents_the_format_cannot_state_are_refused(tmp_path):
    """An MLP width that is not a multiple of 256 (ffn_mult cannot say it), a non-Llama parent."""
    save_tiny_model(tmp_path / "narrow", "llama", num_key_value_heads=4)  # intermediate_size 96
    result = per_layer(tmp_path / "narrow", tmp_path / "dst", "4,2")
    assert result.exit_code == 2 and "intermediate_size=96 is not a multiple of 256" in result.output
    save_tiny_model(tmp_path / "qwen", "qwen2", intermediate_size=256, num_key_value_heads=4)
    result = per_layer(tmp_path / "qwen", tmp_path / "dst", "4,2")
    assert result.exit_code == 2 and "--kv-heads-per-layer: SRC has model_type 'qwen2'" in result.output
    assert not (tmp_path / "dst").exists()
    # counts that do not differ need no Nemotron-NAS format: written as --groups writes them, any parent
    assert per_layer(tmp_path / "qwen", tmp_path / "dst", "2,2", "--no-check").exit_code == 0
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["model_type"] == "qwen2"


def test_ffn_mult_reproduces_every_width_the_readers_can_build():
    for hidden in (64, 576, 2048, 4096, 5120, 8192, 3072, 896):
        for width in range(256, 12 * hidden, 256):
            assert ffn_mult_to_intermediate_size(ffn_mult_for(width, hidden), hidden) == width
        for width in (96, 1000, 11008 + 1):
            with pytest.raises(InputError, match="not a multiple of 256"):
                ffn_mult_for(width, hidden)


def test_block_configs_the_class_cannot_build_are_refused(parent, tmp_path):
    assert per_layer(parent, tmp_path / "nas", "4,2,1").exit_code == 0
    path = tmp_path / "nas" / "config.json"
    config = json.loads(path.read_text())
    for break_it, message in [
        (lambda c: c["block_configs"][1]["attention"].update(no_op=True), "block_configs[1].attention.no_op is true"),
        (lambda c: c["block_configs"][0]["attention"].update(n_heads_in_group=3), "n_heads_in_group=3 must be"),
        (lambda c: c["block_configs"].pop(), "has 2 block_configs for num_hidden_layers=3"),
    ]:
        broken = json.loads(json.dumps(config))
        break_it(broken)
        path.write_text(json.dumps(broken))
        with pytest.raises(InputError, match=re.escape(message)):
            load_causal_lm(tmp_path / "nas")


def test_a_saved_child_stays_in_the_format(parent, tmp_path):
    """save_pretrained of our class (uptrain's output) writes NVIDIA's architecture name and no uniform kv heads or
    MLP width beside the blocks; the saved model loads back with the same logits."""
    assert per_layer(parent, tmp_path / "nas", "4,2,1").exit_code == 0
    nas = load_causal_lm(tmp_path / "nas")
    nas.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["architectures"] == ["DeciLMForCausalLM"] and config["model_type"] == "nemotron-nas"
    assert "num_key_value_heads" not in config and "intermediate_size" not in config
    assert config["block_configs"] == json.loads((tmp_path / "nas" / "config.json").read_text())["block_configs"]
    prompt = ids(3)
    with torch.no_grad():
        torch.testing.assert_close(load_causal_lm(tmp_path / "saved")(prompt).logits, nas(prompt).logits)


def test_the_config_class_answers_vllms_attribute_reads_and_writes_the_blocks_as_read(parent, tmp_path):
    """vLLM's nemotron_nas.py reads `block.attention.n_heads_in_group`, `block.attention.no_op` and
    `hasattr(block.ffn, "ffn_mult")` (else ffn.intermediate_size); NVIDIA's remote config class allows that, ours
    must too, while its blocks stay plain JSON objects in config.json and survive vLLM's copies (deepcopy, pickle)."""
    from transformers import AutoConfig

    from mha2gqa.nemotron_nas.modeling import register

    assert per_layer(parent, tmp_path / "nas", "4,2,1").exit_code == 0
    register()
    config = AutoConfig.from_pretrained(tmp_path / "nas")
    for copied in (config, pickle.loads(pickle.dumps(config)), copy_module.deepcopy(config)):
        blocks = copied.block_configs
        assert [8 // b.attention.n_heads_in_group for b in blocks] == [4, 2, 1]
        assert [b.attention.no_op or b.ffn.no_op for b in blocks] == [False] * 3
        assert all(hasattr(b.ffn, "ffn_mult") and not hasattr(b.ffn, "intermediate_size") for b in blocks)
        assert blocks[0]["ffn"]["ffn_mult"] == blocks[0].ffn.ffn_mult == 6.0  # still a dict
    written = json.loads((tmp_path / "nas" / "config.json").read_text())["block_configs"]
    assert json.loads(config.to_json_string())["block_configs"] == written
    config.block_configs[0]["ffn"].update(ffn_mult=None, intermediate_size=512)  # null reads as absent, as ours do
    assert not hasattr(config.block_configs[0].ffn, "ffn_mult") and config.block_configs[0].ffn.intermediate_size == 512
    with pytest.raises(AttributeError, match="'sparsify'"):
        config.block_configs[0].attention.sparsify  # noqa: B018 (an attribute read is the test)


def test_modeling_register_is_vllms_general_plugin():
    """vLLM runs each `vllm.general_plugins` entry point in every process it starts: ours names register(), which
    makes "nemotron-nas" a config type transformers' AutoConfig knows."""
    import configparser
    from importlib import import_module
    from pathlib import Path

    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    setup = configparser.ConfigParser()
    setup.read(Path(__file__).resolve().parent.parent / "setup.cfg")
    plugins = dict(
        line.split(" = ") for line in setup["options.entry_points"]["vllm.general_plugins"].strip().splitlines()
    )
    module, function = plugins["mha2gqa_nemotron_nas"].split(":")
    getattr(import_module(module), function)()
    assert CONFIG_MAPPING["nemotron-nas"].__name__ == "NemotronNasConfig"


def test_convert_refuses_a_nemotron_nas_source(parent, tmp_path):
    assert per_layer(parent, tmp_path / "nas", "4,2,4").exit_code == 0
    result = CliRunner().invoke(main, ["convert", str(tmp_path / "nas"), str(tmp_path / "dst"), "--groups", "2"])
    assert result.exit_code == 2 and "SRC is a Nemotron-NAS checkpoint (per-layer kv heads)" in result.output
    assert not (tmp_path / "dst").exists()


def test_dtype_casts_every_tensor_and_the_config_says_so(parent, tmp_path):
    result = per_layer(parent, tmp_path / "bf16", "2,1,4", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["model_type"] == "nemotron-nas"
    record = json.loads((tmp_path / "bf16" / "mha2gqa.json").read_text())["lineage"][-1]
    assert record["kv_bytes_per_token"] == 2 * (2 + 1 + 4) * 8 * 2  # bfloat16: 2 bytes a value
    assert load_causal_lm(tmp_path / "bf16").dtype == torch.bfloat16


def test_the_cards_reproduce_command_makes_the_same_checkpoint(parent, tmp_path):
    """The per-layer card's Reproduce line (the counts, and --dtype) run again writes the same bytes."""
    assert per_layer(parent, tmp_path / "made", "2,4,1", "--dtype", "bfloat16").exit_code == 0
    card = (tmp_path / "made" / "README.md").read_text()
    (line,) = [line for line in card.splitlines() if line.startswith("mha2gqa convert ")]
    words = shlex.split(line, comments=True)
    assert words[:4] == ["mha2gqa", "convert", str(parent), "OUT"] and "--kv-heads-per-layer" in words
    result = CliRunner().invoke(main, [*words[1:3], str(tmp_path / "again"), *words[4:], "-q"])
    assert result.exit_code == 0, result.output
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "again" / name).read_bytes() == (tmp_path / "made" / name).read_bytes(), name


def test_inspect_reports_each_layers_kv_heads_and_the_true_bytes(parent, tmp_path):
    """A 4,2,1 child (head_dim 8, float32): 2 x 4 bytes x 8 x (4+2+1) = 448 B a token, not a uniform table."""
    assert per_layer(parent, tmp_path / "nas", "4,2,1").exit_code == 0
    from mha2gqa.convert.inspect import inspect_model

    info = inspect_model(tmp_path / "nas", context=100, batch=3)
    assert info["kv_heads_per_layer"] == [4, 2, 1] and info["kv_heads"] is None
    assert (info["kv_bytes_per_token"], info["kv_bytes_per_sequence"], info["kv_bytes_per_batch"]) == (
        448,
        44800,
        134400,
    )
    assert info["targets"] == []  # convert takes no per-layer SRC: no target to offer
    out = CliRunner().invoke(main, ["inspect", str(tmp_path / "nas"), "--context", "100", "--batch", "3"])
    assert out.exit_code == 0, out.output
    assert "kv heads per layer 4,2,1" in out.output and "4 kv heads" not in out.output
    assert "448 B" in out.output and "43.75 KiB" in out.output and "saving" not in out.output
