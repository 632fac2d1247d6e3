"""uptrain's `retrieval` source: prompts that can only be continued by copying from far back in the context.

A converted model loses retrieval (eval --retrieval: SmolLM2 3 -> 1, recall 0% against the parent's 47%) and
prose distillation rarely asks for it; synthetic retrieval fine-tuning brings such a skill back (Xiong et al.,
ICLR 2025: key-value retrieval, loss on the answer). Each block here packs one to four items (seq_len,
seq_len / 2 or seq_len / 4 tokens each, at least MIN_ITEM), each opened by EOS, of three tasks:

- needle: a window of the haystack with one to three facts (" The password for KEY is VALUE.") inserted at
  random depths, asked for at the end, each question followed by its answer;
- kv: a list of such facts with distinct keys, one to three of them asked at the end;
- copy: a window of the haystack, then a passage of it repeated: its first COPY_CUE tokens, then the
  next COPY_ANSWER tokens as the answer (a copy of what followed the cue).

The haystack is the other parts of data.train (the parent's samples, a text the recipe names): token ids,
windows of which are used as they are; keys and values are words of its decoded text. The templates are
none of eval's probe (scoring/retrieval_items.py asks " The secret word of KEY is"), and the draws come from
a generator seeded by a string of their own: a training item is never a question the probe asks. Every
answer token is marked, so that the loss can weigh the predictions of answers (distill.answer_weight).
The same haystack, tokenizer, count and seed give the same blocks and marks.
"""

from __future__ import annotations

import random
import re

import torch

from mha2gqa.corpus.tokens import document_ids
from mha2gqa.runtime.errors import InputError

TASKS = ("needle", "kv", "copy")
# (words before the key, words between the key and the value): never the probe's " The secret word of ... is"
TEMPLATES = (
    (" The password for", " is"),
    (" Remember that the code of", " is"),
    (" The key to", " is written as"),
    (" Note: the label of", " reads"),
    (" In the ledger, the entry", " says"),
    (" The name given to", " was"),
    (" Keep in mind that", " stands for"),
    (" The hidden value of", " equals"),
)
MIN_ITEM = 64  # room for a haystack, a fact or two and their questions
COPY_CUE, COPY_ANSWER = 8, 8  # tokens of a repeated passage: the cue, then the copy asked for
MIN_WORDS = 16  # distinct words the haystack must hold for keys and values
_WORD = re.compile(r"\b[a-z]{4,10}\b")
SEED_WORDS = "mha2gqa uptrain retrieval"  # the generator's seed string: apart from the probe's integer seeds


def retrieval_blocks(
    haystack: torch.Tensor, tokenizer, count: int, seq_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, seq_len) int32 ids and their (count, seq_len) bool answer marks, built from `haystack`
    ((n, L) ids, L >= seq_len / 4 for the shortest item) with the generator of `seed`."""
    ids = torch.zeros(count, seq_len, dtype=torch.int32)
    marks = torch.zeros(count, seq_len, dtype=torch.bool)
    if count == 0:
        return ids, marks
    maker = _Maker(haystack, tokenizer, seq_len, seed)
    for row in range(count):
        at = 0
        for length in maker.layout():
            tokens, answer = maker.item(length)
            ids[row, at : at + length] = torch.tensor(tokens, dtype=torch.int32)
            marks[row, at : at + length] = torch.tensor(answer, dtype=torch.bool)
            at += length
    return ids, marks


class _Maker:
    """The generator's state: the haystack's rows, its words, the tokenizer's pieces, one random.Random."""

    def __init__(self, haystack: torch.Tensor, tokenizer, seq_len: int, seed: int):
        if seq_len < MIN_ITEM:
            raise InputError(f"data.train retrieval needs seq_len of at least {MIN_ITEM} tokens (got {seq_len})")
        if tokenizer.eos_token_id is None:
            raise InputError("data.train retrieval opens each item with EOS: the tokenizer has none")
        if not len(haystack) or haystack.shape[1] < min(self._lengths(seq_len)):
            raise InputError("data.train retrieval needs a haystack: give another part a share, e.g. parent:0.75")
        self.rows = [row.tolist() for row in haystack]
        self.words = sorted(set(_WORD.findall(" ".join(tokenizer.batch_decode(self.rows[:256])))))
        if len(self.words) < MIN_WORDS:
            raise InputError(
                f"data.train retrieval: the other parts' text holds {len(self.words)} distinct words, fewer than "
                f"{MIN_WORDS} for its keys and values: give it a part with more text"
            )
        self.tokenizer, self.seq_len, self.eos = tokenizer, seq_len, tokenizer.eos_token_id
        self.rng = random.Random(f"{SEED_WORDS} {seed}")
        self._pieces: dict[str, list[int]] = {}

    @staticmethod
    def _lengths(seq_len: int) -> list[int]:
        return [n for n in (seq_len, seq_len // 2, seq_len // 4) if n >= MIN_ITEM] or [seq_len]

    def layout(self) -> list[int]:
        """One block's item lengths: one item, two halves or four quarters (the remainder to the last)."""
        size = self.rng.choice(self._lengths(self.seq_len))
        parts = [size] * (self.seq_len // size)
        parts[-1] += self.seq_len - sum(parts)
        return parts

    def item(self, length: int) -> tuple[list[int], list[bool]]:
        """One item of `length` tokens: EOS, the context, the questions each with its answer."""
        task = self.rng.choice(TASKS)
        if task == "copy":
            return self._copy(length)
        template = self.rng.choice(TEMPLATES)
        keys = iter(self.rng.sample(self.words, len(self.words)))
        questions = [self._fact(template, next(keys)) for _ in range(self.rng.randint(1, 3))]
        room = length - 1 - sum(len(q) + len(a) for q, a in questions)
        sentences = [q + a + self._piece(".") for q, a in questions]
        if task == "kv":  # other keys' facts fill the context, as many as fit
            for key in keys:
                other = self._fact(template, key)
                sentence = other[0] + other[1] + self._piece(".")
                if sum(map(len, sentences)) + len(sentence) > room:
                    break
                sentences.append(sentence)
        filler = room - sum(map(len, sentences))
        if filler < (0 if task == "kv" else 8):  # no room for a haystack around the facts
            return self._copy(length)
        context = self._context(task, sentences, filler)
        tokens, answer = [self.eos] + context, [False] * (1 + len(context))
        for question, value in self.rng.sample(questions, len(questions)):
            tokens += question + value
            answer += [False] * len(question) + [True] * len(value)
        return tokens, answer

    def _context(self, task: str, sentences: list[list[int]], filler: int) -> list[int]:
        """A haystack window of `filler` tokens with the sentences inserted at random depths (needle), or
        before the sentences in a random order (kv)."""
        window = self._window(filler)
        if task == "kv":
            return window + [i for s in self.rng.sample(sentences, len(sentences)) for i in s]
        at = sorted(self.rng.randint(0, filler) for _ in sentences)
        for where, sentence in zip(reversed(at), sentences):  # from the back: earlier places stay where they are
            window[where:where] = sentence
        return window

    def _copy(self, length: int) -> tuple[list[int], list[bool]]:
        """A window, then the cue of a passage of it and that passage's next COPY_ANSWER tokens."""
        room = length - 1 - COPY_CUE - COPY_ANSWER
        window = self._window(room)
        start = self.rng.randint(0, max(0, room - COPY_CUE - COPY_ANSWER))
        passage = window[start : start + COPY_CUE + COPY_ANSWER]
        tokens = [self.eos] + window + passage
        return tokens, [False] * (1 + room + COPY_CUE) + [True] * COPY_ANSWER

    def _window(self, size: int) -> list[int]:
        """`size` consecutive haystack ids from a random row and start (rows are at least an item long)."""
        row = self.rng.choice(self.rows)
        start = self.rng.randint(0, len(row) - size) if size <= len(row) else 0
        return (row * (1 + size // len(row)))[start : start + size]

    def _fact(self, template: tuple[str, str], key: str) -> tuple[list[int], list[int]]:
        """(question ids, answer ids) of one fact: the pieces tokenized apart, so the answer is a copy."""
        value = self.rng.choice(self.words)
        question = self._piece(template[0]) + self._piece(f" {key}") + self._piece(template[1])
        return question, self._piece(f" {value}")

    def _piece(self, text: str) -> list[int]:
        if text not in self._pieces:
            self._pieces[text] = list(next(document_ids([text], self.tokenizer, batch=1)))
        return self._pieces[text]
