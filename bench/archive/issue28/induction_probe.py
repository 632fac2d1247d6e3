"""Issue 28 (2026-12-02): in-context copying, the induction probe: 4 sequences of 128 random tokens, each
repeated once; the loss on the repeat (a model that copies predicts it) of the parent (SMOLLM2) and each
converted folder given.

    SMOLLM2=... python bench/archive/issue28/induction_probe.py DIR [DIR ...]
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM

torch.set_num_threads(2)
ids = torch.randint(1000, 40000, (4, 128), generator=torch.Generator().manual_seed(0))
x = torch.cat([ids, ids], 1)
for path in [os.environ["SMOLLM2"], *sys.argv[1:]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(x).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="none"
    )
    loss = loss.view(4, -1)
    print(path, "first half", loss[:, :127].mean().item(), "repeat", loss[:, 128:].mean().item())
