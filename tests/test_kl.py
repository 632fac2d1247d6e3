"""mha2gqa.scoring.kl: the one KL(parent || model) that refine's global stage, uptraining's distillation and eval's
agreement share (issue 27: it was written three times)."""

import ast
import math
from pathlib import Path

import pytest
import torch

from mha2gqa.scoring.kl import kl_divergence

PACKAGE = Path(__file__).resolve().parent.parent / "mha2gqa"


def test_kl_matches_the_definition_for_each_reduction_and_temperature():
    """KL(p || q) = sum_v p_v (log p_v - log q_v), by hand in float64 on 2 x 3 positions of 4 logits."""
    parent = torch.tensor([[[1.0, 2.0, 0.5, -1.0]] * 3, [[0.0, 0.0, 3.0, 1.0]] * 3])
    model = torch.tensor([[[2.0, 1.0, 0.0, 0.0]] * 3, [[1.0, -1.0, 2.0, 0.5]] * 3])

    def by_hand(a: list[float], b: list[float], t: float) -> float:
        za, zb = sum(math.exp(x / t) for x in a), sum(math.exp(x / t) for x in b)
        return sum(math.exp(x / t) / za * ((x / t - math.log(za)) - (y / t - math.log(zb))) for x, y in zip(a, b))

    for t in (1.0, 2.0):
        rows = [by_hand(parent[i, 0].tolist(), model[i, 0].tolist(), t) for i in range(2)]
        per_position = kl_divergence(parent, model, t, reduction="none")
        assert per_position.shape == (2, 3) and per_position.dtype == torch.float32
        assert per_position[:, 0].tolist() == pytest.approx(rows, rel=1e-5)
        assert kl_divergence(parent, model, t).item() == pytest.approx(sum(rows) / 2, rel=1e-5)
        assert kl_divergence(parent, model, t, reduction="sum").item() == pytest.approx(3 * sum(rows), rel=1e-5)
    assert kl_divergence(parent, parent).item() == pytest.approx(0.0, abs=1e-7)
    assert kl_divergence(model, parent).item() != pytest.approx(kl_divergence(parent, model).item())  # not symmetric


def test_kl_of_bfloat16_logits_is_computed_in_float32():
    """A log-softmax of bfloat16 logits keeps 3 significant digits: the KL of two close distributions
    would be mostly rounding. The function casts first, so bfloat16 logits give their float32 KL."""
    torch.manual_seed(0)
    parent = torch.randn(8, 1000).bfloat16()
    model = parent + 0.01 * torch.randn(8, 1000).bfloat16()
    assert torch.equal(kl_divergence(parent, model), kl_divergence(parent.float(), model.float()))


def test_the_three_users_call_the_one_kl_and_no_module_writes_its_own():
    """refine's global stage, uptrain's distillation loss and eval's agreement import mha2gqa.scoring.kl, and no
    module but kl.py calls a kl_div or builds a KL from log-softmaxes."""
    users = ["convert/refine/global_stage.py", "uptrain/distill.py", "scoring/agreement.py"]
    for user in users:
        tree = ast.parse((PACKAGE / user).read_text())
        imported = {
            (node.module, a.name) for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for a in node.names
        }
        assert ("mha2gqa.scoring.kl", "kl_divergence") in imported, user
    own = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "kl.py":
            continue
        text = path.read_text()
        if "kl_div(" in text or ("log_softmax" in text and ".exp() *" in text):
            own.append(path.relative_to(PACKAGE).as_posix())
    assert own == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_hand_written_gradient_is_autograds(dtype):
    """The model's logits get the gradient autograd takes through the log-softmaxes, for each reduction and
    temperature, in the logits' dtype; the value is the same; the parent's logits, a fixed target, get none."""
    from mha2gqa.scoring.kl import kl_through_autograd

    torch.manual_seed(0)
    for temperature in (1.0, 2.0):
        for reduction in ("mean", "sum", "none"):
            parent = torch.randn(2, 5, 300).to(dtype)
            fused = torch.randn(2, 5, 300).to(dtype).requires_grad_(True)
            plain = fused.detach().clone().requires_grad_(True)
            value = kl_divergence(parent, fused, temperature, reduction)
            functions = [value.grad_fn, *(f for f, _ in value.grad_fn.next_functions)]
            assert any("_TargetKL" in type(f).__name__ for f in functions if f is not None)  # the hand-written one
            reference = kl_through_autograd(parent, plain, temperature)
            reference = {"mean": reference.mean(), "sum": reference.sum(), "none": reference}[reduction]
            assert torch.equal(value.detach(), reference.detach())
            weights = torch.rand(value.shape) + 0.5
            (value * weights).sum().backward()
            (reference * weights).sum().backward()
            assert fused.grad.dtype == dtype and fused.grad.shape == fused.shape
            scale = float(plain.grad.float().abs().max())
            assert scale > 0
            assert float((fused.grad.float() - plain.grad.float()).abs().max()) <= 1e-5 * scale


def test_a_fixed_target_with_a_gradient_of_its_own_takes_autograds_path():
    """When the parent's logits need a gradient too (not a fit of ours, but a caller's), both get autograd's."""
    parent = torch.randn(3, 40, requires_grad=True)
    model = torch.randn(3, 40, requires_grad=True)
    kl_divergence(parent, model).backward()
    assert parent.grad is not None and model.grad is not None
    assert float(parent.grad.abs().max()) > 0
