"""Build the offline lm-eval task data from the held-out novel (Persuasion), deterministically.

    python scripts/make_lmeval_tasks.py            # rewrites mha2gqa/eval/tasks/*.jsonl
    python scripts/make_lmeval_tasks.py --check    # exit 1 if the shipped files differ

Two tasks (their YAMLs sit beside the data in mha2gqa/eval/tasks/):
  persuasion_cloze          LAMBADA-style: a passage of whole sentences (30-120 words) whose final
                            word must be predicted; passages do not overlap. As a stand-in for LAMBADA's human filtering (a word that
                            is guessable from the passage but not from its last sentence alone),
                            the final word must appear earlier in the passage.
  persuasion_next_sentence  Three consecutive sentences, then the true next sentence among four
                            choices; the three distractors are sentences of similar length drawn
                            from at least 2,000 words away in the novel.
Persuasion was never seen by the embedded model or its tokenizer. Same code, same bytes: the
random choices come from one seeded generator and the files are written with sorted keys.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import sys
from pathlib import Path

from mha2gqa.files import embedded

TASKS_DIR = Path(__file__).resolve().parents[1] / "mha2gqa" / "eval" / "tasks"
SEED = 1818  # Persuasion's year of publication
CLOZE_EXAMPLES = 500
NEXT_SENTENCE_EXAMPLES = 500
CHOICES = 4
_WORD = re.compile(r"^[A-Za-z]{3,}$")
# A sentence ends at . ! or ? (optionally closed by a quote) before whitespace and a capital or quote.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"']))\s+(?=[\"A-Z])")
_PUNCT = ".,;:!?\"'-"


def sentences(text: str) -> list[tuple[int, int]]:
    """(start, end) character spans of the novel's sentences, in reading order. The text keeps its
    line wrapping: the model was trained on wrapped lines, and unwrapped passages would test how
    it copes with 90-word lines rather than how well it reads. Title and chapter headings (no full
    stop: they run into the next sentence) are dropped."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        spans.append((start, match.start()))
        start = match.end()
    spans.append((start, len(text.rstrip())))
    return [(a, b) for a, b in spans if not re.search(r"Chapter \d+|\n\s*\n\s*\n", text[a:b])]


def cloze_examples(text: str, sents: list[tuple[int, int]], rng: random.Random, count: int) -> list[dict]:
    """Non-overlapping runs of whole sentences (30-120 words) whose final word, after a space, is the
    target; the closing punctuation is dropped, as in LAMBADA."""
    candidates, first = [], 0
    for i, (_, end) in enumerate(sents):
        while len(text[sents[first][0] : end].split()) > 120 and first < i:
            first += 1
        passage = text[sents[first][0] : end].rstrip(_PUNCT)
        context, _, last = passage.rpartition(" ")
        words = context.split()
        if len(words) >= 29 and _WORD.match(last) and last.lower() in {w.strip(_PUNCT).lower() for w in words}:
            candidates.append({"text": passage})
            first = i + 1
    picked = sorted(rng.sample(range(len(candidates)), min(count, len(candidates))))
    return [candidates[i] for i in picked]


def next_sentence_examples(text: str, spans: list[tuple[int, int]], rng: random.Random, count: int) -> list[dict]:
    """Three sentences of context (consecutive in the novel), the fourth among distractors."""
    words = list(itertools.accumulate(len(text[a:b].split()) for a, b in spans))  # word offset of each end
    sents = [(offset, text[a:b]) for offset, (a, b) in zip(words, spans)]
    usable = [
        i
        for i in range(3, len(sents))
        if 6 <= len(sents[i][1].split()) <= 40 and "Chapter" not in text[spans[i - 3][0] : spans[i][1]]
    ]  # not across a chapter heading
    examples = []
    for i in sorted(rng.sample(usable, min(count, len(usable)))):
        offset, answer = sents[i]
        size = len(answer.split())
        pool = [s for o, s in sents if abs(o - offset) >= 2000 and 0.67 * size <= len(s.split()) <= 1.5 * size]
        choices = rng.sample(pool, CHOICES - 1)
        gold = rng.randrange(CHOICES)
        choices.insert(gold, answer)
        context = text[spans[i - 3][0] : spans[i - 1][1]]
        examples.append({"context": context, "choices": choices, "gold": gold})
    return examples


def build() -> dict[str, str]:
    """{file name: jsonl text} of every task's data."""
    rng = random.Random(SEED)
    text = embedded.read_novel(embedded.HELDOUT_NOVEL)
    spans = sentences(text)
    data = {
        "persuasion_cloze.jsonl": cloze_examples(text, spans, rng, CLOZE_EXAMPLES),
        "persuasion_next_sentence.jsonl": next_sentence_examples(text, spans, rng, NEXT_SENTENCE_EXAMPLES),
    }
    return {name: "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows) for name, rows in data.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the shipped files instead of writing")
    parser.add_argument("--out", type=Path, default=TASKS_DIR, help="where the .jsonl files go")
    args = parser.parse_args(argv)
    stale = []
    for name, text in build().items():
        path = args.out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
            continue
        path.write_text(text)
        print(f"wrote {path}: {text.count(chr(10))} examples, {len(text.encode()):,} bytes")
    if stale:
        print(f"differ from what this script makes: {', '.join(stale)} (re-run without --check)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
