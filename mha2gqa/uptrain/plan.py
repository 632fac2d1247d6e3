"""What an uptraining run will do, said before it starts (`mha2gqa uptrain --dry-run`), without torch and without
writing anything: the recipe as resolved, the data it reads or samples, its steps and tokens, its time (the rates
of mha2gqa.estimates, which convert's dry run uses too) and its peak memory (`peak_memory`: a formula checked
against the peaks measured on SmolLM2-135M, docs/uptrain.md "Memory")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from mha2gqa import estimates
from mha2gqa.architecture.layouts import attention_shape, read_config
from mha2gqa.corpus.probe import DOMAINS
from mha2gqa.corpus.sampling import has_chat_template
from mha2gqa.files.checkpoint import SafetensorsCheckpoint
from mha2gqa.files.sources import cached_snapshot, is_hub_id
from mha2gqa.runtime.errors import InputError
from mha2gqa.runtime.units import counted, format_bytes
from mha2gqa.scoring.retrieval_items import probe_grid
from mha2gqa.uptrain import trainable
from mha2gqa.uptrain.recipe import Recipe

GiB = 1 << 30

# ---- how long: the steps and tokens of a budget ----


def tokens_per_step(recipe: Recipe, world_size: int) -> int:
    """Tokens in one optimizer step over all processes (packed blocks: no padding to discount)."""
    return recipe.seq_len * recipe.micro_batch_size * recipe.grad_accum * world_size


def total_steps(recipe: Recipe, world_size: int) -> int:
    """Optimizer steps the budget allows; a token budget rounds up to whole steps."""
    b = recipe.budget
    if b.max_steps is not None:
        return b.max_steps
    tokens = b.tokens if b.tokens is not None else b.alpha * b.pretrain_tokens
    return max(1, math.ceil(tokens / tokens_per_step(recipe, world_size)))


def eval_count(recipe: Recipe, steps: int) -> int:
    """Evals a run makes: at the start (eval_at_start), every eval_every steps, and at the last step."""
    every = range(recipe.eval_every, steps + 1, recipe.eval_every) if recipe.eval_every else []
    return int(recipe.eval_at_start) + len(every) + (0 if steps in every else 1)


DOMAIN_TOKENS = 1024  # of each probe domain that eval_domains reads (probe_evals.py)


def probe_eval_tokens(recipe: Recipe) -> int:
    """Tokens one eval forwards for eval_retrieval (eval's probe at its defaults, capped at the model's positions)
    and eval_domains (each probe domain's first DOMAIN_TOKENS, in whole seq_len blocks, at least one)."""
    tokens = 0
    if recipe.eval_retrieval:
        try:
            tokens += probe_grid(None, None, None, 0, _max_positions(recipe.model)).forward_tokens()
        except InputError:  # a model too short for the probe: the run says so
            pass
    if recipe.eval_domains:
        tokens += len(DOMAINS) * max(1, DOMAIN_TOKENS // recipe.seq_len) * recipe.seq_len
    return tokens


def _max_positions(model: str | None) -> int | None:
    path = Path(model).expanduser() if model else None
    if path is None or not (path / "config.json").is_file():
        return None
    return read_config(path).get("max_position_embeddings")


# ---- the models' sizes, from config.json and the safetensors headers ----


@dataclass(frozen=True)
class ModelSize:
    """What a run's memory and time depend on, read without loading the model."""

    parameters: int
    trained: int  # parameters the recipe's `trainable` trains
    stored_bytes: float  # bytes per parameter as stored (2 for bfloat16, 4 for float32)
    layers: int
    hidden: int
    intermediate: int  # the MLP's width
    q_width: int  # heads x head_dim
    kv_width: int  # kv heads x head_dim
    vocab: int
    counted: bool  # parameters counted from the weights (False: estimated from the config)


def model_size(source: str, recipe: Recipe) -> ModelSize | None:
    """The size of a local model directory, of a hub id already in the hub cache, or of a config (a file, or
    a directory without weights); None for a hub id that would be downloaded first."""
    path = Path(source).expanduser()
    if not path.exists() and is_hub_id(source):
        path = cached_snapshot(source)
        if path is None:
            return None
    if path.is_file():  # init_from_config=<file>.json
        return _from_config(_read_json_config(path), recipe, None)
    config = read_config(path)
    weights = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()
    return _from_config(config, recipe, SafetensorsCheckpoint(path) if weights else None)


def config_size(config: dict, recipe: Recipe) -> ModelSize:
    """The size of a model not written yet (a demo's conversion), from its config.json's mapping."""
    return _from_config(config, recipe, None)


def _read_json_config(path: Path) -> dict:
    from mha2gqa.files.reading import read_json

    return read_json(path, "fix or re-save it")


def _from_config(config: dict, recipe: Recipe, checkpoint: SafetensorsCheckpoint | None) -> ModelSize:
    shape = attention_shape(config)
    d, layers = shape.hidden, shape.layers
    intermediate = config.get("intermediate_size") or config.get("n_inner") or 4 * d
    vocab = config.get("vocab_size") or 0
    q, kv = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    if checkpoint is not None:
        shapes = checkpoint.shapes
        parameters = sum(math.prod(s) for s in shapes.values())
        stored = sum(info.nbytes for info in checkpoint.tensors.values()) / max(1, parameters)
    else:  # a decoder of the usual shape: embeddings (and an untied head), attention, a gated MLP, norms
        per_layer = {"q": d * q, "k": d * kv, "v": d * kv, "o": q * d, "mlp": 3 * d * intermediate, "norms": 2 * d}
        untied = 1 if config.get("tie_word_embeddings") is False else 0
        parameters = vocab * d * (1 + untied) + layers * sum(per_layer.values()) + d
        shapes, stored = None, 4.0
    trained = _trained(shapes, config, recipe, layers, d, q, kv, parameters)
    return ModelSize(parameters, trained, stored, layers, d, intermediate, q, kv, vocab, checkpoint is not None)


def _trained(shapes, config: dict, recipe: Recipe, layers: int, d: int, q: int, kv: int, parameters: int) -> int:
    if shapes is not None:
        return trainable.count(shapes, config, recipe.trainable, recipe.lora)
    per_layer = {
        "all": 0,
        "attention": 2 * d * q + 2 * d * kv,
        "kv": 2 * d * kv,
        "lora": recipe.lora.rank * (4 * d + 2 * q + 2 * kv),
    }[recipe.trainable]
    return parameters if recipe.trainable == "all" else layers * per_layer


# ---- the peak memory of one process ----

# Logit elements of one chunk of distill.py's loss, at most: 16 MiB a float32 copy.
CHUNK_ELEMENTS = 1 << 22
# Positions of a chunk: a multiple of 64, so that each position's logits (and their gradient's product with the
# output layer) are the very bits the whole micro-batch's matrix product gives: measured with torch 2.13's CPU
# kernels (MKL, AVX-512), at 1 and 2 threads, for chunks of 16 to 256 rows, but not 85. The training is then the
# plain loss's bit for bit (docs/uptrain.md, "Memory").
CHUNK_ROWS = 64


def chunk_rows(vocab: int) -> int:
    """Positions in one chunk of distill.py's loss for a vocabulary of `vocab`."""
    return CHUNK_ROWS * max(1, CHUNK_ELEMENTS // (vocab * CHUNK_ROWS))


# Measured, not derived: python, torch, transformers, accelerate, the tokenizer and the data of the SmolLM2
# recipe before the models are touched, plus what the allocator holds beyond the live tensors at the peak
# (docs/uptrain.md, "Memory": the formula's parts against the measured peaks).
PROCESS_BYTES = int(0.45 * GiB)
# The chunked distillation loss (distill.py): a chunk's logits and the float32 copies its KL, cross-entropy
# and their gradients make (about ten), whatever the micro-batch.
CHUNK_COPIES = 10


@dataclass(frozen=True)
class Memory:
    """The peak resident memory of one process, by part (bytes)."""

    parts: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def line(self) -> str:
        parts = ", ".join(f"{name} {self.parts[name] / GiB:.2f}" for name in self.parts)
        return f"peak memory: about {format_bytes(self.total, digits=1)} per process (GiB: {parts}; {MEMORY_CAVEAT})"


MEMORY_CAVEAT = (
    "float32 on CPU, formula of mha2gqa/uptrain/plan.py, within 10% of the peak RSS measured for SmolLM2-135M "
    "at micro-batches of 1, 2 and 4 x 512 tokens; bf16/fp16 autocast holds less"
)


def peak_memory(recipe: Recipe, student: ModelSize, teacher: ModelSize | None) -> Memory:
    """Weights (fp32 master copies; a LoRA base as stored; the teacher in the autocast dtype), gradients and
    AdamW's two moments of the trained parameters, and the larger of a training step's transient memory (what
    every layer keeps for backward, the loss's logits) and an eval's (its logits and their log-softmax)."""
    n = recipe.micro_batch_size * recipe.seq_len  # tokens in a micro-batch
    weights = student.parameters * (student.stored_bytes if recipe.trainable == "lora" else 4)
    if teacher is not None:
        weights += teacher.parameters * (4 if recipe.mixed_precision == "no" else 2)
    # What one decoder layer keeps for backward, float32, per token: the gated MLP's three activations, the
    # attention's queries, keys and values, and three hidden-size tensors (the norms' inputs, the attention output).
    layer = n * 4 * (3 * student.intermediate + 3 * student.hidden + student.q_width + 2 * student.kv_width)
    if recipe.gradient_checkpointing:  # each layer's input only, and one layer recomputed at a time
        activations = student.layers * n * 4 * student.hidden + layer
    else:
        activations = student.layers * layer
    if teacher is not None:  # distill.py: both last hidden states and the gradient of the student's, then chunks
        chunk = min(n, chunk_rows(student.vocab)) * student.vocab
        logits = 3 * n * 4 * student.hidden + CHUNK_COPIES * chunk * 4
    else:  # transformers' loss: the logits, their log-softmax and the gradient of the logits, all float32
        logits = 3 * n * 4 * student.vocab
    evaluation = 2 * n * 4 * student.vocab
    step = activations + logits
    transient = {"activations": activations, "logits": logits} if step >= evaluation else {"eval logits": evaluation}
    return Memory({"process": PROCESS_BYTES, "weights": weights, "optimizer": 12 * student.trained, **transient})


# ---- the data a run reads or samples ----


def text_tokens(files) -> int:
    """About how many tokens local text files hold, from their sizes (mha2gqa.estimates.text_tokens: as `sweep`'s
    and the run's own estimate read them)."""
    return estimates.text_tokens([str(f) for f in files]) or 0


def _names(files) -> str:
    names = [Path(f).name for f in files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def data_lines(recipe: Recipe, train_blocks: int) -> tuple[list[str], int, int | None]:
    """What data.train and data.eval read or sample (the parts recipe_load resolved), the tokens sampled from the
    teacher before the first step, and about how many tokens data.train holds when it is one local text."""
    lines, sampled = [], 0
    # the parent's share of the training blocks, and of the eval blocks when they are held out of data.train
    blocks = train_blocks + (0 if recipe.data.eval else recipe.data.eval_blocks)
    sources = getattr(recipe.data, "checked_sources", None) or {}  # set by load_recipe
    for key, (_entries, parts) in sources.items():
        for part in parts or ():
            share = f" ({part.share:.0%} of the blocks)" if part.share not in (None, 1) else ""
            if part.copies:
                made = round(part.share * blocks)
                lines.append(
                    f"{key}: retrieval{share}: {made:,} blocks of {recipe.seq_len} tokens of copy-task prompts made "
                    "of the other parts before the first step (needle, key-value, passage copy; copy_task.py)"
                )
            elif part.sampled:
                drawn = round(part.share * blocks)
                sampled += drawn * recipe.seq_len
                lines.append(
                    f"{key}: parent{share}: {drawn:,} blocks of {recipe.seq_len} tokens sampled from distill.teacher "
                    f"before the first step ({drawn * recipe.seq_len:,} tokens)"
                )
            else:
                lines.append(f"{key}: {_text_words(part.text)}{share}" + _eval_words(key, recipe))
    if not recipe.data.eval:
        lines.append(
            f"data.eval: unset: {recipe.data.eval_blocks} blocks of {recipe.seq_len} tokens held out of data.train"
        )
    parts = (sources.get("data.train") or (None, None))[1] or ()
    one_text = len(parts) == 1 and parts[0].share is None and parts[0].text.hub is None
    return lines, sampled, text_tokens(parts[0].text.files) if one_text else None


def _text_words(text) -> str:
    if text.hub is not None:
        return f"hub dataset {text.hub} (its size is known once it is read)"
    size = format_bytes(sum(f.stat().st_size for f in text.files), digits=1)
    return (
        f"{counted(len(text.files), 'file')} ({_names(text.files)}), {size}, about {text_tokens(text.files):,} tokens"
    )


def _eval_words(key: str, recipe: Recipe) -> str:
    return f"; its first {recipe.data.eval_blocks} blocks of {recipe.seq_len} tokens" if key == "data.eval" else ""


# ---- the whole plan ----


@dataclass
class RunPlan:
    """A checked recipe's run on `world_size` processes, as `uptrain --dry-run` prints it."""

    recipe: Recipe
    world_size: int
    steps: int
    student: ModelSize | None
    teacher: ModelSize | None
    data: list[str]
    sampled_tokens: int  # drawn from the teacher before the first step
    text_tokens: int | None  # in data.train's text (None: a hub dataset, or sampled only)

    @property
    def tokens(self) -> int:
        return self.steps * tokens_per_step(self.recipe, self.world_size)

    def work(self) -> estimates.UptrainWork | None:
        """What one process will do, for the estimate (mha2gqa.estimates' stages); None when the student's size is
        unknown (a hub id not in the hub cache). The ranks run at once: each does its share of the tokens."""
        if self.student is None:
            return None
        r, s, t, world = self.recipe, self.student, self.teacher, max(1, self.world_size)
        parts = ((getattr(r.data, "checked_sources", None) or {}).get("data.train") or (None, None))[1] or ()
        text = sum(text_tokens(part.text.files) for part in parts if part.text is not None and part.text.hub is None)
        return estimates.UptrainWork(
            s.parameters,
            t.parameters if t is not None else None,
            round(s.parameters * s.stored_bytes + (t.parameters * t.stored_bytes if t is not None else 0)),
            self.tokens // world,
            eval_count(r, self.steps),
            r.data.eval_blocks * r.seq_len + self._probe_tokens(),
            self.sampled_tokens // world if t is not None else 0,
            text,
            bool(r.gradient_checkpointing),
            s.trained,
            r.seq_len,
            bool(r.distill.teacher) and has_chat_template(r.distill.teacher),
        )

    def _probe_tokens(self) -> int:
        """Each eval's probe tokens, the teacher's one pass of them before the first step spread over the evals."""
        tokens, evals = probe_eval_tokens(self.recipe), max(1, eval_count(self.recipe, self.steps))
        return tokens * (evals + 1) // evals if self.recipe.distill.teacher else tokens

    def seconds(self) -> float | None:
        """The run's seconds on the machine the rates were measured on (mha2gqa.estimates: start, load, train,
        save), as the run itself estimates them before it loads the models."""
        work = self.work()
        return None if work is None else sum(stage.seconds() for stage in estimates.uptrain_stages(work))

    def estimate(self, machine) -> estimates.Estimate | None:
        """The estimate the run says before it loads the models: its stages on `machine`, and peak_memory's total
        (None when the sizes are unknown)."""
        work = self.work()
        if work is None or (self.recipe.distill.teacher and self.teacher is None):
            return None
        peak = peak_memory(self.recipe, self.student, self.teacher).total
        return estimates.Estimate(tuple(estimates.uptrain_stages(work)), machine, peak)

    def describe(self) -> list[str]:
        r, world = self.recipe, self.world_size
        lines = [_model_line("model", r.model or r.init_from_config, self.student, r)]
        if r.distill.teacher:
            lines.append(_model_line("distill.teacher", r.distill.teacher, self.teacher, r))
        lines += self.data
        per_step = f"{r.micro_batch_size} blocks x {r.seq_len} tokens x grad_accum {r.grad_accum} x {world} process"
        epochs = f", about {self.tokens / self.text_tokens:.2g} passes over data.train" if self.text_tokens else ""
        lines.append(
            f"steps: {self.steps:,} optimizer steps of {tokens_per_step(r, world):,} tokens ({per_step}"
            f"{'es' if world > 1 else ''}): {self.tokens:,} tokens{epochs}; {eval_count(r, self.steps)} evals"
        )
        if probe_eval_tokens(r):
            asked = " and ".join(k for k in ("eval_retrieval", "eval_domains") if getattr(r, k))
            teacher = " (and once by the teacher, before the first step)" if r.distill.teacher else ""
            lines.append(f"{asked}: {probe_eval_tokens(r):,} tokens forwarded at each eval{teacher}")
        seconds = self.seconds()
        time = estimates.duration(seconds) if seconds is not None else "unknown (the model is not local)"
        lines.append(f"time: {time} ({estimates.CAVEAT}; a busier machine takes longer, a GPU far less)")
        if self.student is not None and (self.teacher is not None or not r.distill.teacher):
            lines.append(peak_memory(r, self.student, self.teacher).line())
        return lines


def _model_line(key: str, source: str, size: ModelSize | None, recipe: Recipe) -> str:
    if size is None:
        return f"{key}: {source} (a hub id not in the hub cache: its size is known once it is downloaded)"
    how = "" if size.counted else ", estimated from its config"
    trained = f"; trains {recipe.trainable}: {size.trained:,}" if key == "model" else ""
    return f"{key}: {source} ({size.parameters:,} parameters{how}{trained})"


def plan_run(recipe: Recipe, world_size: int = 1) -> RunPlan:
    """The plan of a recipe that load_recipe checked (with its files)."""
    steps = total_steps(recipe, world_size)
    student = model_size(recipe.model or recipe.init_from_config, recipe)
    teacher = model_size(recipe.distill.teacher, recipe) if recipe.distill.teacher else None
    train_blocks = steps * recipe.grad_accum * recipe.micro_batch_size * world_size
    data, sampled, text = data_lines(recipe, train_blocks)
    return RunPlan(recipe, world_size, steps, student, teacher, data, sampled, text)


def uptrain_estimate(recipe: Recipe, world_size: int, machine) -> estimates.Estimate | None:
    """The estimate `uptrain` says before it loads the models (uptrain/loop.py): the same plan as --dry-run's."""
    return plan_run(recipe, world_size).estimate(machine)
