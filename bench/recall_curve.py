"""The recovery curve of a retrieval uptraining (issue 67) as docs/uptrain.md shows it, from the runs' own metrics.jsonl.

A recipe with eval_retrieval and eval_domains (recipes/smollm2-recall-cpu.yaml) writes, at every eval, recall on
eval's probe and the four probe domains' perplexity beside the teacher's. This reads the eval lines of each run
named, prints one markdown table per run (tokens, recall and the parent's, recall per length, the answer's
log-probability, each domain's perplexity ratio and their geometric mean), and, given two runs, the ratio of
their geometric means at the tokens both reached (the first run's over the second's). --out keeps the eval lines.

    python bench/recall_curve.py with=runs/recall without=runs/no-recall --out bench/results/recall/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DOMAINS = ("prose", "code", "python_docs", "licences")


def eval_lines(run: Path) -> list[dict]:
    """The lines of run/metrics.jsonl that hold the probe's numbers, in step order."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [line for line in lines if "eval_recall" in line or "eval_domain_ppl" in line]


def table(lines: list[dict]) -> list[str]:
    """One markdown row per eval line."""
    head = "| tokens | recall (parent's) | recall by length | answer log-prob | "
    head += " | ".join(DOMAINS) + " | geometric mean |"
    rows = [head, "|" + "---:|" * (5 + len(DOMAINS))]
    for line in lines:
        recall = f"{line['eval_recall']:.0%} ({line['teacher_recall']:.0%})" if "eval_recall" in line else "-"
        lengths = " / ".join(f"{v:.0%}" for v in line.get("eval_recall_lengths", {}).values())
        mine, parent = line.get("eval_domain_ppl", {}), line.get("teacher_domain_ppl", {})
        ratios = [f"{mine[d] / parent[d]:.2f}x" if d in mine and d in parent else "-" for d in DOMAINS]
        geomean = line.get("eval_geomean_ppl_ratio")
        logprob = line.get("eval_answer_logprob")
        rows.append(
            f"| {line['tokens']:,} | {recall} | {lengths} | {'-' if logprob is None else f'{logprob:.2f}'} | "
            + " | ".join(ratios)
            + f" | **{'-' if geomean is None else f'{geomean:.2f}x'}** |"
        )
    return rows


def compare(first: list[dict], second: list[dict]) -> list[str]:
    """The first run's geometric mean ratio over the second's at each token count both evaluated."""
    theirs = {line["tokens"]: line.get("eval_geomean_ppl_ratio") for line in second}
    return [
        f"{line['tokens']:,} tokens: {line['eval_geomean_ppl_ratio'] / theirs[line['tokens']]:.3f}"
        for line in first
        if theirs.get(line["tokens"]) and line.get("eval_geomean_ppl_ratio")
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="NAME=OUTPUT_DIR of a run whose metrics.jsonl has the probe's lines")
    parser.add_argument("--out", type=Path, help="write {name: eval lines} here as JSON")
    args = parser.parse_args(argv)
    found = {}
    for spec in args.runs:
        name, _, folder = spec.rpartition("=")
        lines = eval_lines(Path(folder))
        if not lines:
            print(f"error: {folder}/metrics.jsonl holds no eval_retrieval or eval_domains line", file=sys.stderr)
            return 2
        found[name or folder] = lines
    for name, lines in found.items():
        print(f"\n{name}:\n" + "\n".join(table(lines)))
    if len(found) == 2:
        (a, first), (b, second) = found.items()
        print(f"\ngeometric mean ratio, {a} / {b}: " + "; ".join(compare(first, second)))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(found, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
