"""Per-stage plans on real pipeline ranks (CPU, gloo): a GPT-style model split by hand into
stages (slackswap_testkit/pipeline_run.py), each rank planned for its budget knowing how many
microbatches the schedule holds there, run by torch's schedule patched and unpatched for three
AdamW steps. Per rank: microbatches held (read from the schedule, and counted on the run), the
keep-all peak predicted and measured (the unpatched run), the planned peak and the measured
one (the patched run), swapped and recomputed bytes per step, and whether the patched run
trained bit for bit as the unpatched one. Measured peaks are those of steps 2 and 3 (the first
step also allocates the stages' receive buffers).

    python benchmarks/pipeline_ranks.py                      # the default cases
    python benchmarks/pipeline_ranks.py 1F1B 4 8 1 300000 recompute-only
        # schedule, ranks, microbatches, stages per rank, budget bytes per rank[, planner
        # [, model: gpt or llama[, host link bytes/s planned for]]]
    python benchmarks/pipeline_ranks.py ZBVZeroBubble 2 4 2 546000 slackswap gpt 5e7
        # a split backward; at a 5e7 B/s link the plans recompute as well as swap
Writes benchmarks/results/pipeline_ranks.{json,md}.
"""
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slackswap_testkit.pipeline_run import rank_records, run  # noqa: E402

CASES = [("GPipe", 2, 4, 1, 300_000, "slackswap"), ("1F1B", 2, 4, 1, 200_000, "slackswap"),
         ("Interleaved1F1B", 2, 4, 2, 350_000, "slackswap"),
         ("1F1B", 4, 8, 1, 220_000, "slackswap"),
         ("1F1B", 2, 4, 1, 230_000, "slackswap", "llama"),
         ("Interleaved1F1B", 2, 4, 2, 530_000, "slackswap", "llama"),
         ("GPipe", 2, 4, 1, 400_000, "recompute-only"),
         ("Interleaved1F1B", 2, 4, 2, 400_000, "recompute-only"),
         ("1F1B", 4, 8, 1, 300_000, "recompute-only"),
         ("ZBVZeroBubble", 2, 4, 2, 546_000, "slackswap", "gpt", 5e7),
         ("DualPipeV", 2, 4, 2, 546_000, "slackswap", "gpt", 5e7)]


def _rows(case) -> list[dict]:
    schedule, world, n_mb, per_rank, budget, planner, family, link = (*case, "gpt", None)[:8]
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        ranks = run(schedule, world, n_mb, per_rank, budget, tmp, planner, family, link)
        wall = time.perf_counter() - started
    return rank_records(ranks, wall, model=family, schedule=schedule, planner=planner,
                        ranks=world, microbatches=n_mb, stages_per_rank=per_rank,
                        link_bytes_per_s=link, budget_bytes=budget)


def _markdown(rows: list[dict]) -> str:
    head = ("| model | schedule | planner | ranks x mb | rank | stages | held (read / run) | keep-all pred / meas "
            "| planned / measured (error) | receive buffers pred / meas | budget | swapped | recomputed | bitwise |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r.get('model', 'gpt')} | {r['schedule']} | {r['planner']} | {r['ranks']} x {r['microbatches']} | {r['rank']} | {r['stages']} "
        f"| {r['held_read']} / {r['held_counted']} | {r['keep_all_predicted']} / "
        f"{r['keep_all_measured']} | {r['planned_peak']} / {r['planned_measured']} "
        f"({r['planned_error']:+.1%}) | {r['recv_predicted']} / {r['recv_measured']} "
        f"| {r['budget_bytes']} | {r['swapped_bytes']} | "
        f"{r['recomputed_bytes']} | {r['bitwise']} |\n" for r in rows)
    return ("# Per-stage plans on CPU pipeline ranks (gloo)\n\nBytes of activation memory per "
            "rank, steps 2-3. `python benchmarks/pipeline_ranks.py`\n\n" + head + body)


def main(argv: list[str]) -> None:
    cases = CASES if not argv else [(argv[0], *map(int, argv[1:5]),
                                     argv[5] if len(argv) > 5 else "slackswap",
                                     argv[6] if len(argv) > 6 else "gpt",
                                     float(argv[7]) if len(argv) > 7 else None)]
    rows = [r for case in cases for r in _rows(case)]
    out = ROOT / "benchmarks" / "results"
    name = "pipeline_ranks" if not argv else "pipeline_ranks_" + "_".join(argv)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / f"{name}.md").write_text(_markdown(rows))
    print(_markdown(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
