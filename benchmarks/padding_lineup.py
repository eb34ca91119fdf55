"""Long dynamic-padding runs: how much of the profile each call lines up, call after call.

Hugging Face GPT-2 and Llama of `robust_models.py`, profiled at length 16 (`--device fake:cpu`)
and planned at 0.5, patched in place; `--steps` AdamW training calls (default 200) at lengths
drawn from run_robustness.LENGTHS (seed 0), with no attention mask ("unpadded") or with one
that pads the second sequence by 0 to length/2 - 1 tokens ("padded", labels -100 there). Per
run: how many calls lined up less than all of the profile's forward ops, which, and the
(length, lined up, expected) counts of the calls after the first two. Writes
benchmarks/results/padding_lineup.json and .md.

    PYTHONPATH=$PWD python benchmarks/padding_lineup.py [--steps 200]
"""
from __future__ import annotations

import argparse
import collections
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402
import torch  # noqa: E402

from benchmarks.run_robustness import LENGTHS, patched_model  # noqa: E402


def run(name: str, padded: bool, steps: int, tmp: Path) -> dict:
    work, state, _ = patched_model(name, tmp)
    rng = random.Random(0)
    opt = torch.optim.AdamW(work.model.parameters(), lr=1e-3)
    calls = []
    for step in range(steps):
        seq = rng.choice(LENGTHS)
        ids = torch.randint(1, 128, (2, seq))
        kw = {"input_ids": ids, "labels": ids.clone()}
        if padded:
            mask, n = torch.ones_like(ids), rng.randrange(0, seq // 2)
            if n:
                mask[1, -n:] = 0
                kw["labels"][1, -n:] = -100
            kw["attention_mask"] = mask
        out = work.model(**kw)
        rep = state.last_report
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        calls.append({"step": step, "seq": seq, "call": type(state.last_run).__name__,
                      "lined_up": rep["lined_up"], "expected": rep["expected"]})
    below = [c for c in calls if c["lined_up"] < c["expected"]]
    counts = collections.Counter((c["seq"], c["lined_up"], c["expected"]) for c in calls[2:])
    return {"model": name, "padded": padded, "steps": steps, "below_all": below,
            "after_first_two": [[*k, v] for k, v in sorted(counts.items())]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "padding_lineup"))
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for name in ("gpt2", "llama"):
            for padded in (False, True):
                rows.append(run(name, padded, a.steps, Path(d)))
                r = rows[-1]
                print(r["model"], "padded" if padded else "unpadded", len(r["below_all"]),
                      flush=True)
    Path(a.out + ".json").write_bytes(orjson.dumps(rows, option=orjson.OPT_INDENT_2))
    lines = ["# Long dynamic-padding runs: lined-up ops per call", "",
             f"`python benchmarks/padding_lineup.py --steps {a.steps}` (see its docstring).", "",
             "| model | mask | calls | below 100% (step, length, lined up / expected) | "
             "later calls: length lined up/expected x calls |", "|---|---|---|---|---|"]
    for r in rows:
        below = ", ".join(f"{c['step']}: {c['seq']} {c['lined_up']}/{c['expected']}"
                          for c in r["below_all"]) or "-"
        later = ", ".join(f"{s} {n}/{e} x{k}" for s, n, e, k in r["after_first_two"])
        lines.append(f"| {r['model']} | {'padded' if r['padded'] else 'none'} | {r['steps']} | "
                     f"{below} | {later} |")
    Path(a.out + ".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
