"""mha2gqa: turn a multi-head-attention checkpoint into grouped-query / multi-query attention,
uptrain it briefly, and measure what was lost and what was saved."""

from mha2gqa.runtime.errors import InputError
from mha2gqa.version import __version__

__all__ = ["InputError", "__version__", "convert", "evaluate", "inspect_model", "load_recipe"]


def inspect_model(*args, **kwargs):
    """Describe a model's attention and the KV-cache saving of every valid target; see
    `mha2gqa.convert.inspect.inspect_model`."""
    from mha2gqa.convert.inspect import inspect_model as _inspect

    return _inspect(*args, **kwargs)


def evaluate(*args, **kwargs) -> dict:
    """Measure a model (perplexity, agreement, KV cache, decode speed); see `mha2gqa.eval.run.evaluate`."""
    from mha2gqa.eval import evaluate as _evaluate

    return _evaluate(*args, **kwargs)


def load_recipe(*args, **kwargs):
    """A validated uptraining recipe from YAML and key=value overrides; see `mha2gqa.uptrain.recipe`."""
    from mha2gqa.uptrain import load_recipe as _load_recipe

    return _load_recipe(*args, **kwargs)


def __getattr__(name):
    """`mha2gqa.convert` is a callable package (mha2gqa.convert(src, dst, groups=8)); it is imported
    on first use so that `import mha2gqa` (and the CLI's --help) stays cheap."""
    if name == "convert":
        import importlib

        return importlib.import_module("mha2gqa.convert")
    raise AttributeError(f"module 'mha2gqa' has no attribute {name!r}")
