"""ARCHIVED (issue 27): not maintained, not tested. The prototype that measured issue 20's refine variants on
the real model (docs/refine-results.md, "The variants, on a proxy"), before the package had them: layer-wise refinement of the first --layers layers of a merged SmolLM2, in memory, llama layout
only, then optionally a global KL stage; Persuasion and Python-docs perplexity at the end.

    python bench/archive/refine_real_proxy.py MERGED OUT.json --layers 9 --refine-tokens 16384 --steps 20 \
        --docs-tokens 2048 [--mlp solve --mlp-weight token] [--global-steps 10 --global-bb 2 --global-lr 1e-4]

MERGED: a `mha2gqa convert SRC MERGED -g 1 --method calibrated --calibration austen
--calibration-tokens 32768` of the real model in $SMOLLM2 (bench/refine_real.py says how to build
it). The package's own stages (convert/refine*.py) are what ships; this proxy refines fewer layers with
fewer tokens and steps, so that variants can be compared on a 2-core machine.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/
from calibrated_merge import heldout_ids  # noqa: E402
from refine_real import real_model_from_env  # noqa: E402

from mha2gqa.convert.calibration import tokenize  # noqa: E402
from mha2gqa.eval.perplexity import perplexity  # noqa: E402

S = 512


def docs_ids(tokenizer, n):
    import pydoc_data.topics as t

    text = "\n\n".join(t.topics[k] for k in sorted(t.topics))
    return torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][:n])


def ppl(model, ids):
    return perplexity(model, ids, context=512, stride=512, batch_size=8)["perplexity"]


def batch_one(value, batch: int):
    """Captured call arguments with any per-sequence batch dim cut to 1 (a copy of the package's own helper,
    which is private): every block has the same positions and no padding, so they broadcast to any batch."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch and batch > 1:
        return value[:1]
    if isinstance(value, tuple):
        return tuple(batch_one(v, batch) for v in value)
    return value


def layer_kwargs(model, block):
    """The keyword arguments the model passes to its layers, from one forward of one block."""
    got = {}

    def hook(module, a, kw):
        got.update({key: batch_one(value, 1) for key, value in kw.items() if key != "hidden_states"})
        raise StopIteration

    h = model.model.layers[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model.model(block, use_cache=False)
    except StopIteration:
        pass
    h.remove()
    return got


def attn_out(layer, x, kw):
    return layer.self_attn(
        hidden_states=layer.input_layernorm(x),
        position_embeddings=kw["position_embeddings"],
        attention_mask=kw["attention_mask"],
    )[0]


def weights_for(hp, mode):
    # hp: (B,S,d) parent residual at the point the error is measured; per-token loss weights (B,S)
    if mode == "none":
        return None
    if mode == "token":
        w = 1.0 / hp.pow(2).mean(-1)
        return w / w.mean()
    if mode == "skip0":
        w = torch.ones(hp.shape[:2])
        w[:, 0] = 0
        return w
    raise ValueError(mode)


def wmse(out, t, w):
    e = (out - t).pow(2).sum(-1)
    return (e * w).sum() if w is not None else e.sum()


def fit_attn(layer, X, T, W, fit, args, gen):
    attn = layer.self_attn
    params = list(attn.parameters())
    for p in params:
        p.requires_grad_(True)
    power = float(sum(wmse(T[c], 0 * T[c], None if W is None else W[c]) for c in fit.split(8))) / len(fit)
    opt = torch.optim.Adam(params, lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * s / max(1, args.steps))))
    order = torch.empty(0, dtype=torch.long)
    for _ in range(args.steps):
        if len(order) < args.bb:
            order = torch.cat([order, fit[torch.randperm(len(fit), generator=gen)]])
        c, order = order[: args.bb], order[args.bb :]
        out = attn_out(layer, X[c], args.kw)
        loss = wmse(out, T[c], None if W is None else W[c]) / (power * len(c) / 1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    for p in params:
        p.requires_grad_(False)
    # o_proj least squares (weighted)
    o = attn.o_proj
    z = {}
    h = o.register_forward_pre_hook(lambda m, a: z.update(z=a[0]))
    G = torch.zeros(576, 576, dtype=torch.float64)
    R = torch.zeros(576, 576, dtype=torch.float64)
    with torch.no_grad():
        for c in fit.split(8):
            attn_out(layer, X[c], args.kw)
            a = z["z"].reshape(-1, 576).double()
            t = T[c].reshape(-1, 576).double()
            if W is not None:
                s = W[c].reshape(-1, 1).double().sqrt()
                a, t = a * s, t * s
            G += a.T @ a
            R += a.T @ t
    h.remove()
    sol = torch.linalg.solve(G + 1e-6 * G.diagonal().mean() * torch.eye(576, dtype=torch.float64), R)
    with torch.no_grad():
        o.weight.copy_(sol.T)


def solve_down(layer, M, T, W, fit):
    """down_proj by weighted least squares so that M + mlp(norm(M)) ~= T (llama: additive)."""
    mlp = layer.mlp
    width = mlp.down_proj.weight.shape[1]
    G = torch.zeros(width, width, dtype=torch.float64)
    R = torch.zeros(width, 576, dtype=torch.float64)
    with torch.no_grad():
        for c in fit.split(8):
            x = layer.post_attention_layernorm(M[c])
            a = (mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x)).reshape(-1, width).double()
            t = (T[c] - M[c]).reshape(-1, 576).double()
            if W is not None:
                s = W[c].reshape(-1, 1).double().sqrt()
                a, t = a * s, t * s
            G += a.T @ a
            R += a.T @ t
    sol = torch.linalg.solve(G + 1e-6 * G.diagonal().mean() * torch.eye(width, dtype=torch.float64), R)
    with torch.no_grad():
        mlp.down_proj.weight.copy_(sol.T)


def _first(o):
    return o[0] if isinstance(o, tuple) else o


def run_capture(layer, H, kw, n):
    """The layer's output and its attention module's output, for every block."""
    got = []
    h = layer.self_attn.register_forward_hook(lambda m, a, out: got.append(out[0]))
    outs = torch.cat([_first(layer(H[c], **kw)) for c in torch.arange(n).split(8)])
    h.remove()
    return torch.cat(got), outs


def rel(a, b, idx, W=None):
    e = (a[idx] - b[idx]).pow(2).sum(-1)
    t = b[idx].pow(2).sum(-1)
    return float(e.sum() / t.sum())


def main():
    src = real_model_from_env()  # the real model, $SMOLLM2
    ap = argparse.ArgumentParser()
    ap.add_argument("merged")
    ap.add_argument("out")
    ap.add_argument("--cal-tokens", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--refine-tokens", type=int, default=64 * 576)
    ap.add_argument("--docs-tokens", type=int, default=4096)
    ap.add_argument("--attn-target", default="attention")
    ap.add_argument("--weight", default="none")
    ap.add_argument("--mlp", default="none")
    ap.add_argument("--mlp-weight", default="token")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bb", type=int, default=4)
    ap.add_argument("--global-steps", type=int, default=0)
    ap.add_argument("--global-lr", type=float, default=1e-4)
    ap.add_argument("--global-bb", type=int, default=4)
    ap.add_argument("--global-params", default="attn")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--save", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    t0, c0 = time.perf_counter(), time.process_time()
    torch.set_grad_enabled(True)
    P = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval().requires_grad_(False)
    C = AutoModelForCausalLM.from_pretrained(args.merged, dtype=torch.float32).eval().requires_grad_(False)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(src)
    from mha2gqa.embedded import expand_corpus_name

    ids = tokenize(src, expand_corpus_name("austen"), args.cal_tokens)
    blocks = ids[: len(ids) // S * S].view(-1, S)
    want = args.refine_tokens // S
    if len(blocks) > want:
        blocks = blocks[torch.linspace(0, len(blocks) - 1, want).round().long()]
    n = len(blocks)
    held = max(1, round(n / 8))
    fit, hold = torch.arange(n - held), torch.arange(n - held, n)
    with torch.no_grad():
        HP = P.model.embed_tokens(blocks).float()
    HC = HP.clone()
    args.kw = layer_kwargs(P, blocks[:1])
    rows = []
    for i in range(args.layers):
        lp, lc = P.model.layers[i], C.model.layers[i]
        with torch.no_grad():
            AP, HP_next = run_capture(lp, HP, args.kw, n)
            MP = HP + AP
            AC0 = torch.cat([attn_out(lc, HC[c], args.kw) for c in torch.arange(n).split(8)])
        T = AP if args.attn_target == "attention" else MP - HC
        W = weights_for(MP, args.weight)
        before = (rel(AC0, AP, fit), rel(AC0, AP, hold), rel(HC + AC0, MP, hold))
        fit_attn(lc, HC, T, W, fit, args, gen)
        with torch.no_grad():
            AC, HC_next = run_capture(lc, HC, args.kw, n)
            MC = HC + AC
        if args.mlp == "solve":
            solve_down(lc, MC, HP_next, weights_for(HP_next, args.mlp_weight), fit)
            with torch.no_grad():
                HC_next = torch.cat(
                    [MC[c] + lc.mlp(lc.post_attention_layernorm(MC[c])) for c in torch.arange(n).split(8)]
                )
        after = (rel(AC, AP, fit), rel(AC, AP, hold), rel(MC, MP, hold))
        row = dict(
            layer=i,
            attn_fit_before=before[0],
            attn_held_before=before[1],
            attn_fit_after=after[0],
            attn_held_after=after[1],
            mid_held_before=before[2],
            mid_held_after=after[2],
            out_fit=rel(HC_next, HP_next, fit),
            out_held=rel(HC_next, HP_next, hold),
            s=round(time.perf_counter() - t0, 1),
        )
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        HP, HC = HP_next, HC_next
    t_layer = time.perf_counter() - t0
    result = dict(args={k: v for k, v in vars(args).items() if k != "kw"}, layers=rows, layerwise_s=t_layer)
    if args.global_steps:
        result["global"] = global_stage(P, C, blocks, fit, hold, args, gen)
    result["wall_s"] = time.perf_counter() - t0
    result["cpu_s"] = time.process_time() - c0
    C.eval()
    with torch.no_grad():
        result["ppl_persuasion"] = ppl(C, heldout_ids(src, None, args.eval_tokens))
        result["ppl_docs"] = ppl(C, docs_ids(tok, args.docs_tokens))
    print(json.dumps({k: v for k, v in result.items() if k not in ("layers",)}), flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.save:
        C.save_pretrained(args.save)


def kl(p_logits, c_logits):
    lp = p_logits.log_softmax(-1)
    return (lp.exp() * (lp - c_logits.log_softmax(-1))).sum(-1).mean()


def global_stage(P, C, blocks, fit, hold, args, gen):
    names = ("self_attn",) if args.global_params == "attn" else ("self_attn", "mlp")
    params = [p for n, p in C.named_parameters() if any(f".{k}." in n for k in names)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=args.global_lr)
    steps = args.global_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 4) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )

    def held_kl():
        with torch.no_grad():
            tot = 0.0
            for c in hold.split(4):
                tot += float(kl(P(blocks[c]).logits, C(blocks[c]).logits)) * len(c)
            return tot / len(hold)

    log = [dict(step=0, heldout_kl=held_kl())]
    print(json.dumps(log[-1]), flush=True)
    best = (log[0]["heldout_kl"], [p.detach().clone() for p in params])
    order = torch.empty(0, dtype=torch.long)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        if len(order) < args.global_bb:
            order = torch.cat([order, fit[torch.randperm(len(fit), generator=gen)]])
        c, order = order[: args.global_bb], order[args.global_bb :]
        with torch.no_grad():
            pl = P(blocks[c]).logits
        loss = kl(pl, C(blocks[c]).logits)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 5 == 0 or step == steps:
            h = held_kl()
            log.append(dict(step=step, fit_kl=float(loss), heldout_kl=h, s=round(time.perf_counter() - t0, 1)))
            print(json.dumps(log[-1]), flush=True)
            if h < best[0]:
                best = (h, [p.detach().clone() for p in params])
    with torch.no_grad():
        for p, b in zip(params, best[1]):
            p.copy_(b)
    for p in params:
        p.requires_grad_(False)
    return dict(log=log, best_heldout_kl=best[0])


if __name__ == "__main__":
    main()
