"""Part 7 of bench/gpu_check.py: bench/decode_paths_gpu.py, one decode step of MHA, GQA-8 and MQA (batch 64 x
context 2,048, bf16) on every attention path (transformers' default, eval's grouped, static cache, forced SDPA
backends, TRANSFORMERS_SDPA_FORCE_GQA=1, FlexAttention, torch.compile), a profile of one step of each, and the SDPA
priority order. Goal (issue 56): GQA-8 >= 2x MHA's tokens/s on the best path; recorded, not asserted."""

import json
import os

from gpu_common import MARKS

pytestmark = MARKS

MARGIN_S = 25  # of the part's limit: pytest's and torch's start, and writing the record


def test_decode_paths(part):
    import decode_paths_gpu

    out = part.work / "decode_paths.json"
    limit = float(os.environ.get("GPU_CHECK_LIMIT_S") or 0)
    deadline = ["--deadline-s", str(limit - MARGIN_S)] if limit and not part.smoke else []
    decode_paths_gpu.main(["--smoke"] * part.smoke + deadline + ["--out", str(out)])
    part.result = result = json.loads(out.read_text())
    for item in result["skipped"]:
        part.skip(item["what"], item["reason"])
    assert set(result["paths"]) | {s["what"] for s in result["skipped"]} == {p.name for p in decode_paths_gpu.PATHS}
    for name in ("dynamic", "grouped"):  # the default and eval's: they always run, and always first
        rows = result["paths"][name]["rows"]
        assert list(rows) == ["MHA", "GQA-8", "MQA"] and all(r["tokens_per_s"] > 0 for r in rows.values())
        assert all(result["profile"][name][m]["top"] for m in rows)
    assert result["sdpa_priority"] and result["best"]["gqa8_over_mha"] > 0
