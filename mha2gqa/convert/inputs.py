"""What a conversion reads besides the weights, planned once in `prepare` and carried by the plan: the
calibration's block length and default token count (corpus/calibration.py resolves and reads the text itself),
the statistics' memory, and the blocks --refine fits on. Torch-free: `--dry-run` prints it, `execute` and
`refine` read it and never count again.
"""

from __future__ import annotations

from dataclasses import dataclass

from mha2gqa.convert.options import DEFAULT_CALIBRATION_TOKENS, REFINE_TOKENS_PER_HIDDEN

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


def default_tokens(hidden: int) -> tuple[int, int]:
    """--calibration-tokens when unset (corpus.calibration.resolve_calibration's `defaults`): 131,072 of a text;
    128 x hidden when the parent's samples are part of it (a sampled token costs a forward of its own: the tokens
    refine fits on, not more)."""
    return DEFAULT_CALIBRATION_TOKENS, REFINE_TOKENS_PER_HIDDEN * hidden
