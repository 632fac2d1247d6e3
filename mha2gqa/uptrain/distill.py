"""The distillation loss, (1 - w) * LM + w * T^2 * KL(teacher || student), without a whole (tokens x vocabulary) tensor.

A vocabulary of 49,152 (SmolLM2) makes each float32 copy of a micro-batch's logits 400 MB at 4 x 512 tokens, and
the plain loss held about ten at once (the student's logits, the teacher's, both log-softmaxes, the probabilities,
the terms and their gradients): 7.53 GiB peak for a 135M model. Here both models stop at their last hidden state
(tokens, d) and the output layer runs on a chunk of positions at a time. Each chunk's loss (the KL of
mha2gqa.scoring.kl, the one formula, and the cross-entropy) is differentiated at once, with respect to its hidden states
(and the output layer's weights when they train), and its logits are dropped before the next chunk: the loss
is a sum over positions, so the chunks' gradients are the whole one's, and backward only scales them.

A model whose logits are more than its output layer applied to the last hidden state (a soft-cap, a scale) is
found on the first micro-batch and keeps the plain loss (its memory too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mha2gqa.scoring.kl import kl_divergence
from mha2gqa.uptrain import plan

IGNORE = -100  # transformers' label for "no next token" (the last position of each block)


def kl_teacher_student(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of next-token distributions, mean over positions, scaled by T^2 so that
    its gradient does not shrink as T grows (Hinton et al. 2015)."""
    vocab = student_logits.shape[-1]
    # (B, S, V) -> (B*S, V); the sum over every term divided by the positions is torch's "batchmean"
    student, teacher = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    return kl_divergence(teacher, student, temperature, reduction="sum") / len(student) * temperature**2


def plain_distill_loss(
    model, teacher, batch, kl_weight: float, temperature: float, autocast, weights=None
) -> torch.Tensor:
    """The loss from whole logits: for models whose logits are not their output layer's alone. `weights`
    ((B*S,) or None: every position 1) weigh each position's terms, as position_weights makes them."""
    out = model(input_ids=batch, labels=batch, use_cache=False)
    with torch.no_grad(), autocast():
        teacher_logits = teacher(input_ids=batch, use_cache=False).logits
    if weights is None:
        return (1 - kl_weight) * out.loss + kl_weight * kl_teacher_student(out.logits, teacher_logits, temperature)
    vocab = out.logits.shape[-1]
    student, parent = out.logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    kl = (kl_divergence(parent, student, temperature, reduction="none") * weights).sum() / weights.sum()
    labels = next_tokens(batch)
    ce = F.cross_entropy(student.float(), labels, ignore_index=IGNORE, reduction="none")
    lm = (ce * weights).sum() / weights[labels != IGNORE].sum()
    return (1 - kl_weight) * lm + kl_weight * kl * temperature**2


def next_tokens(batch: torch.Tensor) -> torch.Tensor:
    """(B*S,) the next token of each position, IGNORE at each block's last (transformers' shift of labels=batch)."""
    return F.pad(batch[:, 1:], (0, 1), value=IGNORE).reshape(-1)


def position_weights(marks: torch.Tensor | None, answer_weight: float) -> torch.Tensor | None:
    """(B*S,) float32 weights of the positions whose next token is a marked answer token (answer_weight) and of
    every other position (1); None when nothing is weighed apart (no marks, or answer_weight 1: the plain loss)."""
    if marks is None or answer_weight == 1:
        return None
    predicts_answer = F.pad(marks[:, 1:], (0, 1), value=False).reshape(-1)
    return 1 + (answer_weight - 1) * predicts_answer.float()


@dataclass
class Head:
    """A model's output layer: logits = hidden @ weight^T + bias."""

    weight: torch.Tensor  # (V, d)
    bias: torch.Tensor | None  # (V,)

    @classmethod
    def of(cls, model) -> Head:
        layer = model.get_output_embeddings()
        return cls(layer.weight, getattr(layer, "bias", None))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight, self.bias)

    def trained(self) -> list[torch.Tensor]:
        return [x for x in (self.weight, self.bias) if x is not None and x.requires_grad]

    def detached(self) -> Head:
        """The same tensors (no copy) as leaves of a new graph, each requiring grad where the original does."""
        return Head(
            *(None if x is None else x.detach().requires_grad_(x.requires_grad) for x in (self.weight, self.bias))
        )


class DistillLoss:
    """batch (B, S) -> the distillation loss, in chunks of positions (see the module's docstring).

    `model` is what the loop calls (accelerate's wrapper: its forward keeps DDP's bookkeeping); `student` and
    `teacher` are the plain models whose output layers the chunks use."""

    def __init__(
        self, model, student, teacher, kl_weight: float, temperature: float, autocast, answer_weight: float = 1.0
    ):
        self.model, self.teacher, self.autocast = model, teacher, autocast
        self.student_head, self.teacher_head = Head.of(student), Head.of(teacher)
        self.kl_weight, self.temperature, self.answer_weight = kl_weight, temperature, answer_weight
        self.chunked: bool | None = None  # decided on the first micro-batch

    def __call__(self, batch: torch.Tensor, marks: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of a batch; `marks` ((B, S) bool, data.train retrieval's answer tokens) weigh the positions
        that predict them by answer_weight (position_weights)."""
        weights = position_weights(marks, self.answer_weight)
        if self.chunked is None:
            self.chunked = self._heads_match(batch[:1, :16])
        if not self.chunked:
            return plain_distill_loss(
                self.model, self.teacher, batch, self.kl_weight, self.temperature, self.autocast, weights
            )
        # logits_to_keep=1: the models' own logits are not needed (the last position's is cheap)
        out = self.model(input_ids=batch, use_cache=False, output_hidden_states=True, logits_to_keep=1)
        hidden = out.hidden_states[-1]  # (B, S, d), what the output layer reads
        del out  # every layer's hidden states: only the last is needed
        with torch.no_grad(), self.autocast():
            teacher_out = self.teacher(input_ids=batch, use_cache=False, output_hidden_states=True, logits_to_keep=1)
        teacher_hidden = teacher_out.hidden_states[-1].reshape(-1, hidden.shape[-1])  # (B*S, d)
        del teacher_out
        labels = next_tokens(batch)  # (B*S,)
        return self._chunked_loss(hidden.reshape(-1, hidden.shape[-1]), teacher_hidden, labels, weights)

    @torch.no_grad()
    def _heads_match(self, probe: torch.Tensor) -> bool:
        """Whether each model's logits are exactly its output layer applied to its last hidden state (the same
        operation on the same numbers: equal bits; a soft-cap or a scale changes them), on a short probe of the
        first batch. Without gradients: under DDP a forward that no backward follows would break the next one."""
        for model, head in ((self.model, self.student_head), (self.teacher, self.teacher_head)):
            with self.autocast():
                out = model(input_ids=probe, use_cache=False, output_hidden_states=True, logits_to_keep=1)
                ours = head(out.hidden_states[-1][:, -1:])
            if not torch.equal(ours, out.logits):
                return False
        return True

    def _chunked_loss(self, hidden, teacher_hidden, labels, weights=None) -> torch.Tensor:
        """hidden, teacher_hidden (N, d), labels (N,), weights (N,) or None -> the loss, its gradients taken
        chunk by chunk. Weighted, each term's sum is over weight x term and its mean divides by the weights' sum."""
        w, t, n = self.kl_weight, self.temperature, len(hidden)
        positions, predicted = n, int((labels != IGNORE).sum())  # what each term's mean divides by
        if weights is not None:
            positions, predicted = float(weights.sum()), float(weights[labels != IGNORE].sum())
        # the head's tensors as leaves of each chunk's own small graph
        head, trained = self.student_head.detached(), self.student_head.trained()
        leaves = head.trained()
        grads = [torch.zeros_like(hidden)] + [torch.zeros_like(x) for x in leaves]
        sums = torch.zeros(2, dtype=torch.float64, device=hidden.device)  # the KL's terms, the cross-entropy's
        step = plan.chunk_rows(head.weight.shape[0])  # positions a chunk
        for lo in range(0, n, step):
            rows = slice(lo, lo + step)
            chunk = hidden[rows].detach().requires_grad_()
            with torch.enable_grad():
                with self.autocast():
                    logits = head(chunk)  # (rows, V)
                kl, lm = self._chunk_sums(
                    logits, teacher_hidden[rows], labels[rows], None if weights is None else weights[rows]
                )
                # the plain loss's own arithmetic, so that backward scales each term as it did there
                found = torch.autograd.grad(w * (kl / positions * t**2) + (1 - w) * (lm / predicted), [chunk, *leaves])
            grads[0][rows] = found[0]
            for total, grad in zip(grads[1:], found[1:]):
                total += grad
            sums += torch.stack([kl.detach(), lm.detach()]).double()
        kl, lm = sums.float()
        # The plain loss's own arithmetic: (1 - w) * mean cross-entropy + w * (KL sum / positions * T^2).
        value = (1 - w) * (lm / predicted) + w * (kl / positions * t**2)
        return _WithGradients.apply(value, grads, hidden, *trained)

    def _chunk_sums(self, logits: torch.Tensor, teacher_hidden: torch.Tensor, labels: torch.Tensor, weights=None):
        """The sums of the KL's and the cross-entropy's terms over a chunk's positions (zero where weighted 0),
        each position's term times its weight when `weights` are given."""
        kl = lm = logits.new_zeros((), dtype=torch.float32)
        if self.kl_weight > 0:
            with torch.no_grad(), self.autocast():
                teacher_logits = self.teacher_head(teacher_hidden)
            if weights is None:
                kl = kl_divergence(teacher_logits, logits, self.temperature, reduction="sum")
            else:
                kl = (kl_divergence(teacher_logits, logits, self.temperature, reduction="none") * weights).sum()
        if self.kl_weight < 1:  # transformers' loss: float32 cross-entropy, the last position of a block ignored
            if weights is None:
                lm = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum")
            else:
                lm = (F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="none") * weights).sum()
        return kl, lm


class _WithGradients(torch.autograd.Function):
    """`value`, a function of `inputs` whose gradients were already taken: backward scales them by the incoming
    gradient (exact: a loss is linear in it)."""

    @staticmethod
    def forward(ctx, value, grads, *inputs):
        ctx.grads = grads
        return value.clone()

    @staticmethod
    def backward(ctx, grad_output):
        return None, None, *(grad * grad_output for grad in ctx.grads)
