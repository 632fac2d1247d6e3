"""Scoring a model on token ids: perplexity over windows and agreement with a reference (top-1, KL through
kl.py). One scorer for `eval` and for convert's end-of-run check, so both say the same numbers under the same
names; it sits below both (the README's layers), and imports nothing of either."""
