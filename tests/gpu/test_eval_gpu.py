"""Part 1 of bench/gpu_check.py: bench/eval_gpu.py at full size (decode tokens/s of MHA, GQA-8 and MQA at batch
1..64 x context 2048, eager and CUDA graph, peak memory); the live KV cache must hold what the formula says."""

import json

from gpu_common import MARKS

pytestmark = MARKS


def test_eval_gpu(part):
    import eval_gpu

    out = part.work / "eval_gpu.json"
    eval_gpu.main(["--preset", "cpu-tiny" if part.smoke else "h200", "--out", str(out)])
    if part.smoke:
        part.skip("CUDA graphs", "need CUDA: on CPU the graph rows time a plain StaticCache decode")
    part.result = result = json.loads(out.read_text())
    caches = {v["kv_heads"]: v["kv_cache"] for v in result["variants"]}
    assert all(cache["match"] for cache in caches.values()), caches
    mha = max(caches)
    for kv, cache in caches.items():  # the cache shrinks with the kv heads, exactly
        assert cache["measured_bytes_per_token"] * mha == caches[mha]["measured_bytes_per_token"] * kv
    rates = [p["eager"]["tokens_per_s"] for v in result["variants"] for p in v["points"]]
    assert all(rate > 0 for rate in rates), rates
