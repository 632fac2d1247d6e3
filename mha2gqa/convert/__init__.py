"""Conversion of MHA/GQA checkpoints to fewer kv heads: plan (pure), methods (pure tensor math), run (I/O).

`mha2gqa.convert` is both this package and the public function `mha2gqa.convert(src, dst, groups=...)`:
a package attribute of that name would be replaced by this subpackage as soon as any
`mha2gqa.convert.*` module is imported, so the package itself is made callable instead.
"""

import sys
import types

# The options, methods and groupings; options.py imports no torch, so `mha2gqa convert --help` lists them at once.
from mha2gqa.convert.options import METHOD_SUMMARIES, ConvertOptions, Grouping, Method  # noqa: E402,F401


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        """Convert SRC to DST with `groups` kv heads; keywords are ConvertOptions fields (or pass
        options=ConvertOptions(...)); see `mha2gqa.convert.run.convert`."""
        from mha2gqa.convert.run import convert

        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
