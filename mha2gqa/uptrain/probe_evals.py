"""What an uptraining eval adds to held-out loss when the recipe asks (eval_retrieval, eval_domains), so that a
run writes its own recovery curve into metrics.jsonl:

- eval_retrieval: eval's retrieval probe at its defaults (scoring/retrieval_items.py: the questions of
  `eval --retrieval`, seed 0, lengths capped at the model's positions): `eval_recall`, `eval_answer_logprob`
  and the recall per length (`eval_recall_lengths`);
- eval_domains: perplexity on the first DOMAIN_TOKENS tokens of each domain of eval's probe set
  (corpus/probe.py), in seq_len blocks: `eval_domain_ppl`, and beside the teacher's
  `eval_geomean_ppl_ratio` (the geometric mean over the domains of the ratios, as eval's
  quality.geomean_perplexity_ratio).

The teacher's numbers are measured once, before the first step, and repeated on every line that has them
(`teacher_recall`, `teacher_domain_ppl`), so that each line reads alone.
"""

from __future__ import annotations

import gzip
import math

import torch

from mha2gqa.corpus.blocks import pack_all
from mha2gqa.corpus.probe import probe_paths
from mha2gqa.corpus.tokens import document_ids
from mha2gqa.scoring.retrieval import answer_scores
from mha2gqa.scoring.retrieval_items import build_items, probe_grid
from mha2gqa.uptrain.plan import DOMAIN_TOKENS  # eval's check reads the first 512 or 1,024: enough to see a break

PROBE_SEED = 0  # eval --retrieval's default --seed: the same questions as `mha2gqa eval --retrieval`


class ProbeEvals:
    """The probe questions and domain blocks of a run, built once; called with a model at each eval."""

    def __init__(self, retrieval: bool, domains: bool, tokenizer, seq_len: int, max_positions: int | None):
        grid = probe_grid(None, None, None, PROBE_SEED, max_positions) if retrieval else None
        self.items = build_items(tokenizer, grid) if grid else []
        self.lengths = grid.lengths if grid else ()
        self.domains = _domain_blocks(tokenizer, seq_len) if domains else {}
        self.reference: dict = {}

    def __bool__(self) -> bool:
        return bool(self.items or self.domains)

    @torch.no_grad()
    def measure(self, model, device) -> dict:
        """The numbers of `model`, with the teacher's beside them once `set_reference` ran."""
        found = {}
        training = model.training
        model.eval()
        if self.items:
            scores = answer_scores(model, self.items, device)
            found["eval_recall"] = _mean(hit for _, hit in scores)
            found["eval_answer_logprob"] = _mean(logprob for logprob, _ in scores)
            found["eval_recall_lengths"] = {
                str(n): _mean(hit for item, (_, hit) in zip(self.items, scores) if item.length == n)
                for n in self.lengths
            }
        if self.domains:
            found["eval_domain_ppl"] = {name: _perplexity(model, b, device) for name, b in self.domains.items()}
        model.train(training)
        if self.reference:
            found |= self.reference
            if self.domains:
                ratios = [found["eval_domain_ppl"][d] / self.reference["teacher_domain_ppl"][d] for d in self.domains]
                found["eval_geomean_ppl_ratio"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        return found

    def set_reference(self, teacher, device) -> None:
        """Measure the teacher once: its recall and domain perplexities go beside the model's on every line."""
        numbers = self.measure(teacher, device)
        self.reference = {f"teacher_{key[len('eval_') :]}": value for key, value in numbers.items()}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / max(1, len(values))


def _domain_blocks(tokenizer, seq_len: int) -> dict[str, torch.Tensor]:
    """{domain: its first DOMAIN_TOKENS tokens (at least one block) as (n, seq_len) int32 blocks}."""
    found = {}
    for name, path in probe_paths().items():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            text = f.read(DOMAIN_TOKENS * 16)  # enough characters for DOMAIN_TOKENS tokens of any tokenizer
        ids = document_ids([text], tokenizer)
        found[name] = pack_all(ids, tokenizer.eos_token_id, seq_len, limit=max(1, DOMAIN_TOKENS // seq_len))
    return found


def _perplexity(model, blocks: torch.Tensor, device) -> float:
    """exp of the mean next-token loss over `blocks`, one block a forward (the same in every recipe)."""
    losses = [model(input_ids=b[None].long().to(device), labels=b[None].long().to(device)).loss for b in blocks]
    return math.exp(float(torch.stack(losses).mean()))
