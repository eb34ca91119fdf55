"""Per-stage plans of models split by torch's `pipeline()` on real pipeline ranks (CPU, gloo):
a GPT-style, a Llama-style and Hugging Face's LlamaForCausalLM, split with SplitPoint.BEGINNING
on their blocks (slackswap_testkit/pipe_split_run.py), planned from the pipe
(`plan_pipeline(pipe, ...)`), run by torch's schedule through `pipe.build_stage`, patched and
unpatched, for three AdamW steps. Per rank: microbatches held (read from the schedule and
counted on the run), keep-all and planned peaks predicted and measured (steps 2-3: the first
also allocates the stages' receive buffers), bytes swapped and recomputed per step, and
whether the patched pipe trained bit for bit as the unpatched one.

    python benchmarks/pipeline_split_ranks.py            # the cases below, ~15 min on 2 cores
    python benchmarks/pipeline_split_ranks.py 3          # the third case alone

`link`: the plan's host link in bytes/s (a100-pcie4's otherwise): the stages' ops are timed on
the CPU, where every copy of these KiB-sized activations hides and the plans swap only; at
1e8 bytes/s they recompute as well. Writes benchmarks/results/pipeline_split_ranks.{json,md}
(one case: pipeline_split_ranks_N.{json,md}).
"""
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slackswap_testkit.pipe_split_run import Case, run  # noqa: E402
from slackswap_testkit.pipeline_run import rank_records  # noqa: E402

CASES = [Case("GPipe", 2, 4, 1, 300_000, link=5e7),
         Case("1F1B", 2, 4, 1, 200_000, link=1e8),
         Case("Interleaved1F1B", 2, 4, 2, 300_000),
         Case("1F1B", 2, 4, 1, 230_000, family="llama", link=1e8),
         Case("Interleaved1F1B", 2, 4, 2, 480_000, family="llama"),
         Case("1F1B", 2, 4, 1, 280_000, family="hf-llama", link=1e8),
         Case("GPipe", 2, 4, 1, 400_000, planner="recompute-only")]


def _rows(case: Case) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        ranks = run(case, tmp)
        wall = time.perf_counter() - started
    return rank_records(ranks, wall, model=case.family, schedule=case.schedule,
                        planner=case.planner, link=case.link, ranks=case.world,
                        microbatches=case.microbatches, stages_per_rank=case.per_rank,
                        budget_bytes=case.budget)


def _link(link) -> str:
    return "" if link is None else f" ({link:g} B/s)"


def _markdown(rows: list[dict]) -> str:
    head = ("| model | schedule | planner (link) | ranks x mb | rank | stages | held (read / run) "
            "| keep-all pred / meas | planned / measured (error) | receive buffers pred / meas "
            "| budget | swapped "
            "| recomputed | bitwise |\n" + "|---" * 14 + "|\n")
    body = "".join(
        f"| {r['model']} | {r['schedule']} | {r['planner']}{_link(r['link'])} "
        f"| {r['ranks']} x {r['microbatches']} | {r['rank']} | {r['stages']} "
        f"| {r['held_read']} / {r['held_counted']} | {r['keep_all_predicted']} / "
        f"{r['keep_all_measured']} | {r['planned_peak']} / {r['planned_measured']} "
        f"({r['planned_error']:+.1%}) | {r['recv_predicted']} / {r['recv_measured']} "
        f"| {r['budget_bytes']} | {r['swapped_bytes']} | "
        f"{r['recomputed_bytes']} | {r['bitwise']} |\n" for r in rows)
    return ("# Per-stage plans of `pipeline()`-split models on CPU pipeline ranks (gloo)\n\n"
            "Bytes of activation memory per rank, steps 2-3. "
            "`python benchmarks/pipeline_split_ranks.py`\n\n" + head + body)


def main(argv: list[str]) -> None:
    picked = [CASES[int(a) - 1] for a in argv] or CASES
    rows = [r for case in picked for r in _rows(case)]
    name = "pipeline_split_ranks" + ("_" + "_".join(argv) if argv else "")
    out = ROOT / "benchmarks" / "results"
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / f"{name}.md").write_text(_markdown(rows))
    print(_markdown(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
