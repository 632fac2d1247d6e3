"""Models for the retrieval probe's tests: one that retrieves by construction, and the same with its reach cut
or its attention made uniform (the probe must tell them apart)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


class CopyModel(torch.nn.Module):
    """The circuit retrieval heads implement, written out: each position attends to the earlier positions whose
    preceding tokens match its own last `span` tokens (an induction head over several tokens), the longer the
    match the more, and predicts the token it finds there.

    window: only positions at most this far back are seen (a model whose reach is short); uniform: every earlier
    position gets the same weight (attention broken: it still sees the context, but cannot pick the fact)."""

    def __init__(self, vocab: int, span: int = 8, window: int | None = None, uniform: bool = False):
        super().__init__()
        self.vocab, self.span, self.window, self.uniform = vocab, span, window, uniform
        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=1 << 16)

    def forward(self, input_ids, logits_to_keep: int = 0, **_):
        ids = input_ids[0]
        length = ids.numel()
        rows = torch.arange(length - (logits_to_keep or length), length)  # the positions whose logits are asked
        sources = torch.arange(1, length)  # position j copies ids[j], matched on what precedes it
        match = torch.zeros(len(rows), len(sources))
        alive = torch.ones(len(rows), len(sources), dtype=torch.bool)
        for back in range(self.span):  # the run of equal tokens ending at row - back and at j - 1 - back
            r, s = rows - back, sources - 1 - back
            ok = (r[:, None] >= 0) & (s[None, :] >= 0)
            same = ids[r.clamp(min=0)][:, None] == ids[s.clamp(min=0)][None, :]
            alive &= ok & same
            match += alive.float()
        seen = sources[None, :] <= rows[:, None]
        if self.window is not None:
            seen &= rows[:, None] - sources[None, :] < self.window
        scores = torch.zeros_like(match) if self.uniform else 50.0 * match
        weights = scores.masked_fill(~seen, float("-inf")).softmax(-1).nan_to_num(0.0)
        probs = torch.zeros(len(rows), self.vocab).index_add_(1, ids[sources], weights)
        logits = (probs + 1e-6).log()
        return SimpleNamespace(logits=logits[None])
