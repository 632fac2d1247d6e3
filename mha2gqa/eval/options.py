"""What `evaluate` is asked to measure: a typed schema, one docstring per field, importable without torch.

`mha2gqa.evaluate(model, data, reference, **fields)` builds an EvalOptions from its keywords; the
`mha2gqa eval` command builds one from its flags. Values are checked by `check()` and each
measurement's own check (eval/measurements.py) before any model is loaded, with the flag named in each message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mha2gqa.corpus.probe import PROBE, parse_domains
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.typed import StrEnum, validate_keywords

if TYPE_CHECKING:  # importing it imports torch; this module stays torch-free
    from mha2gqa.eval.reference_tops import TopReference

DEFAULT_MAX_TOKENS = 4096  # a domain's tokens scored by default (docs/eval.md, "Cost")


class SpeedPreset(StrEnum):
    """The decode-speed grid (eval/speed.py PRESETS); str() and format() are the value."""

    AUTO = "auto"
    """gpu on CUDA, else cpu."""
    CPU = "cpu"
    """batches 1,4 x context 32, 16 new tokens: seconds."""
    GPU = "gpu"
    """batches 1,8,32,64 x contexts 512,2048, 64 new tokens."""
    OFF = "off"
    """no decode-speed measurement (in Python None and False mean the same)."""


class DecodePath(StrEnum):
    """The attention path of the timed decode (eval/decode_path.py); str() and format() are the value."""

    GROUPED = "grouped"
    """a static cache written in place, the query heads folded onto the kv heads: each cached kv head read once
    per step for its whole group, nothing copied (the default)."""
    DYNAMIC = "dynamic"
    """transformers' default, eval's path before 2026-12: a DynamicCache (the whole cache copied every step) and
    the model's attention as loaded."""
    REPEAT = "repeat"
    """a DynamicCache and eager attention: K/V copied out to every query head each step, as a compiled static
    cache does; GQA's speed-up is lost (for comparison only)."""


@dataclass
class EvalOptions:
    data: str | Sequence[str] | Mapping[str, str] | None = (PROBE,)
    """Held-out texts, each a domain measured apart: NAME=PATH (repeatable, e.g. --data prose=novel.txt
    --data code=src/), or PATH alone (named after the file). NAME starts with a letter, then letters,
    digits, _ or -, at most 40 characters, and one that breaks the rule is refused; a PATH whose own name
    holds '=' is read whole when it exists, or when written ./PATH. PATH is a .txt/.md file (one document),
    .jsonl/.json/.parquet (a document per record, from --data-column), each .gz/.bz2/.xz/.zst too, a
    folder of them, or a hub dataset name such as wikitext (online only). 'probe': the probe set shipped
    in the package (prose, code, python_docs, licences; docs/eval.md), the default. In Python, None skips
    perplexity."""
    reference: str | TopReference | None = None
    """Parent model (dir or hub id): adds mean KL(reference||model) and top-1 agreement on --data. In Python also
    a reference known by its top tokens (eval/reference_tops.py TopReference; convert's check gives one)."""
    tokenizer: str | None = None
    """Tokenizer dir or hub id (default: the model directory's tokenizer)."""
    data_config: str | None = None
    """Hub dataset config, e.g. wikitext-2-raw-v1."""
    data_split: str = "test"
    """Hub dataset split."""
    data_column: str = "text"
    """Field or column holding the text (jsonl/json/parquet files, hub datasets)."""
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    """Score at most this many tokens of each --data text, its first ones (a hub dataset is then read only as far
    as needed); all (None in Python) scores every token. The default keeps `eval` of a 135M model and its
    reference on the four probe domains within a few minutes on two CPU cores (docs/eval.md, "Cost")."""
    context: int | None = None
    """Perplexity window in tokens (default: min(1024, max_position_embeddings))."""
    stride: int | None = None
    """Tokens between window starts, 1..context; each token is scored once (default: context: windows side by
    side, each token computed once, as lm-evaluation-harness's rolling windows; less re-reads context)."""
    batch_size: int | str = 1
    """Windows per forward pass in perplexity (also lm-eval's batch); auto: the largest batch the free memory
    holds by an estimate, at most 64 (lm-eval searches its own). The numbers do not depend on it."""
    dtype: str = "auto"
    """auto (the checkpoint's), float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (cuda when available), cpu, cuda, cuda:N."""
    speed_preset: SpeedPreset | str | None = SpeedPreset.AUTO
    """Decode-speed grid."""
    speed_batches: Sequence[int] | None = None
    """Override the preset's batch sizes, e.g. 1,8,64."""
    speed_contexts: Sequence[int] | None = None
    """Override the preset's prefill lengths, e.g. 512,2048."""
    new_tokens: int | None = None
    """Greedy tokens decoded per speed measurement (overrides the preset)."""
    repeats: int | None = None
    """Least timed repeats per speed grid point (default 3; more while a point took under the preset's 1 s cpu,
    2 s gpu, at most 30), after 1 warm-up; the median and its interquartile range are reported."""
    decode_path: DecodePath | str = DecodePath.GROUPED
    """How the timed decode reads the KV cache (docs/eval.md, "Decode path"); the result names it."""
    speed_side_by_side: bool = False
    """Time --reference's decode side by side with the model's (repeat by repeat in turn, one process, the same
    prompts) and keep its numbers in the result: a speed-up is computed only from speeds measured together,
    never from two runs at different times and loads."""
    kv_cache: bool = True
    """Measure the live KV cache's bytes per token against the formula (--no-kv-cache skips it, as convert's check
    does)."""
    kv_batch: int = 2
    """Batch of the prefill whose live KV cache is measured."""
    kv_tokens: int = 32
    """Tokens of that prefill."""
    attention_text: str | None = None
    """A short text: save per-head attention maps of --attention-layer as a PNG grid (beside --reference's
    heads when given)."""
    attention_layer: int = 0
    """Layer of the attention maps (negative counts from the end)."""
    attention_png: str | None = None
    """Where the attention PNG goes (default: --out with .attention.png)."""
    lm_eval_tasks: Sequence[str] | None = None
    """lm-evaluation-harness tasks on the loaded model: the offline persuasion_cloze,persuasion_next_sentence
    (or the tag mha2gqa_offline), or hub tasks such as hellaswag when online (needs pip install
    'mha2gqa[lmeval]'; see docs/lmeval.md)."""
    lm_eval_limit: int | None = None
    """Examples per lm-eval task (for quick checks only)."""
    chat_template: bool = False
    """Put lm-eval's prompts through the tokenizer's chat template, for instruct models (lm-eval's
    --apply_chat_template); refused when the tokenizer has none."""
    log_samples: str | None = None
    """Write every lm-eval example (task, doc id, prompt arguments, responses, per-example metrics) to this
    JSON-lines file, as lm-eval's --log_samples does."""
    retrieval: bool = False
    """Run the long-context retrieval probe: a fact stated once in a long context (a sentence in prose, or one
    key among many), asked for at the end; exact-match recall and the answer's log-probability per length and
    depth, beside --reference's (docs/eval.md, "Retrieval")."""
    retrieval_lengths: Sequence[int] | None = None
    """The probe's context lengths in tokens, e.g. 256,1024 (default: 128, 512, 2048, those within the model's
    max_position_embeddings, and that maximum when it is below 2048)."""
    retrieval_depths: Sequence[float] | None = None
    """Where the fact sits in the context, 0 (the start) to 1 (just before the question), e.g. 0.1,0.5,0.9
    (the default)."""
    retrieval_samples: int | None = None
    """Questions per task, length and depth (two tasks: needle and kv; default 2)."""
    role: str | None = None
    """Role in the report: parent, converted or uptrained (default: from the model's mha2gqa.json: uptrain ->
    uptrained, conversion -> converted, none -> parent)."""
    label: str | None = None
    """Short name in the report (default: the model directory's name)."""
    seed: int = 0
    """Seed of torch and of the random prefill ids."""
    out: str | None = None
    """Write the result JSON here, atomically at the end (default: the command prints it to stdout)."""
    progress: bool = True
    """Show progress bars."""

    @property
    def domains(self) -> dict[str, str] | None:
        """{name: text} of --data (corpus/probe.py parse_domains), None without any."""
        return parse_domains(self.data)

    @property
    def speed(self):
        """The preset to run ("auto" still unresolved), or None when speed is off."""
        if self.speed_preset in (None, False, SpeedPreset.OFF):
            return None
        preset = self.speed_preset
        return preset.value if isinstance(preset, SpeedPreset) else preset

    def validate(self) -> None:
        """Refuse what no measurement could use, before any model is loaded (each measurement checks its
        own flags: eval/measurements.py)."""
        from mha2gqa.eval.schema import validate_writable
        from mha2gqa.records.provenance import ROLES

        if not isinstance(self.reference, (str, Path, type(None))) and (self.speed_side_by_side or self.attention_text):
            raise InputError(  # only convert's check gives one, and asks for neither
                "a reference known by its top tokens has no decode or attention maps to show: give it as a folder"
            )
        if self.role is not None and self.role not in ROLES:
            raise InputError(f"--role {self.role!r} is not a role (use {', '.join(ROLES)})")
        if self.out and Path(self.out).is_dir():
            raise InputError(
                f"--out {self.out} is a directory: pass a file path such as {Path(self.out) / 'results.json'}"
            )
        if self.out:  # a read-only or full destination fails now, not after the whole evaluation
            validate_writable(Path(self.out), "--out")

    def counts(self) -> dict:
        """Every count a user types, by flag, for limits.validate_limits (--batch-size auto is no count)."""
        names = ("max_tokens", "context", "stride", "new_tokens", "repeats", "kv_batch", "kv_tokens",
                 "attention_layer", "lm_eval_limit", "retrieval_samples", "seed", "speed_batches", "speed_contexts",
                 "retrieval_lengths")  # fmt: skip
        found = {"--" + name.replace("_", "-"): getattr(self, name) for name in names}
        found["--batch-size"] = None if self.batch_size == "auto" else self.batch_size
        return found

    @classmethod
    def from_kwargs(cls, kwargs: dict) -> EvalOptions:
        """The options of `evaluate(model, **kwargs)`; an unknown keyword is a TypeError, as it was when these
        were evaluate's own parameters."""
        validate_keywords(cls, kwargs, "evaluate")
        return cls(**kwargs)
