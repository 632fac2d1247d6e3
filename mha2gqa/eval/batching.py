"""`--batch-size auto`: the largest batch of perplexity windows the free memory holds, by an estimate made
before the first forward pass (no trial runs that could fail half-way). lm-eval's tasks take "auto" to
the harness itself, which searches its own batch."""

from __future__ import annotations

AUTO = "auto"
MAX_AUTO_BATCH = 64  # beyond this a batch of windows gains nothing on either device
SHARE_OF_FREE = 0.25  # what one batch may take of the free memory: the models and the allocator need the rest


def window_bytes(config, context: int, element_bytes: int) -> int:
    """An upper bound on the memory one window of `context` tokens takes in a forward pass: its logits (and
    their float32 copy for the loss), the hidden states and MLP activations of a layer, and an eager
    attention's score matrix."""
    vocab, hidden = config.vocab_size, config.hidden_size
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    heads = config.num_attention_heads
    logits = context * vocab * (element_bytes + 4)
    layer = context * element_bytes * (4 * hidden + 2 * intermediate) + heads * context * context * element_bytes
    return logits + layer


def free_bytes(device) -> int:
    if device.type == "cuda":
        import torch

        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def auto_batch_size(model, context: int, device, models: int = 1) -> int:
    """The batch for `models` models running the same windows together (agreement runs two)."""
    element = next(model.parameters()).element_size()
    need = models * window_bytes(model.config, context, element)
    return max(1, min(MAX_AUTO_BATCH, int(free_bytes(device) * SHARE_OF_FREE // need)))


def validate_batch_size(value) -> None:
    from mha2gqa.runtime.errors import InputError

    if value == AUTO:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"--batch-size {value} must be at least 1 (a whole number), or auto")
