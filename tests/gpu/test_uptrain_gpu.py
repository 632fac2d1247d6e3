"""Part 2 of bench/gpu_check.py: bench/uptrain_gpu.py --baseline (uptrain loop tokens/s and MFU at 1B bf16 with
torch.compile, against the hand-written loop): both loops train, at a finite rate."""

import json
import math

from gpu_common import MARKS, needs

pytestmark = MARKS


def test_uptrain_gpu(part):
    needs("datasets", "accelerate")
    import uptrain_gpu

    out = part.work / "uptrain_gpu.json"
    uptrain_gpu.main(["--baseline", "--json", str(out), *(["--smoke"] if part.smoke else [])])
    if part.smoke:
        part.skip("bf16, torch.compile and MFU", "need CUDA: --smoke trains fp32 eager on CPU")
    part.result = result = json.loads(out.read_text())
    assert result["uptrain_tok_s"] > 0 and result["hand_tok_s"] > 0, result
    assert math.isfinite(result["mfu"]) and math.isfinite(result["overhead"]), result
