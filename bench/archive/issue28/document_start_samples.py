"""Issue 28 (2026-12-02): 32 blocks of 512 sampled from SMOLLM2, DOC_SHARE of them opened by <|endoftext|>
(id 0, SmolLM2's document separator; every token sampled), the rest chat turns, interleaved; seed 7; saved to
WORK/nat32-doc{DOC_SHARE}.pt for extra_fit.py (CACHE=...).

    SMOLLM2=... WORK=dir python bench/archive/issue28/document_start_samples.py 0.5
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mha2gqa.convert import sampling
from mha2gqa.convert.inputs import interleaved

torch.set_num_threads(2)
doc_share = float(sys.argv[1])
m = AutoModelForCausalLM.from_pretrained(os.environ["SMOLLM2"], dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(os.environ["SMOLLM2"])
g = torch.Generator().manual_seed(7)
bar = type("NoBar", (), {"update": lambda self, n: None})()
r = sampling.SamplingRecipe()
n_doc = round(32 * doc_share)
rows = []
if n_doc:
    openings = [torch.zeros(min(16, n_doc - s), 1, dtype=torch.long) for s in range(0, n_doc, 16)]
    rows.append(torch.cat([sampling.sample_batch(m, o, 512, 0, r, g, "cpu", bar) for o in openings]))
if 32 - n_doc:
    header = sampling.chat_turn_header(tok, 512)
    openings = [header.expand(min(16, 32 - n_doc - s), -1) for s in range(0, 32 - n_doc, 16)]
    rows.append(torch.cat([sampling.sample_batch(m, o, 512, 0, r, g, "cpu", bar) for o in openings]))
nat = torch.stack([rows[p][i] for p, i in interleaved([len(x) for x in rows])])
torch.save(nat, f"{os.environ['WORK']}/nat32-doc{doc_share}.pt")
