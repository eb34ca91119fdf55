"""The mutation check of the swap engine's CUDA path: each synchronization of
`swap.StreamEngine` (slackswap_cli/run/swap.py) taken out, or moved later, in turn, and a fixed
set of training cases run under the emulated asynchronous device
(slackswap_testkit/emulated_device.py), each against eager bit for bit. A mutant is killed when
a case is not bitwise equal (or raises); every mutant should be. A survivor is either a
synchronization the code does not need (then it should go, with the reason) or one the
emulator cannot see (then the emulator should learn to see it).

    python benchmarks/sync_mutants.py            # writes benchmarks/results/sync_mutants.{json,md}
    python benchmarks/sync_mutants.py --only record_stream_removed

Each mutant is a text edit of swap.py's source (each `old` must occur exactly once, so an edit
of the engine that moves the code makes this script fail loudly rather than test nothing),
executed in place of the module for its cases, and the original put back after. The unmutated
engine runs the same cases first and must pass them all.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "benchmarks" / "results"

# the lines the mutants edit, as swap.py spells them
D2H_WAIT = "        d2h.wait_stream(ops.current_stream(t.device))\n"
D2H_COPY = "            ops.copy(host, t)\n"
RECORD_STREAM = "            ops.record_stream(t, d2h)\n"
D2H_EVENT = "            done = ops.Event()\n            done.record(d2h)\n"
H2D_WAIT = "        h2d.wait_stream(ops.current_stream(handle.device))\n"
H2D_WAIT_EVENT = ("            if handle.d2h_done is not None:\n"
                  "                h2d.wait_event(handle.d2h_done)\n")
H2D_COPY = "            ops.copy(dev, handle.host)\n"
H2D_EVENT = "            done = ops.Event()\n            done.record(h2d)\n"
COMPUTE_WAIT = "            self.ops.current_stream(handle.device).wait_event(handle.h2d_done)\n"
POOL_CHECK = "                if event is None or event.query():\n"
GIVE_BACK = "        self.pool.put(handle.host, handle.h2d_done)\n"
OFFLOAD_END = "        handle.host, handle.d2h_done = host, done\n"


def _late(line: str, after: str, indent: str = "") -> list[tuple[str, str]]:
    """Edits moving `line` to just after `after` (re-indented by `indent`)."""
    moved = "".join(indent + x + "\n" for x in line.splitlines())
    return [(line, ""), (after, after + moved)]


# name -> (what it does, [(old, new), ...])
MUTANTS = {
    "d2h_wait_stream_removed": ("the D2H stream does not wait for the compute stream",
                                [(D2H_WAIT, "")]),
    "d2h_wait_stream_late": ("the D2H stream waits for the compute stream after the copy",
                             _late(D2H_WAIT, D2H_COPY, "    ")),
    "record_stream_removed": ("no record_stream on the offloaded device tensor",
                              [(RECORD_STREAM, "")]),
    "d2h_event_removed": ("no event recorded after the D2H copy",
                          [(D2H_EVENT, "            done = ops.Event()\n")]),
    "d2h_event_early": ("the D2H copy's event recorded before the copy",
                        [(D2H_EVENT, ""), (D2H_COPY, D2H_EVENT + D2H_COPY)]),
    "h2d_wait_stream_removed": ("the H2D stream does not wait for the compute stream",
                                [(H2D_WAIT, "")]),
    "h2d_wait_stream_late": ("the H2D stream waits for the compute stream after the copy",
                             _late(H2D_WAIT, H2D_COPY, "    ")),
    "h2d_wait_event_removed": ("the H2D stream does not wait on the D2H copy's event",
                               [(H2D_WAIT_EVENT, "")]),
    "h2d_wait_event_late": ("the H2D stream waits on the D2H copy's event after its copy",
                            _late(H2D_WAIT_EVENT, H2D_COPY)),
    "h2d_event_removed": ("no event recorded after the H2D copy",
                          [(H2D_EVENT, "            done = ops.Event()\n")]),
    "h2d_event_early": ("the H2D copy's event recorded before the copy",
                        [(H2D_EVENT, ""), (H2D_COPY, H2D_EVENT + H2D_COPY)]),
    "compute_wait_removed": ("the compute stream does not wait on the H2D copy's event",
                             [(COMPUTE_WAIT, "            pass\n")]),
    "pool_event_check_removed": ("the pool hands out a buffer without checking its event",
                                 [(POOL_CHECK, "                if True:\n")]),
    "give_back_without_event": ("a buffer goes back to the pool without its copy's event",
                                [(GIVE_BACK, "        self.pool.put(handle.host)\n")]),
    "give_back_after_d2h": ("a buffer goes back to the pool once its D2H copy is queued "
                            "(with that copy's event), before its copy back",
                            [(OFFLOAD_END, OFFLOAD_END + "        self.pool.put(host, done)\n")]),
}


def mutated_source(src: str, edits: list[tuple[str, str]]) -> str:
    for old, new in edits:
        n = src.count(old)
        if n != 1:
            raise SystemExit(f"sync_mutants: {old!r} occurs {n} times in swap.py (expected "
                             "once): the engine changed, update the mutants")
        src = src.replace(old, new)
    return src


def run_cases(cases_list) -> list[dict]:
    from slackswap_testkit.emulated_cases import run_case
    return [run_case(kind, path, frac, args, lag=lag) for kind, path, frac, args, lag in cases_list]


def fixed_cases():
    from slackswap_testkit.emulated_cases import QUICK
    return [(*c, lag) for c in QUICK for lag in (None, 1)]


def run_mutant(name: str, src: str, cases_list) -> dict:
    from slackswap_cli.run import swap
    what, edits = MUTANTS[name]
    code = compile(mutated_source(src, edits), swap.__file__, "exec")
    try:
        exec(code, swap.__dict__)
        results = run_cases(cases_list)
    finally:
        exec(compile(src, swap.__file__, "exec"), swap.__dict__)
    failed = [r for r in results if not r["bitwise"]]
    return {"mutant": name, "what": what, "killed": bool(failed),
            "killed_by": [{"case": r["case"], "error": r["error"],
                           "poisoned": (r["stats"] or {}).get("poisoned")} for r in failed]}


def write(report: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "sync_mutants.json").write_text(json.dumps(report, indent=1) + "\n")
    lines = ["# Mutation check of the swap engine's CUDA path (emulated device)", "",
             f"`{report['command']}`", "",
             f"**{report['killed']} of {report['total']} mutants killed.** Cases: "
             + ", ".join(report["cases"]) + " (3 AdamW steps each, bitwise against eager).", "",
             "| mutant | what | killed | by |", "|---|---|---|---|"]
    for m in report["mutants"]:
        by = "; ".join(f"{k['case']}" + (f" ({k['error'][:60]})" if k["error"] else
                                          f" ({', '.join(k['poisoned'] or {}) or 'values'})")
                       for k in m["killed_by"][:2])
        lines.append(f"| {m['mutant']} | {m['what']} | {'yes' if m['killed'] else '**no**'} "
                     f"| {by} |")
    survivors = [m for m in report["mutants"] if not m["killed"]]
    if survivors:
        lines += ["", "Survivors: " + ", ".join(m["mutant"] for m in survivors) + "."]
    (OUT / "sync_mutants.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated mutant names")
    ap.add_argument("--no-write", action="store_true", help="print, do not write results")
    a = ap.parse_args(argv)
    from slackswap_cli.run import swap
    src = Path(swap.__file__).read_text()
    names = a.only.split(",") if a.only else list(MUTANTS)
    cases_list = fixed_cases()
    t0 = time.time()
    base = run_cases(cases_list)
    bad = [r for r in base if not r["bitwise"] or r["stats"]["poisoned"]]
    if bad:
        print(f"sync_mutants: the unmutated engine fails {bad}", file=sys.stderr)
        return 1
    mutants = []
    for name in names:
        m = run_mutant(name, src, cases_list)
        print(f"{name}: {'killed' if m['killed'] else 'SURVIVED'}", flush=True)
        mutants.append(m)
    report = {"command": "python benchmarks/sync_mutants.py" + (f" --only {a.only}" if a.only else ""),
              "cases": [r["case"] for r in base], "total": len(mutants),
              "killed": sum(m["killed"] for m in mutants), "seconds": round(time.time() - t0),
              "mutants": mutants}
    print(f"{report['killed']}/{report['total']} killed in {report['seconds']} s")
    if not a.no_write:
        write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
