"""What a conversion reads besides the weights, resolved once in `prepare` and carried by the plan: the
calibration input (its parts, their shares, the token count and the block length) and the blocks --refine
fits on. Torch-free: `--dry-run` prints it, `execute` and `refine` read it and never resolve or count again.

--calibration is written in the mix notation (corpus/mix.py): one text, its first `--calibration-tokens`
tokens; `parent`, text sampled from the model being converted (corpus/sampling.py); or parts with shares.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from mha2gqa.convert.options import DEFAULT_CALIBRATION_TOKENS, REFINE_TOKENS_PER_HIDDEN
from mha2gqa.corpus.mix import PARENT, parse_spec, part_tokens
from mha2gqa.errors import InputError

CALIBRATION_SEQ_LEN = 512  # tokens per calibration block, or the model's context when shorter
CALIBRATION_BATCH = 8  # blocks per calibration forward (calibration.collect_statistics)
HOLDOUT_FRACTION = 1 / 8  # of the refine blocks, held out to check each layer's fit
# The global stage checks the held-out KL every 10 steps, not 5: a check costs about two plain steps on a CPU
# (SmolLM2, 2 cores), and the best step was the last one on 14 of 15 SmolLM2 conversions checked every 5.
GLOBAL_HELDOUT_EVERY = 10
# refine's openings (refine/buffers.py opening_sequences): short sequences whose first tokens cover the vocabulary,
# fitted beside the blocks so that the child keeps the parent's first-position state (the attention sink) for
# whatever token a window opens with; OPENINGS_PER_STEP of them join every Adam step of both stages.
OPENING_LENGTH = 8
OPENING_SHARE = 1 / 8  # the openings' tokens, of the blocks'
OPENINGS_PER_STEP = 64


def opening_count(block_tokens: int) -> int:
    """How many openings refine fits beside `block_tokens` tokens of blocks (1,152 beside SmolLM2's 73,728)."""
    return max(16, round(block_tokens * OPENING_SHARE / OPENING_LENGTH))


def block_length(config: dict) -> int:
    """Tokens per calibration block: 512, or the model's context when shorter (calibration and refine)."""
    context = config.get("max_position_embeddings")
    return min(CALIBRATION_SEQ_LEN, context) if isinstance(context, int) and context > 0 else CALIBRATION_SEQ_LEN


def stats_bytes(hidden: int) -> int:
    """One layer's calibration statistics: the (hidden+1)^2 float64 second moments."""
    return (hidden + 1) ** 2 * 8


def layers_per_pass(memory_bytes: int, hidden: int) -> int:
    """How many layers' statistics one pass of the calibration tokens gathers within --calibration-memory."""
    return max(1, memory_bytes // stats_bytes(hidden))


@dataclass(frozen=True)
class CalibrationPart:
    """One source of calibration tokens: text (a resolved textdata.TextSource) or samples of the parent."""

    name: str  # as the user typed it: a path, 'austen', a hub dataset, 'parent'; several files joined by ', '
    entries: tuple[str, ...]  # what it reads ('austen' expanded to its files); () for the parent
    share: float  # of all the calibration tokens (1.0 for a single source)
    tokens: int  # how many tokens it gives
    text: object = None  # textdata.TextSource, resolved once; None for the parent's samples

    @property
    def sampled(self) -> bool:
        return self.text is None


@dataclass(frozen=True)
class CalibrationInput:
    """The calibration text of one conversion, checked and resolved once (prepare)."""

    spec: str | list[str]  # as the command line writes it back (the Reproduce line)
    parts: tuple[CalibrationPart, ...]
    tokens: int  # --calibration-tokens: all parts together
    seq_len: int  # tokens per block

    @property
    def mixed(self) -> bool:
        return len(self.parts) > 1

    @property
    def sampled_tokens(self) -> int:
        return sum(part.tokens for part in self.parts if part.sampled)

    def budgeted(self, tokens: int | None) -> CalibrationInput:
        """These resolved parts for `tokens` in all (None: as they are): what calibration_input(self.spec, tokens,
        ...) gives, without resolving the text again (a sweep resolves its calibration once for every plan)."""
        if tokens is None or tokens == self.tokens:
            return self
        pairs = parse_spec(self.spec)
        shares = [share for _, share in pairs] if pairs[0][1] is not None else [1.0]
        counts = part_tokens(shares, tokens, self.seq_len)
        parts = (replace(p, share=s / sum(shares), tokens=n) for p, s, n in zip(self.parts, shares, counts))
        return replace(self, parts=tuple(parts), tokens=tokens)


@dataclass(frozen=True)
class RefineBudget:
    """The calibration blocks --refine fits and checks on: the rule, and its counts for the planned tokens
    (the real counts follow the data, which may be shorter than --calibration-tokens)."""

    seq_len: int
    wanted_tokens: int  # --refine-tokens, or 128 x hidden
    blocks: int = 0  # planned, from --calibration-tokens
    fit_blocks: int = 0
    heldout_blocks: int = 0
    buffer_bytes: int = 0  # refine.BUFFERS x blocks x seq_len x hidden float32
    spills: bool = False  # buffer_bytes > RefineOptions.memory: memory-mapped files inside DST's partial folder

    def blocks_of(self, available: int) -> int:
        """How many of `available` calibration blocks --refine uses: all of them, or `wanted_tokens` worth
        spread evenly over them (at least 2)."""
        if self.wanted_tokens < available * self.seq_len:
            return min(available, max(2, self.wanted_tokens // self.seq_len))
        return available

    @staticmethod
    def heldout_of(blocks: int) -> int:
        return max(1, round(blocks * HOLDOUT_FRACTION))

    @property
    def openings(self) -> int:
        """The openings fitted beside the planned blocks (opening_count)."""
        return opening_count(self.blocks * self.seq_len)

    @property
    def opening_tokens(self) -> int:
        return self.openings * OPENING_LENGTH

    @property
    def opening_tokens_per_step(self) -> int:
        """The openings' tokens in each Adam step of either stage."""
        return min(OPENINGS_PER_STEP, self.openings - self.heldout_of(self.openings)) * OPENING_LENGTH

    @property
    def heldout_tokens(self) -> int:
        """The positions a held-out check of the global stage scores: the held-out blocks' and openings'."""
        return self.heldout_blocks * self.seq_len + self.heldout_of(self.openings) * OPENING_LENGTH

    def keeps_parent_targets(self, vocab: int, memory: int) -> bool:
        """Whether the global stage keeps the parent's held-out logits between checks (global_stage.ParentTargets):
        when they fit --refine-memory."""
        return heldout_targets_bytes(self.heldout_tokens, vocab) <= memory

    def kept_targets_bytes(self, vocab: int, memory: int) -> int:
        """The bytes the kept held-out logits take while the global stage runs: 0 when they are not kept."""
        return heldout_targets_bytes(self.heldout_tokens, vocab) if self.keeps_parent_targets(vocab, memory) else 0

    def global_heldout_forwards(self, steps: int, vocab: int, memory: int) -> int:
        """The token forwards of the held-out checks of a global stage of `steps` steps that runs to its end: both
        models at the first check, then the converted model alone where the parent's logits are kept."""
        later = self.global_heldout_evals(steps) - 1
        return self.heldout_tokens * (2 + later * (1 if self.keeps_parent_targets(vocab, memory) else 2))

    def global_heldout_evals(self, steps: int) -> int:
        """The held-out checks of a global stage of `steps` steps that runs to its end: the start's, one every
        GLOBAL_HELDOUT_EVERY steps and the last step's."""
        return 1 + steps // GLOBAL_HELDOUT_EVERY + (steps % GLOBAL_HELDOUT_EVERY > 0) if steps else 0


def heldout_targets_bytes(heldout_tokens: int, vocab: int) -> int:
    """What the global stage keeps of the parent between checks (refine/global_stage.ParentTargets): its
    float32 logits at every held-out position."""
    return heldout_tokens * vocab * 4


def default_tokens(pairs: list[tuple[str, float | None]], hidden: int) -> int:
    """--calibration-tokens when unset: 131,072 of a text; 128 x hidden when the parent's samples are part of
    it (a sampled token costs a forward of its own: the tokens refine fits on, not more)."""
    if any(name == PARENT for name, _ in pairs):
        return REFINE_TOKENS_PER_HIDDEN * hidden
    return DEFAULT_CALIBRATION_TOKENS


def calibration_input(
    spec, tokens: int | None, seq_len: int, hidden: int = 0, flag: str = "--calibration"
) -> CalibrationInput:
    """`spec` checked and resolved once: every file found and of a known format, holding some text, before
    anything is read in earnest; 'austen' expanded to the embedded novels. `tokens` None: default_tokens
    (which needs the model's `hidden` size)."""
    from mha2gqa.corpus import textdata
    from mha2gqa.embedded import expand_corpus_name

    pairs = parse_spec(spec, flag)
    if tokens is None:
        tokens = default_tokens(pairs, hidden)
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise InputError(f"--calibration-tokens {tokens} must be at least 1 (e.g. 131072)")
    shared = pairs[0][1] is not None
    if not shared and len(pairs) > 1 and any(name == PARENT for name, _ in pairs):
        raise InputError(
            f"{flag} {PARENT} samples the model, and cannot be read in order with other text: give every entry "
            f"a share, e.g. {flag} {PARENT}:0.5 {flag} {next(n for n, _ in pairs if n != PARENT)}:0.5"
        )
    groups = [[name] for name, _ in pairs] if shared or pairs[0][0] == PARENT else [[name for name, _ in pairs]]
    shares = [share for _, share in pairs] if shared else [1.0]
    counts = part_tokens(shares, tokens, seq_len)
    parts = []
    for names, share, count in zip(groups, shares, counts):
        name = ", ".join(names)
        if names == [PARENT]:
            parts.append(CalibrationPart(name, (), share / sum(shares), count))
            continue
        entries = tuple(str(p) for entry in names for p in _as_list(expand_corpus_name(entry, flag)))
        text = textdata.resolve(flag, list(entries))
        textdata.require_text(text)
        parts.append(CalibrationPart(name, entries, share / sum(shares), count, text))
    written = [f"{n}:{s:g}" for (n, s) in pairs] if shared else [n for n, _ in pairs]
    return CalibrationInput(written[0] if len(written) == 1 else written, tuple(parts), tokens, seq_len)


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]
