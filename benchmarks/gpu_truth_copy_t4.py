"""Copy NeuSight's T4 per-op files into benchmarks/data/gpu_truth/ in the kept-columns format.

The T4 was measured for inference only (forward, no `-train-` steps), so its files price no
whole step; `fit_costs.py` uses their GEMM rows (`Linear` modules, forward time) to fit the
board-power limit of the fp32 clock (a 70 W card, as the L4 is a 72 W one). This script reads a
checkout of NeuSight's `scripts/asplos/data/` labels folder (the layout of
/work/shared/gpu-truth/labels, or `--src DIR`) and writes `labels/Tesla_T4/*-inf-*.csv` with the
columns the other per-op files keep (see benchmarks/data/gpu_truth/README.md): `op`, `target`
(object addresses removed), `module` (the class of a `call_module` node, from `meta`),
`input_shapes`, `output_shape`, `dtype`, `fw_latency`, `bw_latency`, `Name`. Torch-free.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "data" / "gpu_truth" / "labels" / "Tesla_T4"
KEEP = ("op", "target", "module", "input_shapes", "output_shape", "dtype", "fw_latency",
        "bw_latency", "Name")


def reduce_row(row: dict) -> dict:
    """One NeuSight row in the kept columns."""
    classes = re.findall(r"<class '([^']+)'>", row.get("meta", ""))
    module = classes[-1].rsplit(".", 1)[-1] if row["op"] == "call_module" and classes else ""
    target = re.sub(r" at 0x[0-9a-f]+", "", row["target"])
    return {**{k: row[k] for k in KEEP if k in row}, "target": target, "module": module}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", default="/work/shared/gpu-truth/labels/Tesla_T4")
    args = ap.parse_args(argv)
    csv.field_size_limit(1 << 30)
    OUT.mkdir(parents=True, exist_ok=True)
    for src in sorted(Path(args.src).glob("*-inf-*.csv")):
        with src.open() as fh, (OUT / src.name).open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=KEEP, lineterminator="\n")
            writer.writeheader()
            for row in csv.DictReader(fh):
                writer.writerow(reduce_row(row))
        print(f"wrote {(OUT / src.name).relative_to(HERE.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
