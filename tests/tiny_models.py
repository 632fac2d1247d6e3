"""Tiny random models of every supported architecture, built from configs (no download)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

VOCAB = 128
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# Per-type additions: the features the converter must handle (biases, norms, fused qkv, head_dim).
EXTRA = {
    "llama": dict(attention_bias=True),
    "mistral": dict(sliding_window=None),
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16),
    "olmo": dict(),
    "granite": dict(),
    "qwen2": dict(),
    "qwen3": dict(head_dim=8),
    "olmo2": dict(),
    "stablelm": dict(qk_layernorm=True, use_qkv_bias=True),
    "phi": dict(),
    "phi3": dict(),
}
MODEL_TYPES = sorted(EXTRA)


def tiny_config(model_type: str = "llama", **overrides):
    kwargs = {**BASE, **EXTRA[model_type], **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def make_tiny_model(model_type: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides), dtype=torch.float32)
    # Norm weights start at exactly 1 and biases at 0: perturb them so pooling mistakes show.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


def save_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, max_shard_size=None, dtype=None, **overrides):
    model = make_tiny_model(model_type, seed=seed, **overrides)
    if dtype is not None:
        model = model.to(dtype)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model


SAMPLE_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be "
    "on his first entering a neighbourhood, this truth is so well fixed in the minds of the "
    "surrounding families, that he is considered the rightful property of some one or other of "
    "their daughters.\n"
)


def make_tiny_tokenizer(path: Path | None = None):
    """A character-level BPE tokenizer whose ids fit the tiny models' vocabulary (VOCAB)."""
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2, 3 match the tiny configs
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=list(string.printable[:95]) + ["▁"],
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    if path is not None:
        fast.save_pretrained(path)
    return fast


def save_tiny_family(root: Path, kv_heads: dict[str, int]) -> Path:
    """Tiny llamas under root/NAME, one per {name: kv heads}, sharing one tokenizer (a parent and its
    conversions, as eval and report compare them)."""
    tok = make_tiny_tokenizer()
    for name, kv in kv_heads.items():
        save_tiny_model(root / name, "llama", num_key_value_heads=kv, seed=kv)
        tok.save_pretrained(root / name)
    return root


def save_tiny_inputs(root: Path, **overrides) -> Path:
    """A tiny llama with a tokenizer under root/src, and root/cal.txt, root/eval.txt: the inputs of a convert,
    sweep or eval run on the command line."""
    save_tiny_model(root / "src", "llama", **overrides)
    make_tiny_tokenizer(root / "src")
    (root / "cal.txt").write_text(SAMPLE_TEXT * 8)
    (root / "eval.txt").write_text(SAMPLE_TEXT.upper() * 4)
    return root
