"""Issue 28 (2026-12-02): where a conversion loses on each probe domain: the mean loss of the parent (SMOLLM2)
and of CONVERTED on the tokens whose bigram already occurred earlier in the 512-token window (copyable) and
on the others, over each domain's first 4,096 tokens.

    SMOLLM2=... CONVERTED=... python bench/archive/issue28/copy_diagnosis.py
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from calibrated_merge import load_float32  # noqa: E402
from calibration_domains import probe_ids  # noqa: E402

torch.set_num_threads(2)
P = os.environ["SMOLLM2"]
sets = probe_ids(P, 4096)
models = {"parent": load_float32(P), "default": load_float32(os.environ["CONVERTED"])}
for dom, ids in sets.items():
    win = ids[: len(ids) // 512 * 512].view(-1, 512)
    copyable = torch.zeros(win.shape[0], 511, dtype=torch.bool)
    for w in range(win.shape[0]):
        seen, row = set(), win[w].tolist()
        for i in range(1, 512):
            copyable[w, i - 1] = (row[i - 1], row[i]) in seen
            seen.add((row[i - 1], row[i]))
    res = {}
    for n, m in models.items():
        with torch.no_grad():
            lg = m(win).logits[:, :-1]
        loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), win[:, 1:].reshape(-1), reduction="none")
        loss = loss.view(win.shape[0], -1)
        res[n] = (loss[copyable].mean().item(), loss[~copyable].mean().item())
    print(dom, f"copyable share {copyable.float().mean().item():.2f}", res, flush=True)
