"""The KV cache in a transformers forward call, the same under every transformers 5 release the package meets.

transformers 5.20 renamed the cache, argument and output field both, from `past_key_values` to `cache`. Users who
install mha2gqa beside vLLM get a release below 5.20 (vLLM pins it), and there `model(ids, cache=c)` does not
fail: the unknown keyword is swallowed and the cache ignored, so a decode step silently sees one token of
context. So the name is read from the model's own forward signature, never guessed.
"""

from __future__ import annotations

import inspect
from functools import cache


@cache
def _argument(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model, cache_value) -> dict:
    """{name: cache_value} for `model(...)`, under the name this transformers release's forward takes."""
    return {_argument(type(model)): cache_value}


def cache_of(output):
    """The cache a forward call returned (`.cache` from 5.20, `.past_key_values` before)."""
    found = getattr(output, "cache", None)
    return found if found is not None else getattr(output, "past_key_values", None)
