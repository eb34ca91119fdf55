"""FSDP2 x TP x PP on 8 CPU ranks (gloo, a 2 x 2 x 2 DeviceMesh): a Llama-style model in two
pipeline stages, each stage's blocks tensor parallel and every stage module FSDP2-sharded
(slackswap_testkit/three_d_run.py), each rank planned on its local shards for its per-rank
activation budget, then three AdamW steps under 1F1B, unpatched and patched. Per rank: its mesh
coordinates, its static memory (parameter, gradient and AdamW state shards, and what FSDP2
holds unsharded through a pipeline step), its activation budget, the keep-all and planned peaks
predicted and measured (steps 2 and 3: the first also allocates the receive buffers), the
measured peak over the budget, and whether it trained bit for bit as the unpatched run.

    nice -n 19 python benchmarks/three_d_ranks.py            # 0.6 of each rank's keep-all peak
    nice -n 19 python benchmarks/three_d_ranks.py 300000     # bytes per rank

Minutes on two shared cores (8 processes). Writes benchmarks/results/three_d_ranks.{json,md}
(a budget given: three_d_ranks_<budget>.{json,md}).
"""
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slackswap_testkit import three_d_run  # noqa: E402
from slackswap_testkit.pipeline_run import same  # noqa: E402

COLUMNS = ("rank", "pp, dp, tp", "held", "static", "budget", "keep-all predicted / measured",
           "planned / measured", "measured / budget", "swapped + recomputed", "bitwise")


def records(ranks) -> list[dict]:
    out = []
    for rank, res in enumerate(ranks):
        row, plain, patched = res["row"], res["plain"], res["patched"]
        static = patched["static"]
        keep, planned = max(plain["peaks"][1:]), max(patched["peaks"][1:])
        out.append({"rank": rank, "coords": res["coords"], "held": row["held"],
                    "held_counted": patched["held"], "static": static,
                    "static_bytes": sum(static.values()), "budget": row["budget_bytes"],
                    "keep_all_predicted": row["keep_all_peak_bytes"], "keep_all_measured": keep,
                    "planned_peak": row["planned_peak_bytes"], "planned_measured": planned,
                    "over_budget": round(planned / row["budget_bytes"], 4),
                    "swapped_bytes": row["swapped_bytes"],
                    "recomputed_bytes": row["recomputed_bytes"],
                    "bitwise": same(plain, patched), "plan_s": round(res["plan_s"], 1)})
    return out


def table(recs: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in recs:
        c, s = r["coords"], r["static"]
        lines.append(
            f"| {r['rank']} | {c['pp']}, {c['dp']}, {c['tp']} | {r['held']} | "
            f"{r['static_bytes']} ({s['params']} + {s['grads']} + {s['optimizer']} + "
            f"{s['unsharded']}) | {r['budget']} | {r['keep_all_predicted']} / "
            f"{r['keep_all_measured']} | {r['planned_peak']} / {r['planned_measured']} | "
            f"{r['over_budget']:.3f} | {r['swapped_bytes']} + {r['recomputed_bytes']} | "
            f"{'yes' if r['bitwise'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    budget = int(argv[0]) if argv else 0.6
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        recs = records(three_d_run.run(budget, tmp))
    wall = time.perf_counter() - started
    name = "three_d_ranks" + (f"_{argv[0]}" if argv else "")
    out = ROOT / "benchmarks" / "results"
    (out / f"{name}.json").write_text(json.dumps({"budget": budget, "wall_s": round(wall, 1),
                                                  "ranks": recs}, indent=1) + "\n")
    text = (f"# FSDP2 x TP x PP, 2 x 2 x 2 gloo ranks, budget {budget} per rank\n\n"
            f"`python benchmarks/three_d_ranks.py{' ' + argv[0] if argv else ''}` "
            f"({wall:.0f} s). Bytes; static: parameter + gradient + AdamW state shards + "
            "FSDP2's unsharded parameters and gradients during a step.\n\n" + table(recs) + "\n")
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
