"""Every long command's stages, declared once: the names its plan lists, its estimate prices (costs.py) and its
clock times (clock.py), in the order they run, each with the kinds of work (rates.py) that price it.

A stage whose name is built as it runs (eval's "quality: prose", one a domain; a sweep's "candidate gqa4", one a
candidate) is declared as a family: its prefix, and `member` builds each name. A stage that runs another
command (a demo's "convert", a sweep's candidates) is priced by that command's stages, named in `runs`.
tests/test_stages.py fails when a stage is timed or priced under a name not declared here, or a declared stage
is never timed. Reads nothing and imports nothing of the package: every layer may use it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Declared:
    """One stage: its name (a family's prefix), the kinds of work that price it, the commands it runs."""

    name: str
    kinds: tuple[str, ...] = ()
    runs: tuple[str, ...] = ()
    family: bool = False

    def member(self, detail: str) -> str:
        """A family's stage for `detail`: 'quality: ' + 'prose'."""
        if not self.family:
            raise ValueError(f"stage {self.name!r} is not a family: its name is the whole name")
        return self.name + detail


# every command's process starts before its clock does: the clock's first stage (clock.Clock)
START = Declared("start", ("numpy_start", "torch_start"))


@dataclass(frozen=True)
class ConvertStages:
    start: Declared = START
    load: Declared = Declared("load", ("convert_load",))
    sample: Declared = Declared("sample", ("sample",))
    calibrate: Declared = Declared("calibrate", ("calibrate",))
    layer_losses: Declared = Declared("layer losses", ("calibrate",))  # --kv-budget: each layer at each count
    retrieval_heads: Declared = Declared("retrieval heads", ("eval_quality",))  # --keep-retrieval-heads: scored
    merge: Declared = Declared("merge", ("write_numpy", "write_torch"))
    refine: Declared = Declared("refine", ("refine",))
    refine_global: Declared = Declared("refine (global)", ("refine_global",))
    write: Declared = Declared("write", ("write_numpy", "write_torch"))
    check: Declared = Declared("check", ("check",))
    metadata: Declared = Declared("metadata", ("metadata",))


@dataclass(frozen=True)
class EvalStages:
    start: Declared = START
    load: Declared = Declared("load", ("eval_load",))
    quality: Declared = Declared("quality: ", ("eval_quality", "eval_tally"), family=True)
    retrieval: Declared = Declared("retrieval", ("eval_quality",))
    kv_cache: Declared = Declared("kv cache", ("eval_kv",))
    speed: Declared = Declared("decode speed", ("eval_speed",))
    attention_maps: Declared = Declared("attention maps", ("eval_quality", "report"))
    lm_eval: Declared = Declared("lm-eval", ("lm_eval",))


@dataclass(frozen=True)
class UptrainStages:
    start: Declared = START
    load: Declared = Declared("load", ("uptrain_load", "sample"))
    train: Declared = Declared("train", ("train", "eval_quality"))
    save: Declared = Declared("save", ("uptrain_save",))


@dataclass(frozen=True)
class SweepStages:
    start: Declared = START
    load: Declared = Declared("load")  # torch imported: its seconds are the start's, priced there
    evaluate_parent: Declared = Declared("evaluate parent", runs=("eval",))
    calibrate: Declared = Declared("calibrate", ("calibrate",))
    layer_losses: Declared = Declared("layer losses", ("calibrate",))  # --kv-budgets: each layer at each count
    candidate: Declared = Declared("candidate ", runs=("convert", "eval"), family=True)


@dataclass(frozen=True)
class DemoStages:
    start: Declared = START
    convert: Declared = Declared("convert", runs=("convert",))
    evaluate_parent: Declared = Declared("evaluate parent", runs=("eval",))
    evaluate_converted: Declared = Declared("evaluate converted", runs=("eval",))
    uptrain: Declared = Declared("uptrain", runs=("uptrain",))
    evaluate_uptrained: Declared = Declared("evaluate uptrained", runs=("eval",))
    report: Declared = Declared("report", ("report",))


CONVERT, EVAL, UPTRAIN, SWEEP, DEMO = ConvertStages(), EvalStages(), UptrainStages(), SweepStages(), DemoStages()
COMMANDS = {"convert": CONVERT, "eval": EVAL, "uptrain": UPTRAIN, "sweep": SWEEP, "demo": DEMO}


def declared(command: str) -> tuple[Declared, ...]:
    """`command`'s stages in the order they run."""
    stages = COMMANDS[command]
    return tuple(getattr(stages, f.name) for f in fields(stages))


def is_declared(command: str, name: str) -> bool:
    """Whether `name` is one of `command`'s stages, or a member of one of its families."""
    return any(name.startswith(s.name) if s.family else name == s.name for s in declared(command))
