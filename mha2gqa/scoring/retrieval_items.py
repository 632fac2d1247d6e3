"""The retrieval probe's prompts: a fact stated once, far back in a long context, asked for at its end.

Two tasks, each at every (length, depth) of the grid and `samples` times, all drawn from one seed:

- needle: prose of the probe set (Persuasion, mha2gqa/data/probe/prose.txt.gz) with one sentence
  " The secret word of KEY is VALUE." inserted at `depth` (0: the start, 1: just before the question), after
  the nearest clause when one is near;
- kv: a list of such sentences, each with its own KEY and VALUE, the asked one at `depth`: the model must
  find the one key among many that look alike.

The prompt ends with the sentence's own start, " The secret word of KEY is", and the answer is VALUE: KEY and
VALUE are words of the prose drawn at random, so nothing in the context but the needle predicts the answer.
The pieces are tokenized apart and joined as ids, so the needle holds the question's ids followed by the
answer's: the answer is a copy, for any tokenizer. `length` is the tokens forwarded: prompt and answer together, at most the model's positions.

Torch-free: the options' checks and the estimate read this module before torch is imported.
"""

from __future__ import annotations

import gzip
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from mha2gqa.corpus.probe import probe_paths
from mha2gqa.corpus.tokens import document_ids
from mha2gqa.runtime.errors import InputError

TASKS = ("needle", "kv")
DEFAULT_LENGTHS = (128, 512, 2048)  # capped at the model's max_position_embeddings (which is added when smaller)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_SAMPLES = 2  # 12 questions a length (eval/options.py says so in --retrieval-samples' help)
MIN_LENGTH = 64  # room for a question, its needle and some haystack
# The retrieval heads' scores hold every layer's attention maps of a question (retrieval_heads.py): at most this
# long. SmolLM2-135M: 30 layers x 9 heads x 512^2 x 4 bytes = 283 MiB of maps a question.
HEADS_MAX_LENGTH = 512
_CLAUSE_ENDS = (".", "!", "?", ";", ",")  # a needle goes after one of these when one is near its depth
_WORD = re.compile(r"\b[a-z]{4,10}\b")


@dataclass(frozen=True)
class ProbeGrid:
    """What the probe asks: every task at every length and depth, `samples` times, drawn from `seed`."""

    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    samples: int
    seed: int

    def forward_tokens(self) -> int:
        """Tokens one model forwards over the whole probe (the estimate's work)."""
        return len(TASKS) * len(self.depths) * self.samples * sum(self.lengths)

    def tokens_up_to(self, longest: int) -> int:
        """Tokens of the questions of at most `longest` tokens (those whose heads are scored)."""
        return len(TASKS) * len(self.depths) * self.samples * sum(n for n in self.lengths if n <= longest)


@dataclass(frozen=True)
class Item:
    """One question: the prompt's ids, the answer's ids, and where it sits in the grid."""

    task: str
    length: int
    depth: float
    prompt: tuple[int, ...]
    answer: tuple[int, ...]
    source: int = -1
    """Index in the prompt of the fact's own first answer token: where a head that copies it looks."""


def validate_values(lengths: Sequence[int] | None, depths: Sequence[float] | None, samples: int | None) -> None:
    """The flags' values on their own, before the model's config is read."""
    for flag, value, example in (
        ("--retrieval-lengths", lengths, "128,512"),
        ("--retrieval-depths", depths, "0.1,0.5,0.9"),
    ):
        if value is not None and not len(value):
            raise InputError(f"{flag} names no value: give a comma-separated list (e.g. {flag} {example}), or drop it")
    for n in lengths or ():
        if n < MIN_LENGTH:
            raise InputError(f"--retrieval-lengths {n} must be at least {MIN_LENGTH} tokens (e.g. 128,512)")
    for d in depths or ():
        if not 0.0 <= d <= 1.0:
            raise InputError(
                f"--retrieval-depths {d} must be between 0 and 1 (0: the start, 1: the end), e.g. 0.1,0.5,0.9"
            )
    if samples is not None and samples < 1:
        raise InputError(f"--retrieval-samples {samples} must be at least 1")


def probe_grid(lengths, depths, samples, seed: int, max_positions: int | None) -> ProbeGrid:
    """The grid for a model with `max_positions`: the lengths asked (each must fit), or the defaults that fit
    plus max_positions itself when it is below the largest default."""
    validate_values(lengths, depths, samples)
    if lengths:
        too_long = [n for n in lengths if max_positions and n > max_positions]
        if too_long:
            raise InputError(
                f"--retrieval-lengths {too_long[0]} exceeds the model's max_position_embeddings={max_positions}: "
                f"use at most {max_positions}"
            )
        found = tuple(sorted(set(lengths)))
    else:
        cap = max_positions or max(DEFAULT_LENGTHS)
        if cap < MIN_LENGTH:
            raise InputError(
                f"--retrieval: the model's max_position_embeddings={cap} is below the probe's shortest context, "
                f"{MIN_LENGTH} tokens: drop --retrieval"
            )
        found = tuple(n for n in DEFAULT_LENGTHS if n <= cap)
        found += (cap,) if cap < max(DEFAULT_LENGTHS) and cap not in found else ()
    return ProbeGrid(found, tuple(sorted(set(depths or DEFAULT_DEPTHS))), samples or DEFAULT_SAMPLES, seed)


def filler_text() -> str:
    """The haystack's prose: the probe set's Persuasion, its whitespace made single spaces."""
    with gzip.open(probe_paths()["prose"], "rt", encoding="utf-8") as f:
        return " ".join(f.read().split())


def build_items(tokenizer, grid: ProbeGrid, text: str | None = None) -> list[Item]:
    """Every question of the grid, the same ids for the same tokenizer, grid and text."""
    text = filler_text() if text is None else text
    prose = _encode(tokenizer, text)
    ends = _clause_ends(tokenizer, prose)
    words = sorted(set(_WORD.findall(text)))
    if len(words) < 2:  # a key and its value, at least
        raise InputError("the retrieval probe's haystack holds fewer than 2 distinct words: give it a longer text")
    rng = random.Random(grid.seed)
    items = []
    for task in TASKS:
        for length in grid.lengths:
            for depth in grid.depths:
                for _ in range(grid.samples):
                    keys = rng.sample(words, min(len(words), length // 4 + 1))
                    fact = _Fact(tokenizer, keys[0], _value(rng, words))
                    room = _room(length, fact)
                    if task == "needle":
                        hay, starts = _prose_window(prose, ends, room, rng)
                    else:
                        hay, starts = _fact_list(tokenizer, keys[1:], words, room, rng)
                    at = _place(starts, depth, len(hay))
                    prompt = hay[:at] + fact.sentence + hay[at:] + fact.question
                    source = at + len(fact.question)
                    items.append(Item(task, length, depth, tuple(prompt), tuple(fact.answer), source))
    return items


def _place(starts: list[int], depth: float, size: int) -> int:
    """Where the needle goes in `size` tokens of haystack: the clause start nearest to `depth`, when one is within
    a 32nd of the haystack (at least 8 tokens); else exactly there (Austen's sentences run long)."""
    target = round(depth * size)
    nearest = min(starts, key=lambda s: abs(s - target))
    return nearest if abs(nearest - target) <= max(8, size // 32) else target


def _room(length: int, fact) -> int:
    """Haystack tokens left at `length` beside the needle, the question and the answer."""
    room = length - len(fact.question) - len(fact.answer) - len(fact.sentence)
    if room < 0:
        raise InputError(
            f"--retrieval-lengths {length} is too short for this tokenizer: its needle, question and answer take "
            f"{length - room} tokens; use at least {2 * (length - room)}"
        )
    return room


def _value(rng, words: list[str]) -> str:
    return rng.choice(words)


class _Fact:
    """A key's sentence as ids: question (" The secret word of KEY is"), answer (" VALUE"), then "."."""

    def __init__(self, tokenizer, key: str, value: str):
        self.question = _encode(tokenizer, " The secret word of") + _encode(tokenizer, f" {key}")
        self.question += _encode(tokenizer, " is")
        self.answer = _encode(tokenizer, f" {value}")
        self.sentence = self.question + self.answer + _encode(tokenizer, ".")


def _encode(tokenizer, text: str) -> list[int]:
    return list(next(document_ids([text], tokenizer, batch=1)))  # no special tokens: pieces are joined as ids


def _clause_ends(tokenizer, ids: list[int]) -> list[bool]:
    """Whether each token ends a clause (its text ends with . ! ? ; or ,)."""
    found = {i: tokenizer.decode([i]).rstrip().endswith(_CLAUSE_ENDS) for i in set(ids)}
    return [found[i] for i in ids]


def _prose_window(prose: list[int], ends: list[bool], size: int, rng) -> tuple[list[int], list[int]]:
    """`size` tokens of prose from a random start (the text repeated when shorter), and the positions in it
    where a clause starts (0 and the end as well: a needle can go first or last)."""
    while len(prose) < size + 1:
        prose, ends = prose + prose, ends + ends
    start = rng.randrange(len(prose) - size + 1)
    window = prose[start : start + size]
    starts = [0] + [i + 1 for i in range(size) if ends[start + i]]
    return window, sorted(set(starts + [size]))


def _fact_list(tokenizer, keys: list[str], words: list[str], size: int, rng) -> tuple[list[int], list[int]]:
    """`size` tokens of other keys' sentences (the first one cut at its start to fit), and where each starts."""
    sentences, total = [], 0
    for key in keys * (1 + size // max(1, len(keys))):
        if total >= size:
            break
        sentence = _Fact(tokenizer, key, _value(rng, words)).sentence
        sentences.append(sentence)
        total += len(sentence)
    ids = [i for s in sentences for i in s][total - size :] if total >= size else [i for s in sentences for i in s]
    starts, at = [], len(ids)
    for sentence in reversed(sentences):
        starts.append(max(0, at))
        at -= len(sentence)
    return ids, sorted(set(starts + [0]))
