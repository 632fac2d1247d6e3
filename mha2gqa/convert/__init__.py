"""Conversion of MHA/GQA checkpoints to fewer kv heads: plan (pure), methods (pure tensor math), run (I/O).

`mha2gqa.convert` is both this package and the public function `mha2gqa.convert(src, dst, groups=...)`:
a package attribute of that name would be replaced by this subpackage as soon as any
`mha2gqa.convert.*` module is imported, so the package itself is made callable instead.
"""

import sys
import types

# The methods `--method` offers, one line on each. Their tensor functions are in methods.py (which
# imports torch); the names and lines live here so that `mha2gqa convert --help` lists them at once.
METHOD_SUMMARIES = {
    "mean": "mean-pool each group's K/V heads (Ainslie et al. 2023)",
    "first": "keep the first K/V head of each group (ablation)",
    "random": "random K/V with the source's mean and std, seeded (ablation)",
    "mean-norm": "mean-pool, each pooled K/V head rescaled to its group's mean norm",
    "calibrated": "RoPE-aware merge from calibration statistics, maps folded into q_proj/o_proj (needs --calibration)",
}


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        """Convert SRC to DST with `groups` kv heads; see `mha2gqa.convert.run.convert`."""
        from mha2gqa.convert.run import convert

        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
