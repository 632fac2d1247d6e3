"""sweep.json, the record `mha2gqa sweep` writes (sweep/folder.py, sweep/run.py) and `mha2gqa report` reads
(report/results.py): beside its writer; the report sits above the sweep and imports it from here.

Top-level keys:
  schema          "mha2gqa.sweep/1"
  source          path, resolved, config_sha256, model_type, kv_heads, lineage
  settings        the SweepOptions (asdict), as run, and tokens_per_hidden: what unset token counts meant
  context         the model's max_position_embeddings (KV bytes per sequence are given at it)
  planned         candidate names, in the order they run
  parent          {perplexity, kv_bytes_per_token, kv_bytes_per_sequence, result}: `result` is an eval result
  calibration     the calibration statistics' record (tokens, sources)
  candidates      [{name, groups, method, perplexity, perplexity_change, kl_mean, top1_agreement, kv_*,
                  convert_wall_s, convert_peak_rss_bytes, eval_wall_s, model, merge_layers, refine, result}]
  not_asked       finished candidates of an earlier run that a --resume did not ask for: checked, kept, marked
                  asked: false, outside the table (sweep/trust.py)
  interrupted     true when the sweep was stopped before every candidate ran
  recommendation  per_method, next, summary, line (sweep/run.py recommend)
  versions, created, wall_s
"""

from __future__ import annotations

SWEEP_SCHEMA = "mha2gqa.sweep/1"
