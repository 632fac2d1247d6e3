"""The block stage, a layer stage of `--refine` (mha2gqa.convert.refine.LayerStage) kept in bench/: after a
layer's attention is fitted, its MLP's output projection is solved against the parent's layer output, so the
MLP absorbs what one shared K/V head cannot express and the drift that the layers below left in the residual
stream. It was `convert --refine-mlp` until issue 27: on SmolLM2 it made both held-out perplexities worse at
1.8x the time (docs/refine-results.md), so no user was told to turn it on. refine_real.py's `block` setting
runs it (refine_attention's layer_stage, through execute); tests/test_refine_real_bench.py tests it.

Why the output projection and why least squares: when the MLP's output is added to the residual
stream unchanged (every pre-norm layout), the layer output is affine in that Linear's weight given its
input, so its best value on the fit tokens is one float64 normal-equations solve: no optimiser, one
pass over the tokens. Whether a layer is such a layer is not read from a table but probed: a random
offset added to the projection's output must come out of the layer unchanged (gemma2's and olmo2's
post-norms, a MoE's routed experts fail the probe, and those layers keep their MLP as it is).

Why per-token weights: a real model's residual stream has massive activations (SmolLM2: norms 150x
the median on the first token of a block from layer 11 on), so a plain squared error on it is
mostly the first token's (86% of it at layer 11, docs/refine-results.md). Every reader of the residual stream
(the next layer's norms, the final norm) divides by the token's own RMS, so each token's squared error is
weighted by 1 / mean(t^2) of its target t: the relative error each token's reader sees.
"""

from __future__ import annotations

import torch

from mha2gqa.convert.refine.attention import relative, ridge_solve
from mha2gqa.convert.refine.hooks import call_layer

PROBE_TOLERANCE = 1e-4  # relative: an additive layer passes with float32 rounding (~1e-7)


def output_projection(layer) -> torch.nn.Linear | None:
    """The MLP's last Linear onto the hidden size (llama's down_proj, phi's fc2), or None."""
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return None
    hidden = None
    linears = [m for m in mlp.modules() if isinstance(m, torch.nn.Linear)]
    if linears:
        hidden = linears[0].in_features
    last = [m for m in linears if m.out_features == hidden]
    return last[-1] if last else None


def token_weights(targets: torch.Tensor) -> torch.Tensor:
    """(blocks, seq, d) -> (blocks, seq) float64 weights 1 / mean(t^2), so a token's weighted squared
    error is its error relative to its own RMS."""
    power = torch.stack([block.double().pow(2).mean(-1) for block in targets])
    return 1.0 / power.clamp_min(torch.finfo(torch.float32).tiny)


def is_additive(layer, projection, hidden: torch.Tensor, kwargs: dict) -> bool:
    """Whether an offset added to `projection`'s output reaches the layer's output unchanged, on `hidden`
    (one block): the condition under which the least-squares solve below is exact."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        plain = call_layer(layer, hidden, kwargs)
        offset = torch.randn(plain.shape, generator=generator).to(plain)
        handle = projection.register_forward_hook(lambda module, args, out: out + offset.view_as(out))
        try:
            moved = call_layer(layer, hidden, kwargs)
        finally:
            handle.remove()
    return bool((moved - plain - offset).norm() <= PROBE_TOLERANCE * offset.norm())


class OutputSolve:
    """Weighted least squares for `projection` (weight and bias) so that the layer's output ~= the targets
    on the fit blocks, given everything else in the layer, accumulated while the layer runs over the
    blocks anyway (hooks.advance, the pass that moves the converted states on): a hook keeps the projection's
    input z and output y, and add() takes the layer's output. The projection's needed output is
    y* = t - (out - y), the layer's output less the projection's own part (additive: see is_additive)."""

    def __init__(self, projection: torch.nn.Linear, targets: torch.Tensor, weights: torch.Tensor, fit_blocks: int):
        self.projection, self.targets, self.weights, self.fit_blocks = projection, targets, weights, fit_blocks
        self.has_bias = projection.bias is not None
        width = projection.in_features + self.has_bias
        device = projection.weight.device
        self.gram = torch.zeros(width, width, dtype=torch.float64, device=device)
        self.cross = torch.zeros(width, projection.out_features, dtype=torch.float64, device=device)
        self.seen: dict = {}
        self.handle = projection.register_forward_hook(lambda module, args, out: self.seen.update(z=args[0], y=out))

    def add(self, start: int, out: torch.Tensor) -> None:
        """The layer's output for blocks start, start + 1, ...: the fit blocks among them join the sums."""
        count = min(len(out), self.fit_blocks - start)
        if count <= 0:
            return
        device = self.gram.device
        t = self.targets[start : start + count].to(device).double()
        wanted = t - out[:count].double() + self.seen["y"][:count].double()
        a = self.seen["z"][:count].reshape(-1, self.projection.in_features).double()
        if self.has_bias:
            a = torch.cat([a, a.new_ones(len(a), 1)], dim=1)
        root = self.weights[start : start + count].to(device).reshape(-1, 1).sqrt()
        a, wanted = a * root, wanted.reshape(len(a), -1) * root
        self.gram += a.T @ a
        self.cross += a.T @ wanted

    def solve(self) -> None:
        """Write the solution into the projection (a tiny ridge, 1e-6 of the mean diagonal, as o_proj's)."""
        self.handle.remove()
        solution = ridge_solve(self.gram, self.cross)  # (width, d)
        weight = self.projection.weight
        with torch.no_grad():
            weight.copy_(solution[: self.projection.in_features].T.to(weight.dtype))
            if self.has_bias:
                self.projection.bias.copy_(solution[-1].to(weight.dtype))

    def close(self) -> None:
        self.handle.remove()


def weighted_errors(outputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, batch_blocks: int):
    """Per block (blocks,) float64: sum_t w_t ||out_t - t_t||^2 and sum_t w_t ||t_t||^2, from the buffers."""
    errors, power = torch.zeros(len(outputs), dtype=torch.float64), torch.zeros(len(outputs), dtype=torch.float64)
    for start in range(0, len(outputs), batch_blocks):
        end = start + batch_blocks
        out, t, w = outputs[start:end].double(), targets[start:end].double(), weights[start:end].double()
        errors[start:end] = ((out - t).pow(2).sum(-1) * w).sum(-1).cpu()
        power[start:end] = (t.pow(2).sum(-1) * w).sum(-1).cpu()
    return errors, power


class BlockStage:
    """One layer's block stage, a refine.LayerStage: built once the attention is fitted (it probes the
    layer), fed the layer's outputs by the pass that advances the converted states (add), then finish()
    solves, measures the per-token relative output error on the fit and held-out blocks before and after,
    and keeps the solve only if both fall. Buffers (buffers.ActivationBuffers): 'converted' holds the layer's
    inputs, 'parent' the parent's layer outputs (the targets), 'inputs' the layer's outputs."""

    def __init__(self, layer, kwargs: dict, buffers, split: dict, options):
        self.layer, self.buffers, self.split, self.batch_blocks = layer, buffers, split, options.batch_blocks
        self.projection, self.solver, self.skipped = output_projection(layer), None, None
        device, dtype = next(layer.parameters()).device, next(layer.parameters()).dtype
        if self.projection is None:
            self.skipped = "skipped: the layer has no MLP output projection"
        elif not is_additive(layer, self.projection, buffers["converted"][:1].to(device, dtype), kwargs):
            self.skipped = "skipped: the MLP output does not add into the residual stream unchanged"
        else:
            # The converted model shares every non-attention tensor with the parent (model.converted_model):
            # the projection gets its own copy before it is solved.
            for name, p in list(self.projection.named_parameters(recurse=False)):
                setattr(self.projection, name, torch.nn.Parameter(p.detach().clone(), requires_grad=False))
            self.weights = token_weights(buffers["parent"])
            self.solver = OutputSolve(self.projection, buffers["parent"], self.weights, len(split["fit"]))

    def add(self, start: int, out: torch.Tensor) -> None:
        if self.solver is not None:
            self.solver.add(start, out)

    def _errors(self) -> dict:
        errors, power = weighted_errors(self.buffers["inputs"], self.buffers["parent"], self.weights, self.batch_blocks)
        return {part: relative(errors, power, self.split[part]) for part in ("fit", "heldout")}

    def finish(self, advance) -> tuple[dict, dict]:
        """Solve, re-run the layer with `advance()` (which refills buffers['inputs']), keep or restore.
        Returns the solved tensors under their names in the layer ({} when unchanged) and the report."""
        if self.solver is None:
            return {}, {"block_stage": self.skipped}
        before = self._errors()
        saved = {name: p.detach().clone() for name, p in self.projection.named_parameters()}
        self.solver.solve()
        advance()
        after = self._errors()
        kept = after["fit"] < before["fit"] and after["heldout"] < before["heldout"]
        if not kept:
            with torch.no_grad():
                for name, p in self.projection.named_parameters():
                    p.copy_(saved[name])
            advance()
            after = before
        report = {
            "output_fit_error_before": before["fit"],
            "output_fit_error_after": after["fit"],
            "output_heldout_error_before": before["heldout"],
            "output_heldout_error_after": after["heldout"],
        }
        prefix = next(name for name, module in self.layer.named_modules() if module is self.projection)
        solved = {f"{prefix}.{key}": p.detach() for key, p in self.projection.named_parameters()} if kept else {}
        return solved, report
