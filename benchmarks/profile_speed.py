"""How long `slackswap profile --device fake` takes on the Llama-7B examples, and how much
memory it needs (target: at most 60 s and 2 GiB on a small CPU machine; for the Llama-70B
example, at most 120 s and 3 GiB).

Two 7B cases run by default: `llama_7b` (built directly in bf16, SDPA causal without a mask)
and `llama_7b_to_bf16` (the default `LlamaConfig()`, built in fp32 and then converted with
`.to(torch.bfloat16)`, which fake tensors used to refuse).

Each example is profiled in a fresh subprocess, so the peak RSS (`resource.getrusage`, which
reports the high-water mark of the process) is that of one profile run, imports included.
Writes benchmarks/results/profile_speed.json.

    python benchmarks/profile_speed.py                 # the two Llama-7B examples
    python benchmarks/profile_speed.py --all           # also BERT-Large, GPT-2 XL, Llama-70B
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from slackswap_cli.units import GIB, MIB  # noqa: E402

TARGET_S, TARGET_RSS_BYTES = 60.0, 2 * GIB
TARGETS = {"llama_70b": (120.0, 3 * GIB)}     # (wall s, peak RSS bytes) where not the above

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
from slackswap_cli.hardware import load_hardware
from slackswap_cli.schema import dumps
from slackswap_cli.trace import profile_workload
prof = profile_workload(sys.argv[1], device="fake", hardware=load_hardware("a100-pcie4"))
wall_s = time.perf_counter() - t0
size = len(dumps(prof))
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB
print(json.dumps({"wall_s": wall_s, "profile_s": prof.summary["profile_s"],
                  "peak_rss_bytes": rss, "n_ops": len(prof.ops), "n_tensors": len(prof.tensors),
                  "n_saved": prof.summary["n_saved"], "saved_bytes": prof.summary["saved_bytes"],
                  "peak_activation_bytes": prof.summary["peak_activation_bytes"],
                  "profile_json_bytes": size}))
"""


def run_one(example: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(ROOT / "examples" / f"{example}.py")],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"profiling {example} failed:\n{out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    wall, rss = TARGETS.get(example, (TARGET_S, TARGET_RSS_BYTES))
    result["target"] = {"wall_s": wall, "peak_rss_bytes": rss}
    result["within_target"] = result["wall_s"] <= wall and result["peak_rss_bytes"] <= rss
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true",
                        help="also BERT-Large, GPT-2 XL and Llama-70B")
    parser.add_argument("-o", default=str(ROOT / "benchmarks" / "results" / "profile_speed.json"))
    opts = parser.parse_args()
    examples = ["llama_7b", "llama_7b_to_bf16"] + (["bert_large", "gpt2_xl", "llama_70b"]
                                                   if opts.all else [])
    import torch
    report = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                          "python": platform.python_version(), "torch": torch.__version__},
              "target": {"wall_s": TARGET_S, "peak_rss_bytes": TARGET_RSS_BYTES},
              "results": {}}
    for ex in examples:
        r = run_one(ex)
        report["results"][ex] = r
        print(f"{ex}: {r['wall_s']:.1f} s wall (profile {r['profile_s']:.1f} s), "
              f"peak RSS {r['peak_rss_bytes'] / MIB:.0f} MiB, {r['n_ops']} ops, "
              f"{r['n_tensors']} tensors, within target: {r['within_target']}")
    path = Path(opts.o)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
