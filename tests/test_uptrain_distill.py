"""The distillation loss in chunks of positions (uptrain/distill.py): the same loss and gradients as the plain
loss from whole logits, without keeping a (tokens x vocabulary) tensor; the plain loss where a model's logits are
more than its output layer (gemma2's soft-cap)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from tiny_models import make_tiny_model

from mha2gqa.uptrain import distill, plan

CASES = [(0.25, 2.0, True), (1.0, 1.0, False), (0.0, 1.0, True)]  # kl_weight, temperature, head trained


def _models(model_type: str, head_trained: bool):
    student = make_tiny_model(model_type, seed=1).train()
    teacher = make_tiny_model(model_type, seed=2).eval().requires_grad_(False)
    student.get_output_embeddings().weight.requires_grad_(head_trained)
    return student, teacher


def _chunks_of(rows: int, monkeypatch) -> None:
    """Chunks of `rows` positions for the tiny models' vocabulary of 128."""
    monkeypatch.setattr(plan, "CHUNK_ROWS", rows)
    monkeypatch.setattr(plan, "CHUNK_ELEMENTS", rows * 128)


def _plain(student, teacher, weight, temperature):
    return lambda batch: distill.plain_distill_loss(
        student, teacher, batch, weight, temperature, contextlib.nullcontext
    )


def _loss_and_grads(loss_fn, student, batch):
    student.zero_grad(set_to_none=True)
    value = loss_fn(batch)
    value.backward()
    return value, {n: p.grad.clone() for n, p in student.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_type", ["llama", "phi", "qwen2"])  # phi: its output layer has a bias
@pytest.mark.parametrize(("weight", "temperature", "head_trained"), CASES)
def test_the_chunked_loss_is_the_plain_one(model_type, weight, temperature, head_trained, monkeypatch):
    _chunks_of(5, monkeypatch)  # 11 chunks for 51 positions
    torch.manual_seed(0)
    student, teacher = _models(model_type, head_trained)
    batch = torch.randint(0, 128, (3, 17))
    plain = _plain(student, teacher, weight, temperature)
    chunked = distill.DistillLoss(student, student, teacher, weight, temperature, contextlib.nullcontext)
    expected, expected_grads = _loss_and_grads(plain, student, batch)
    value, grads = _loss_and_grads(chunked, student, batch)
    assert chunked.chunked is True
    assert value.item() == pytest.approx(expected.item(), rel=2e-6, abs=1e-7)
    assert sorted(grads) == sorted(expected_grads)  # the same parameters get gradients (the head when trained)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-4, atol=1e-7)


def test_no_tensor_of_every_position_by_the_vocabulary_is_kept(monkeypatch):
    """The plain loss keeps several (tokens x vocab) float32 tensors for backward; the chunked one, at most
    a chunk's (here 5 positions x 128) at a time."""
    _chunks_of(5, monkeypatch)
    student, teacher = _models("llama", head_trained=True)
    batch = torch.randint(0, 128, (3, 17))

    weights = {p.untyped_storage().data_ptr() for p in [*student.parameters(), *teacher.parameters()]}

    def saved_by(loss_fn) -> int:
        """The most elements of a tensor over the vocabulary (..., 128) saved for backward, the weights left out."""
        sizes = []

        def pack(t):
            if t.ndim and t.shape[-1] == 128 and t.untyped_storage().data_ptr() not in weights:
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss_fn(batch).backward()
        return max(sizes)

    vocab, positions = 128, batch.numel()
    assert saved_by(_plain(student, teacher, 0.5, 1.0)) >= positions * vocab
    chunked = distill.DistillLoss(student, student, teacher, 0.5, 1.0, contextlib.nullcontext)
    assert saved_by(chunked) <= 5 * vocab < positions * vocab


def test_a_soft_capped_model_keeps_the_plain_loss():
    """gemma2 soft-caps its logits after the output layer: the chunks would leave the cap out, so the first
    micro-batch finds that the last position's logits differ and the loss stays the plain one, exactly."""
    student, teacher = _models("gemma2", head_trained=True)
    batch = torch.randint(0, 128, (2, 9))
    chunked = distill.DistillLoss(student, student, teacher, 0.25, 2.0, contextlib.nullcontext)
    value, grads = _loss_and_grads(chunked, student, batch)
    expected, expected_grads = _loss_and_grads(_plain(student, teacher, 0.25, 2.0), student, batch)
    assert chunked.chunked is False and torch.equal(value, expected)
    assert all(torch.equal(grads[n], expected_grads[n]) for n in expected_grads)


@pytest.mark.parametrize("weight", [1.0, 0.25])
def test_chunks_of_a_multiple_of_16_positions_train_bit_for_bit_as_the_plain_loss(weight, monkeypatch):
    """Chunk rows that the matrix products block as the whole micro-batch does (CPU kernels: multiples of 16)
    give each position's logits and their gradient the plain loss's very bits: the same training. Only the
    loss's value may differ in its last bit (a float32 sum over every term, in another order)."""
    _chunks_of(16, monkeypatch)
    torch.manual_seed(0)
    student, teacher = _models("llama", head_trained=False)
    batch = torch.randint(0, 128, (3, 40))  # 120 positions: 7 chunks of 16 and one of 8
    expected, expected_grads = _loss_and_grads(_plain(student, teacher, weight, 2.0), student, batch)
    chunked = distill.DistillLoss(student, student, teacher, weight, 2.0, contextlib.nullcontext)
    value, grads = _loss_and_grads(chunked, student, batch)
    assert sorted(grads) == sorted(expected_grads)
    assert all(torch.equal(grads[n], expected_grads[n]) for n in grads), [
        n for n in grads if not torch.equal(grads[n], expected_grads[n])
    ]
    assert value.item() == pytest.approx(expected.item(), rel=1e-6)


def test_a_chunk_is_a_multiple_of_64_positions():
    assert plan.chunk_rows(49_152) == 64  # SmolLM2: 12 MiB of float32 logits a chunk
    assert plan.chunk_rows(128) == 32_768 and plan.chunk_rows(262_144) == 64  # never fewer than 64
