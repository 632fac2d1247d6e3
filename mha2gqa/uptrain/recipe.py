"""The uptraining recipe: a typed schema, one docstring per field (the documentation: `describe` and
`mha2gqa uptrain --keys` read it from here).

A recipe is YAML whose keys are the fields below (nested sections for data, optim, budget, distill
and lora). Every key can be overridden on the command line as `key=value`, dotted for sections
(`optim.lr=1e-4`). `load_recipe` (recipe_load.py) reads one and checks it, collecting every problem
before raising. Relative paths are relative to the working directory the command runs in.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import asdict, dataclass, field
from typing import Literal

from mha2gqa.runtime.docfields import field_docs


def one_of(group: str):
    """The default of a key in an exclusive group: unset, and a recipe sets exactly one key of each group.
    The group is declared on its keys so that recipe_load's check and message follow them (group_keys)."""
    return field(default=None, metadata={"one_of": group})


def group_keys(cls, group: str) -> tuple[str, ...]:
    """The keys of `cls` declared one_of(group), in their order."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("one_of") == group)


@dataclass
class DataConfig:
    train: list[str] = field(default_factory=list)
    """Training text: files (.txt/.md, .jsonl/.json, .parquet; .gz/.bz2/.xz/.zst too), folders of them, one
    hub dataset name, or `austen` (the embedded novels); one format per run (docs/data.md). `parent`: sequences
    sampled from distill.teacher, no data needed. A mix gives each entry a share: [parent:0.5, corpus.txt:0.5],
    or one string with commas, parent:0.5,corpus.txt:0.5 (docs/uptrain.md: training on the parent's samples)."""
    eval: list[str] | None = None
    """Separate eval text, one text as `train` names it (no parent, no shares); when unset, `eval_blocks`
    blocks are held out of train (of a mix: in its shares, the parent's drawn with a seed of their own)."""
    name: str | None = None
    """Hub dataset configuration name (e.g. `sample-10BT`); hub datasets only."""
    split: str = "train"
    """Split of a hub dataset to read."""
    text_field: str = "text"
    """Field or column holding the text in jsonl/json/parquet/hub data."""
    sample_by: Literal["document", "paragraph", "line"] = "document"
    """How .txt files split into documents (EOS goes between documents)."""
    streaming: bool = False
    """Stream instead of loading into memory: for corpora larger than RAM."""
    eval_blocks: int = 64
    """Number of seq_len blocks held out for eval when `eval` is unset (also caps a separate eval set)."""
    shuffle_buffer: int = 10000
    """Documents in the shuffle buffer when streaming (in-memory data is shuffled exactly)."""


@dataclass
class OptimConfig:
    lr: float = 1e-4
    """Peak learning rate of AdamW."""
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    """Decay after warmup, down to lr * min_lr_ratio at the last step."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup from 0 to lr."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of lr (cosine, linear)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not norms, biases)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas [beta1, beta2]."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value when gradients sync; 0 disables clipping."""


@dataclass
class BudgetConfig:
    max_steps: int | None = one_of("budget")
    """Stop after this many optimizer steps. Set exactly one of max_steps, tokens, alpha."""
    tokens: int | None = one_of("budget")
    """Stop after this many training tokens (rounded up to whole optimizer steps)."""
    alpha: float | None = one_of("budget")
    """Train for alpha x pretrain_tokens tokens (the GQA paper uptrains with alpha = 0.05)."""
    pretrain_tokens: int | None = None
    """Tokens the source model was pretrained on; required with alpha."""


@dataclass
class DistillConfig:
    teacher: str | None = None
    """Teacher model (the MHA parent): local dir or hub id. Unset: no distillation."""
    kl_weight: float = 0.5
    """Loss = (1 - kl_weight) * LM loss + kl_weight * T^2 * KL(teacher || student)."""
    temperature: float = 1.0
    """Softmax temperature T of both distributions in the KL term."""
    answer_weight: float = 1.0
    """Weight of the positions that predict an answer of data.train retrieval, in both terms (every other
    position weighs 1, each term's mean is over the weights): 1 is the plain loss on the whole sequence."""


@dataclass
class LoraConfig:
    rank: int = 16
    """Rank r of each low-rank adapter (trainable=lora only)."""
    alpha: float = 32.0
    """Adapter scale numerator: the update B @ A is multiplied by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapters' input during training."""
    target_modules: list[str] | None = None
    """Modules to adapt, e.g. [self_attn.q_proj, self_attn.v_proj]; unset: every attention projection."""
    load_in_4bit: bool = False
    """QLoRA: hold the frozen base in 4-bit NF4 (needs bitsandbytes and a CUDA GPU; refused elsewhere)."""


@dataclass
class Recipe:
    model: str | None = one_of("source")
    """Model to uptrain: local HF dir (e.g. a converted GQA model) or hub id. Unset with init_from_config."""
    init_from_config: str | None = one_of("source")
    """Train from scratch: a config.json, a dir holding one, or a hub id. Excludes `model`."""
    tokenizer: str | None = None
    """Tokenizer dir or hub id; defaults to `model` (or the init_from_config dir)."""
    output_dir: str | None = None
    """Where checkpoints, metrics.jsonl and the final HF model go. Required."""
    overwrite: bool = False
    """Allow writing into a non-empty output_dir without --resume (its checkpoints are replaced)."""
    seed: int = 0
    """Seed of the data order, the held-out split and init_from_config weights."""
    seq_len: int = 512
    """Tokens per packed block (one training sample)."""
    micro_batch_size: int = 8
    """Blocks per forward pass on each process."""
    grad_accum: int = 1
    """Micro-batches accumulated per optimizer step."""
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    """Autocast precision (weights and optimizer stay fp32); fp16 adds a loss scaler: prefer bf16."""
    trainable: Literal["all", "attention", "kv", "lora"] = "all"
    """Parameters to train: everything, attention only (q/k/v/o + their norms), k/v only, or LoRA
    adapters (section lora) merged into the weights at the end."""
    attn_implementation: str = "sdpa"
    """transformers attention kernel: sdpa, eager, flash_attention_2 (when installed)."""
    compile: bool = False
    """torch.compile the model (GPU runs; compile time is not worth it for short CPU runs)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward: less memory, about 30% slower."""
    log_every: int = 10
    """Optimizer steps between metrics.jsonl lines (and tqdm/tensorboard updates)."""
    eval_every: int = 100
    """Optimizer steps between evals of held-out loss and perplexity; 0: only at the end."""
    eval_retrieval: bool = False
    """Also ask eval's retrieval probe (eval --retrieval at its defaults, seed 0) at every eval: recall and the
    answer log-probability go to metrics.jsonl, with the teacher's once at step 0 when distill.teacher is set."""
    eval_domains: bool = False
    """Also measure perplexity on the first 1,024 tokens of each domain of eval's probe set at every eval, and its
    geometric mean ratio to the teacher's (measured once) when distill.teacher is set."""
    eval_at_start: bool = True
    """Eval before the first step (metrics line at step 0, with loss null)."""
    save_every: int = 500
    """Optimizer steps between resumable checkpoints (accelerate save_state); 0: never."""
    keep_last: int = 2
    """Resumable checkpoints kept on disk; older ones are deleted."""
    exit_after_steps: int | None = None
    """Save state and stop after this many steps in this run (for job time limits); continue with --resume."""
    tensorboard: bool = True
    """Also log to tensorboard (output_dir/tensorboard) when tensorboard is installed."""
    trace_samples: bool = False
    """Audit: each process writes trace/rank<N>.jsonl with a hash of every block it trained on."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training and eval data."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW and the learning-rate schedule."""
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    """How long to train."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """Optional distillation from the MHA parent."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """Adapter settings of trainable=lora."""

    def to_dict(self) -> dict:
        """Plain JSON-able dict of every key, as resolved (for provenance and resume checks)."""
        out = asdict(self)
        out["optim"]["betas"] = list(self.optim.betas)
        return out

    @property
    def tokenizer_source(self) -> str | None:
        return self.tokenizer or self.model or _config_dir(self.init_from_config)


def _config_dir(path: str | None) -> str | None:
    """The folder of an init_from_config path (a config.json's folder may hold the tokenizer too)."""
    if path is None or not path.endswith(".json"):
        return path
    from pathlib import Path

    return str(Path(path).parent)


# Keys that may change between an interrupted run and its --resume without changing the result.
RESUME_FREE_KEYS = {
    "log_every",
    "eval_every",
    "eval_at_start",
    "eval_retrieval",
    "eval_domains",
    "save_every",
    "keep_last",
    "exit_after_steps",
    "tensorboard",
    "trace_samples",
    "overwrite",
    "output_dir",
}


def all_keys(cls=Recipe, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (for suggestions and section errors)."""
    keys = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        keys += all_keys(hint, f"{prefix}{f.name}.") if dataclasses.is_dataclass(hint) else [prefix + f.name]
    return keys


def describe(cls=Recipe, prefix: str = "") -> list[tuple[str, str, str]]:
    """[(dotted key, default, doc)] for every key of the schema, sections expanded."""
    rows, docs, hints = [], field_docs(cls), typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            rows += describe(hints[f.name], f"{prefix}{f.name}.")
            continue
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        rows.append((prefix + f.name, "null" if default is None else str(default), docs.get(f.name, "")))
    return rows
