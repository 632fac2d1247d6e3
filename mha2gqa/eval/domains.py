"""Quality over several domains: each text of --data is measured apart, and these functions sum them up.

- pooled: the token-weighted mean of the per-domain sums, as if the texts were one stream (what a single
  --data folder always gave);
- the summary: the geometric mean of the per-domain perplexity ratios to the reference. A ratio is
  multiplicative, so its mean is geometric: 2x worse on one domain and 2x better on another is 1x, and a
  long text does not outweigh a short one, as it would in the pooled number.
"""

from __future__ import annotations

import hashlib
import math


def geomean(values) -> float | None:
    values = list(values)
    if not values or any(v is None or v <= 0 for v in values):
        return None
    return math.exp(sum(math.log(v) for v in values) / len(values))


def ratios(per: dict) -> dict[str, float]:
    """{domain: perplexity / the reference's} for every domain measured against a reference."""
    found = {}
    for name, d in per.items():
        agree, ppl = d.get("agreement") or {}, (d.get("perplexity") or {}).get("perplexity")
        if ppl is not None and agree.get("reference_perplexity"):
            found[name] = ppl / agree["reference_perplexity"]
    return found


def summary(per: dict) -> dict | None:
    """The one number over all domains: the geometric mean of the perplexity ratios to the reference, with
    the worst domain beside it (None without a reference)."""
    found = ratios(per)
    if not found or len(found) < len(per):
        return None
    worst = max(found, key=found.get)
    return {
        "geomean_perplexity_ratio": geomean(found.values()),
        "perplexity_ratios": found,
        "worst_domain": worst,
        "worst_ratio": found[worst],
        "domains": len(found),
    }


def pooled_perplexity(per: dict) -> dict:
    parts = [d["perplexity"] for d in per.values()]
    tokens = sum(p["tokens_scored"] for p in parts)
    nll = sum(p["nll_per_token"] * p["tokens_scored"] for p in parts) / tokens
    first = parts[0]
    return {
        "perplexity": math.exp(nll),
        "nll_per_token": nll,
        "tokens_scored": tokens,
        "context": first["context"],
        "stride": first["stride"],
        "windows": sum(p["windows"] for p in parts),
        "pooled_over": list(per),
    }


def pooled_agreement(per: dict) -> dict | None:
    parts = [d["agreement"] for d in per.values()]
    if any(a is None for a in parts):
        return None
    tokens = sum(a["tokens"] for a in parts)
    ref_nll = sum(math.log(a["reference_perplexity"]) * a["tokens"] for a in parts) / tokens
    return {
        "kl_mean": sum(a["kl_mean"] * a["tokens"] for a in parts) / tokens,
        "top1_agreement": sum(a["top1_agreement"] * a["tokens"] for a in parts) / tokens,
        "tokens": tokens,
        "reference_perplexity": math.exp(ref_nll),
        "pooled_over": list(per),
    }


def pooled_data(per: dict) -> dict:
    """The identity of all the texts together: equal digests mean the same domains, names and token ids."""
    digest = hashlib.sha256()
    for name, d in per.items():
        digest.update(f"{name}\0{d['data']['ids_sha256']}\0".encode())
    datas = [d["data"] for d in per.values()]
    return {
        "source": "domains",
        "domains": list(per),
        "documents": sum(d["documents"] for d in datas),
        "tokens": sum(d["tokens"] for d in datas),
        "max_tokens": datas[0].get("max_tokens"),
        "ids_sha256": digest.hexdigest(),
        "tokenizer": datas[0].get("tokenizer"),
    }


def shared_ratios(result: dict, base: dict) -> dict[str, float]:
    """{domain: perplexity / the baseline result's} over the domains both measured on the same token ids."""
    mine, theirs = result.get("domains") or {}, base.get("domains") or {}
    found = {}
    for name, d in mine.items():
        other = theirs.get(name)
        if not isinstance(other, dict) or not isinstance(d, dict):
            continue
        same = (d.get("data") or {}).get("ids_sha256") == (other.get("data") or {}).get("ids_sha256")
        a, b = (d.get("perplexity") or {}).get("perplexity"), (other.get("perplexity") or {}).get("perplexity")
        if same and a is not None and b:
            found[name] = a / b
    return found
