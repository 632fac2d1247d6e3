"""mha2gqa: turn a multi-head-attention checkpoint into grouped-query / multi-query attention,
uptrain it briefly, and measure what was lost and what was saved."""

__version__ = "0.1.0"

from mha2gqa.errors import InputError  # noqa: E402

__all__ = ["InputError", "__version__", "convert", "inspect_model"]


def convert(*args, **kwargs):
    """Convert SRC to DST with `groups` kv heads; see `mha2gqa.convert.run.convert`."""
    from mha2gqa.convert.run import convert as _convert

    return _convert(*args, **kwargs)


def inspect_model(*args, **kwargs):
    """Describe a model's attention and the KV-cache saving of every valid target; see
    `mha2gqa.convert.inspect.inspect_model`."""
    from mha2gqa.convert.inspect import inspect_model as _inspect

    return _inspect(*args, **kwargs)
