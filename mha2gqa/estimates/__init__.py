"""How long a run will take and how much memory it needs, said before it starts, corrected as it runs, and
what it took at the end: every command that can run past a minute (convert, eval, uptrain, demo, sweep).

- rates.py: the measured rates (mha2gqa/data/estimate_rates.json, re-made by bench/estimate_rates.py) and the
  probe that scales them to this machine now;
- stages.py: each command's stages declared once (the names its plan, its estimate and its clock use);
- costs.py: each command's stages as work, the estimate line, and for_this_machine: the one way a command's
  estimate meets the machine (a probe only for a run long enough to be worth one, rates.this_machine);
- clock.py: the run's clock: the estimate said, the remaining time corrected, the time taken.
"""

from __future__ import annotations

from mha2gqa.estimates.costs import (  # noqa: F401 (the package's API)
    CALIBRATION_STAGES,
    CAVEAT,
    CHARS_PER_TOKEN,
    COMPRESSION,
    ConvertWork,
    Estimate,
    EvalWork,
    Part,
    RefineWork,
    StageCost,
    UptrainWork,
    check_parts,
    combined,
    convert_line,
    convert_parts,
    duration,
    eval_peak_bytes,
    eval_stages,
    for_this_machine,
    retrieval_part,
    text_tokens,
    took,
    uptrain_stages,
)
from mha2gqa.estimates.rates import LARGE, SMALL, STORED, Machine  # noqa: F401
