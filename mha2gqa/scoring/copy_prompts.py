"""Copy prompts from calibration ids: a span of the text planted early is asked for again at the end, so the
answer is a copy from far back in the context (what the retrieval probe asks, with no probe item and no text but
the calibration read). --kv-budget's layer losses score each layer's pooling on the answer tokens.

A prompt is `length` tokens: a haystack of consecutive calibration ids, then each of the spans taken from the
haystack at evenly spread depths repeated in turn. The first CUE tokens of a repeat are its question (as
" The secret word of KEY is" is eval's); the rest of the span is the answer, and those positions are scored.
Deterministic: no seed, the same ids give the same prompts.
"""

from __future__ import annotations

import torch

SPAN = 12  # tokens of a planted span: its cue, then its answer
CUE = 4  # tokens of the repeated span that ask for the rest (not scored)
MOST_SPANS = 8  # spans a prompt plants at most (fewer where the prompt is short: one per 4 x SPAN tokens)


def spans_in(length: int) -> int:
    """How many spans a prompt of `length` tokens plants (0: too short for one and its haystack)."""
    return min(MOST_SPANS, length // (4 * SPAN))


def copy_prompts(ids: torch.Tensor, length: int, most: int) -> tuple[torch.Tensor, torch.Tensor]:
    """At most `most` prompts of `length` tokens from the 1-D `ids` (consecutive pieces of it, one a prompt):
    (prompts (n, length), scored (n, length - 1)), scored[k, j] saying that position j's prediction (of token
    j + 1) is an answer token. n is 0 where `ids` holds no whole prompt's haystack or `length` no span."""
    spans = spans_in(length)
    haystack = length - spans * SPAN
    count = min(most, len(ids) // haystack) if spans else 0
    prompts = torch.empty(count, length, dtype=torch.long)
    scored = torch.zeros(count, length - 1, dtype=torch.bool)
    starts = [round(depth * (haystack - SPAN)) for depth in _depths(spans)]
    for k in range(count):
        text = ids[k * haystack : (k + 1) * haystack].long()
        prompts[k] = torch.cat([text, *(text[s : s + SPAN] for s in starts)])
        for n in range(spans):
            first_answer = haystack + n * SPAN + CUE
            scored[k, first_answer - 1 : haystack + (n + 1) * SPAN - 1] = True
    return prompts, scored


def _depths(spans: int) -> list[float]:
    """Evenly spread depths in the haystack, from near its start to near its end (0.05 .. 0.8)."""
    if spans == 1:
        return [0.05]
    return [0.05 + 0.75 * n / (spans - 1) for n in range(spans)]
