"""Plans under tensor parallelism on real ranks (CPU, gloo): small Llama-style blocks
parallelised with DTensor (slackswap_testkit/tp_run.py: colwise q/k/v and gate/up, rowwise o
and down; "block-sp" adds SequenceParallel norms; "block-fsdp" is TP inside pairs of ranks and
FSDP2 across, 4 ranks), each rank planned on its local shards (a fake trace, 2 us kernels),
then three AdamW steps plain and patched. Per rank: the keep-all peak predicted (the profile)
and measured (the plain run), the planned peak and the measured one (the patched run), the
bytes the runtime counted held for backward at the end of forward (its guard's count, on local
shards) against the budget, the swapped and recomputed bytes the plan predicts, and whether the
patched run trained bit for bit as plain TP. Measured peaks are those of steps 2 and 3 (the
first step also records the forward and fills the swap engine's host pool), activation bytes
as run/verify/memtrace.py counts them (live storages, gradients of parameters taken off).

Each swapped tensor's copy back is issued at the backward op the simulator issued it at
(`chains.copy_back_pins`, the runtime's rule for every patched model). A row "none" is
the same model on one process without TP, planned and measured the same way: what it shows is
the runtime's, not tensor parallelism's. Under "block-fsdp" the calls FSDP2 makes (its
all-gathered parameters, its buffers) are not counted, but the weight gradients of the
unsharded parameters are, until FSDP2's reduce-scatter frees them (the gradient hooks see the
sharded parameters only): its measured peaks hold gradients, not only activations.

    python benchmarks/tp_ranks.py                 # the default cases
    python benchmarks/tp_ranks.py block-sp 2 0.5 slackswap 2
        # layout, ranks, budget (fraction), planner, blocks
Writes benchmarks/results/tp_ranks.{json,md} (a case given on the command line:
tp_ranks_<args>.{json,md}).
"""
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slackswap_testkit import tp_run  # noqa: E402

CASES = [("none", 1, 0.5, "slackswap", 2), ("block", 2, 0.5, "slackswap", 2),
         ("block-sp", 2, 0.5, "slackswap", 2), ("block", 2, 0.5, "recompute-only", 2),
         ("block-fsdp", 4, 0.5, "slackswap", 2)]


def _single(budget: float, planner: str, blocks: int) -> list[dict]:
    """The "none" row: the model unparallelised, on this process."""
    import torch

    import slackswap_cli as slackswap
    torch.manual_seed(0)
    model = tp_run.Model("block", blocks)
    torch.manual_seed(1)
    x = torch.randn(tp_run.B, tp_run.T, tp_run.D)
    started = time.perf_counter()
    plan = tp_run.plan_of(model, x, budget, planner)
    out = {"plan_s": time.perf_counter() - started,
           "keep_all_peak": plan.profile.summary["peak_activation_bytes"],
           "planned_peak": plan.predicted.peak_bytes, "budget_bytes": plan.budget_bytes,
           "swapped_bytes": plan.predicted.swapped_bytes,
           "recomputed_bytes": plan.predicted.recomputed_bytes}
    for label in ("plain", "patched"):
        torch.manual_seed(0)
        m = tp_run.Model("block", blocks)
        if label == "patched":
            slackswap.patch(m, plan)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses, peaks = [], []
        for _ in range(3):
            loss, peak = tp_run._measured(m, x)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss)
            peaks.append(peak)
        out[label] = {"losses": losses, "peaks": peaks,
                      "params": [p.detach().clone() for p in m.parameters()]}
        if label == "patched":
            out[label]["report"] = m.forward.__slackswap__.last_run.report()
    return [out]


def _rows(case) -> list[dict]:
    layout, world, budget, planner, blocks = case
    started = time.perf_counter()
    if layout == "none":
        ranks = _single(budget, planner, blocks)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = tp_run.run(layout, world, budget, tmp, measure=True, blocks=blocks,
                               planner=planner)
    wall = time.perf_counter() - started
    out = []
    for rank, res in enumerate(ranks):
        plain, patched = res["plain"], res["patched"]
        keep_meas, plan_meas = max(plain["peaks"][1:]), max(patched["peaks"][1:])
        out.append({"layout": layout, "planner": planner, "ranks": world,
                    "blocks": blocks,
                    "rank": rank, "budget_bytes": res["budget_bytes"],
                    "keep_all_predicted": res["keep_all_peak"], "keep_all_measured": keep_meas,
                    "keep_all_error": round(keep_meas / res["keep_all_peak"] - 1, 4),
                    "planned_peak": res["planned_peak"], "planned_measured": plan_meas,
                    "planned_error": round(plan_meas / res["planned_peak"] - 1, 4),
                    "held_at_forward_end": patched["report"]["held_bytes"],
                    "swapped_bytes": res["swapped_bytes"],
                    "recomputed_bytes": res["recomputed_bytes"],
                    "bitwise": tp_run.same(plain, patched), "plan_s": round(res["plan_s"], 1),
                    "wall_s": round(wall, 1)})
    return out


def _markdown(rows: list[dict]) -> str:
    head = ("| layout | planner | ranks | rank | keep-all pred / meas (error) | "
            "planned / measured (error) | held at forward end / budget | swapped | recomputed | "
            "bitwise |\n|---|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(
        f"| {r['layout']} | {r['planner']} | {r['ranks']} | {r['rank']} | "
        f"{r['keep_all_predicted']} / {r['keep_all_measured']} ({r['keep_all_error']:+.1%}) | "
        f"{r['planned_peak']} / {r['planned_measured']} ({r['planned_error']:+.1%}) | "
        f"{r['held_at_forward_end']} / {r['budget_bytes']} | {r['swapped_bytes']} | "
        f"{r['recomputed_bytes']} | {r['bitwise']} |\n" for r in rows)
    return ("# Plans under tensor parallelism on CPU ranks (gloo)\n\nBytes of activation memory "
            "per rank (local shards), steps 2-3, two blocks of width 64, 4 heads, batch 2 x 16, "
            "priced at 2 us a kernel. `python benchmarks/tp_ranks.py`; what the columns are, and "
            "why block-fsdp's measured peaks also hold weight gradients: the script's "
            "docstring.\n\n" + head + body)


def main(argv: list[str]) -> None:
    cases = CASES if not argv else [(argv[0], int(argv[1]), float(argv[2]),
                                     argv[3] if len(argv) > 3 else "slackswap",
                                     int(argv[4]) if len(argv) > 4 else 2)]
    rows = [r for case in cases for r in _rows(case)]
    out = ROOT / "benchmarks" / "results"
    name = "tp_ranks" if not argv else "tp_ranks_" + "_".join(argv)
    (out / f"{name}.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / f"{name}.md").write_text(_markdown(rows))
    print(_markdown(rows))


if __name__ == "__main__":
    main(sys.argv[1:])
