"""Issue 28's extra-fit experiments (2026-12-02): from a converted folder (CONVERTED, the default SmolLM2 MQA
conversion), more steps of the global KL stage (fit_global, the package's own) on 32 (or CACHE's) blocks of
512 sampled from the parent (SMOLLM2), then the probe domains' perplexity ratios and the induction probe.

    SMOLLM2=... CONVERTED=... WORK=dir python bench/archive/issue28/extra_fit.py VARIANT STEPS LR PARAMS CHAT

VARIANT: `samples` (the sampled blocks alone) or `repeats` (each followed by a copy block: a segment of 16-256
tokens repeated to 512, odd ones random tokens, even ones from the sampled block); PARAMS: `attn` (the
attention's, as the global stage) or `all` (every decoder layer's); CHAT: the recipe's chat_share. The last
4 blocks are held out. The samples were drawn with the draw of before eb000cc (whole-batch sort).
"""

import json
import math
import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from calibrated_merge import load_float32, loaded_perplexity  # noqa: E402
from calibration_domains import probe_ids  # noqa: E402

from mha2gqa.convert.refine.global_stage import GlobalFit, fit_global  # noqa: E402
from mha2gqa.convert.sampling import SamplingRecipe, first_token_pool, sample_ids  # noqa: E402

torch.set_num_threads(2)
variant, steps, lr, which, chat = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], float(sys.argv[5])
P, C, WORK = os.environ["SMOLLM2"], os.environ["CONVERTED"], os.environ["WORK"]
tok = AutoTokenizer.from_pretrained(P)
parent, model = load_float32(P), load_float32(C)
for p in [*parent.parameters(), *model.parameters()]:
    p.requires_grad_(False)
cache = os.environ.get("CACHE") or f"{WORK}/nat32-chat{chat}.pt"
if os.path.exists(cache):
    nat = torch.load(cache)
else:
    recipe = SamplingRecipe(chat_share=chat)
    nat = sample_ids(parent, tok, 32 * 512, 512, seed=7, recipe=recipe, progress=False).view(32, 512)
    torch.save(nat, cache)
g = torch.Generator().manual_seed(1)
pool = first_token_pool(tok, parent.config.vocab_size)
blocks = [nat[i] for i in range(len(nat))]
if variant == "repeats":
    extra = []
    for i in range(len(nat)):
        n = int(torch.randint(16, 257, (1,), generator=g))
        seg = pool[torch.randint(len(pool), (n,), generator=g)] if i % 2 else nat[i][:n]
        extra.append(seg.repeat(-(-512 // len(seg)))[:512])
    blocks = [b for pair in zip(blocks, extra) for b in pair]
blocks = torch.stack(blocks)
n = len(blocks)
split = {"heldout": torch.arange(n - 4, n), "fit": torch.arange(n - 4)}
params = [
    p for name, p in model.named_parameters() if (".self_attn." in name if which == "attn" else ".layers." in name)
]
t0 = time.time()
rec = fit_global(
    parent, model, params, blocks, split, GlobalFit(steps, lr), torch.Generator().manual_seed(0), progress=False
)
print("fit", time.time() - t0, json.dumps(rec["checks"]), flush=True)
sets = probe_ids(P, 4096)
parent_ppl = {k: loaded_perplexity(parent, v, 512) for k, v in sets.items()}
ratios = {k: loaded_perplexity(model.eval(), v, 512) / parent_ppl[k] for k, v in sets.items()}
geo = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
print(variant, steps, lr, which, chat, {k: round(v, 3) for k, v in ratios.items()}, "geo", round(geo, 3))
ids = torch.randint(1000, 40000, (4, 128), generator=torch.Generator().manual_seed(0))
x = torch.cat([ids, ids], 1)
with torch.no_grad():
    lg = model(x).logits[:, :-1]
loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1), reduction="none")
print("induction second half loss", loss.view(4, -1)[:, 128:].mean().item())
