"""The one writer of JSON text: every JSON file, line and printout mha2gqa makes goes through `dumps`.

JSON has no NaN or infinity. Python's json writes them as the bare words NaN and Infinity by default,
which no strict reader takes (a sweep.json with a NaN perplexity was not JSON). `dumps` writes a
non-finite number as null, as JavaScript's JSON.stringify does, and encodes with allow_nan=False, so
what it returns is always valid JSON; readers treat null as "no number". `shown` is for text that is no
file (a value quoted in a message, a cache key) and keeps Python's defaults, so that quoting a hostile
value never fails. `model_config` writes a model's config.json as transformers does: a parent's
infinite value (falcon_h1's time_step_limit, (0.0, inf)) is a setting transformers reads back as
Infinity, and null there makes the config unloadable. tests/test_jsontext.py checks that no other module calls json.dump or json.dumps.
"""

from __future__ import annotations

import json
import math


def dumps(value, **kwargs) -> str:
    """`value` as strict JSON text (json.dumps' keywords), each non-finite float written as null."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def shown(value, **kwargs) -> str:
    """`value` as JSON text in a message or a key: never raises on NaN (never written to a file)."""
    return json.dumps(value, **kwargs)


def model_config(config: dict, **kwargs) -> str:
    """A model's config.json text as transformers' save_pretrained writes it (Infinity and NaN kept)."""
    return json.dumps(config, **kwargs)


def _finite(value):
    """`value` with every non-finite float (at any depth of dicts, lists and tuples) replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value
