"""The bounds of every count a user types, one table for every command, checked before any work starts (each
option schema's validation calls validate_limits). The most is where a value stops meaning more of a measurement and
starts meaning hours of work, or memory that grows with it; docs/guarantees.md lists them. tests/test_limits.py
holds every integer option of every command to an entry here. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from mha2gqa.runtime.errors import InputError


@dataclass(frozen=True)
class Bound:
    least: int
    most: int
    why: str  # why no more: said in the refusal
    least_why: str = ""  # why no less, where it is not plain


SEED = Bound(0, 2**32 - 1, "the range numpy's and torch's generators both take")
TOKENS = Bound(
    1,
    2**24,
    "16,777,216 tokens: 128 times the default, hours of forwards for a 135M model on a CPU",
    "a stage that reads calibration text needs tokens: leave the flag out for its default",
)
CONTEXT = Bound(1, 2**20, "1,048,576 tokens, longer than any model's context")
STEPS = Bound(0, 100_000, "a refit is tens of steps; 100,000 is days on a CPU")
BATCH = Bound(1, 1024, "more sequences at once than any GPU holds for these measurements")
HEADS = Bound(1, 65_536, "more kv heads than any model has; the count must also divide SRC's")
REQUESTS = Bound(1, 1024, "the benchmark's client holds a connection and a thread per request in flight")


def training_steps(least: int) -> Bound:
    """A recipe's count of optimizer steps (a period, a warm-up, a cap): at most 2**31."""
    return Bound(least, 2**31, "2,147,483,648 steps")


BOUNDS: dict[str, dict[str, Bound]] = {
    "convert": {
        "--groups": HEADS,
        "--seed": SEED,
        "--calibration-tokens": TOKENS,
        "--refine-steps": STEPS,
        "--refine-tokens": TOKENS,
        "--refine-global-steps": STEPS,
        "--refine-batch-blocks": BATCH,
        "--refine-seed": SEED,
    },
    "inspect": {"--context": Bound(1, 2**24, "16,777,216 tokens"), "--batch": Bound(1, 2**20, "1,048,576 sequences")},
    "eval": {
        "--max-tokens": Bound(2, 2**30, "1,073,741,824 tokens of a domain; 'all' reads every one"),
        "--context": CONTEXT,
        "--stride": CONTEXT,
        "--batch-size": BATCH,
        "--new-tokens": Bound(1, 65_536, "65,536 tokens decoded per speed point"),
        "--repeats": Bound(1, 1000, "1,000 timed repeats per speed point"),
        "--kv-batch": BATCH,
        "--kv-tokens": CONTEXT,
        "--attention-layer": Bound(-65_536, 65_535, "more layers than any model has"),
        "--lm-eval-limit": Bound(1, 1_000_000, "more examples than any lm-eval task has"),
        "--retrieval-samples": Bound(1, 1000, "1,000 questions per task, length and depth: each is a forward"),
        "--seed": SEED,
        "--speed-batches": BATCH,
        "--speed-contexts": CONTEXT,
        "--retrieval-lengths": Bound(1, 2**20, "1,048,576 tokens, longer than any model's context"),
    },
    "demo": {"--groups": HEADS},
    "reproduce": {"--eval-blocks": Bound(1, 10_000, "10,000 blocks of 512 tokens"), "--kv-heads": HEADS},
    "sweep": {
        "--max-tokens": Bound(2, 2**30, "1,073,741,824 tokens of a domain; 'all' reads every one"),
        "--calibration-tokens": TOKENS,
        "--seed": SEED,
        "--groups": HEADS,
    },
    "serve-bench": {
        "--context": Bound(2, 2**20, "1,048,576 tokens, longer than any model's context"),
        "--greedy-tokens": Bound(1, 4096, "4,096 tokens of greedy text compared per prompt"),
        "--prompts-per-domain": Bound(1, 64, "64 prompts per probe domain: the domain's text is cut into them"),
        "--prompt-tokens": CONTEXT,
        "--output-tokens": Bound(2, 2**20, "1,048,576 tokens, longer than any model's context"),
        "--decode-concurrency": Bound(0, 1024, REQUESTS.why),
        "--concurrency": REQUESTS,
        "--capacity-concurrency": Bound(0, 1024, REQUESTS.why),
        "--waves": Bound(1, 100, "100 waves of requests per timed point"),
        "--repeats": Bound(1, 100, "100 timed runs per model and point"),
    },
    # a recipe's integer keys (uptrain --recipe, or key=value); their least is recipe_load's rule, in its words
    "uptrain": {
        "seed": SEED,
        "seq_len": Bound(2, 2**20, "1,048,576 tokens, longer than any model's context"),
        "micro_batch_size": Bound(1, 4096, "4,096 blocks a step: activations grow with it"),
        "grad_accum": Bound(1, 65_536, "65,536 micro-batches an optimizer step"),
        "log_every": training_steps(1),
        "eval_every": training_steps(0),
        "save_every": training_steps(0),
        "keep_last": Bound(1, 1000, "1,000 checkpoints on disk"),
        "exit_after_steps": training_steps(1),
        "data.eval_blocks": Bound(1, 100_000, "100,000 held-out blocks, each kept in memory"),
        "data.shuffle_buffer": Bound(1, 1_000_000, "1,000,000 documents held in memory to shuffle"),
        "optim.warmup_steps": training_steps(0),
        "budget.max_steps": training_steps(1),
        "budget.tokens": Bound(1, 10**15, "a quadrillion tokens, beyond any pretraining"),
        "budget.pretrain_tokens": Bound(1, 10**15, "a quadrillion tokens, beyond any pretraining"),
        "lora.rank": Bound(1, 65_536, "wider than any model's hidden size"),
    },
}


def count_problems(command: str, values: dict, joiner: str = " ", least: bool = True) -> list[str]:
    """Each count outside its bound, in words naming the flag ({flag: value, a list of values, or None for
    unset}); `joiner` "=" for a recipe's keys; `least` False where the caller's own rules word the least. A flag
    with no entry under `command` is a programming error (KeyError): every count has one."""
    found = []
    for flag, value in values.items():
        bound = BOUNDS[command][flag]
        for one in value if isinstance(value, (list, tuple)) else (value,):
            if one is None:
                continue
            if not isinstance(one, int) or isinstance(one, bool):
                found.append(f"{flag}{joiner}{one!r} must be a whole number")
            elif one < bound.least and least:
                why = f" ({bound.least_why})" if bound.least_why else ""
                found.append(f"{flag}{joiner}{one} must be at least {bound.least}{why}")
            elif one > bound.most:
                found.append(f"{flag}{joiner}{one:,} must be at most {bound.most:,} ({bound.why})")
    return found


def validate_limits(command: str, values: dict) -> None:
    """Refuse, in one line naming the flag, the first count outside its bound (count_problems)."""
    found = count_problems(command, values)
    if found:
        raise InputError(found[0])
