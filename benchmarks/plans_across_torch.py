"""Do plans depend on the torch version that traced the profile? Compares the shipped samples
(`sample_profiles/*.json`, traced on torch 2.13) with the same workloads re-profiled on another
torch (`--device fake --hardware a100-pcie4`, as `make samples` does, into `--other DIR`): per
sample, the op counts that differ (what each torch's make_fx records), the keep-all peak, and,
at budgets 0.1 .. 1.0 with the slackswap planner, whether the decisions are the same tensor by
tensor (tensor ids line up where both traces have the same ops in the same order) and the
predicted retention.

    # on the other torch (a second venv, `make test-torch` builds one):
    .venv-torch-2.15.0/bin/slackswap profile examples/bert_large.py --device fake \\
        --hardware a100-pcie4 -o other/bert-large.json          # ... and the other three
    python benchmarks/plans_across_torch.py --other other --label 2.15.0

Writes `<out>/plans_across_torch.md` and `.json`.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import orjson  # noqa: E402

from slackswap_cli.hardware import PRESETS  # noqa: E402
from slackswap_cli.planners import make_plan  # noqa: E402
from slackswap_cli.schema import load_profile, write_atomic  # noqa: E402

SAMPLES = ("bert-large", "gpt2-xl", "llama-7b", "resnet50")
BUDGETS = tuple(round(0.1 * k, 1) for k in range(1, 11))
HW = PRESETS["a100-pcie4"]


def compare(name: str, other: Path) -> dict:
    a = load_profile(ROOT / "sample_profiles" / f"{name}.json")
    b = load_profile(other / f"{name}.json")
    ca, cb = Counter(o.target for o in a.ops), Counter(o.target for o in b.ops)
    ops_differ = {k: [ca.get(k, 0), cb.get(k, 0)] for k in sorted(set(ca) | set(cb))
                  if ca.get(k, 0) != cb.get(k, 0)}
    rows = []
    for f in BUDGETS:
        pa = make_plan("slackswap", a, HW, int(f * a.keep_all_peak_bytes), f)
        pb = make_plan("slackswap", b, HW, int(f * b.keep_all_peak_bytes), f)
        same = ({(d.tensor, d.action) for d in pa.decisions}
                == {(d.tensor, d.action) for d in pb.decisions})
        rows.append({"budget": f, "same_decisions": same,
                     "retention": [pa.predicted.retention, pb.predicted.retention]})
    return {"sample": name, "torch": [a.env.get("torch_version"), b.env.get("torch_version")],
            "ops": [len(a.ops), len(b.ops)], "ops_differ": ops_differ,
            "keep_all_peak_bytes": [a.keep_all_peak_bytes, b.keep_all_peak_bytes],
            "budgets": rows}


def markdown(results: list[dict], label: str) -> str:
    out = [f"# Plans on profiles traced by torch 2.13 and {label}\n",
           "`python benchmarks/plans_across_torch.py`: the slackswap planner at budgets "
           "0.1-1.0 (a100-pcie4) on each sample as shipped and as re-profiled.\n",
           "| sample | torch | ops | ops that differ (count, count) | keep-all peak | "
           "same decisions at 0.1-1.0 | retention at 0.5 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        half = next(x for x in r["budgets"] if x["budget"] == 0.5)["retention"]
        same = sum(x["same_decisions"] for x in r["budgets"])
        differ = ", ".join(f"`{k}` {v[0]} / {v[1]}" for k, v in r["ops_differ"].items())
        out.append(f"| {r['sample']} | {' / '.join(map(str, r['torch']))} | "
                   f"{r['ops'][0]} / {r['ops'][1]} | {differ or '-'} | "
                   f"{'same' if len(set(r['keep_all_peak_bytes'])) == 1 else r['keep_all_peak_bytes']} | "
                   f"{same} of {len(r['budgets'])} | {half[0]:.4f} / {half[1]:.4f} |")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", help="folder of the re-profiled samples (needs another torch: "
                    "without it, as in `make bench`, nothing is run)")
    ap.add_argument("--label", default="the other torch")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    a = ap.parse_args()
    if a.other is None:
        print("plans_across_torch: skipped (pass --other DIR: the samples profiled on another "
              "torch, see this script's docstring)", file=sys.stderr)
        return
    results = [compare(name, Path(a.other)) for name in SAMPLES]
    out = Path(a.out)
    write_atomic(out / "plans_across_torch.json", orjson.dumps(results, option=orjson.OPT_INDENT_2))
    md = markdown(results, a.label)
    write_atomic(out / "plans_across_torch.md", md.encode())
    print(md)


if __name__ == "__main__":
    main()
