"""Token-id prompts cut from the probe set (prose, code, Python docs, licences), tokenized once with the
parent's tokenizer: the engine and transformers are given the same ids, so a difference in their greedy text is
the engine's, never the tokenizer's.
"""

from __future__ import annotations

import gzip

from mha2gqa.corpus.probe import probe_paths
from mha2gqa.runtime.errors import InputError


def probe_ids(tokenizer) -> dict[str, list[int]]:
    """{domain: the token ids of its whole probe text}, no special tokens added (and no warning that a text is
    longer than the model's context: it is cut into prompts)."""
    found = {}
    for domain, path in probe_paths().items():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            found[domain] = tokenizer(f.read(), add_special_tokens=False, verbose=False)["input_ids"]
    return found


def greedy_prompts(ids: dict[str, list[int]], per_domain: int, length: int) -> list[tuple[str, list[int]]]:
    """(domain, prompt) pairs: `per_domain` windows of `length` tokens from each domain, evenly spaced."""
    prompts = []
    for domain, stream in ids.items():
        spacing = (len(stream) - length) // per_domain
        if spacing < 1:
            raise InputError(
                f"--prompt-tokens {length}: the probe text {domain!r} holds {len(stream)} tokens, too few for "
                f"{per_domain} prompts of {length}: choose a shorter prompt"
            )
        prompts += [(domain, stream[i * spacing : i * spacing + length]) for i in range(per_domain)]
    return prompts


def load_prompts(ids: dict[str, list[int]], count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of `length` tokens for timing, each starting at its own place in the probe text
    (all domains end to end, read round again when `count` windows need more): no two share a first token's
    position, so no prompt is a prefix of another."""
    stream = [t for domain in ids.values() for t in domain]
    if len(stream) < length + count:
        raise InputError(
            f"--prompt-tokens {length}: the probe set holds {len(stream)} tokens, too few for {count} prompts "
            f"of {length}: choose a shorter prompt or fewer requests"
        )
    step = max(1, len(stream) // count)
    starts = [(i * step) % len(stream) for i in range(count)]
    doubled = stream + stream[:length]
    return [doubled[s : s + length] for s in starts]
