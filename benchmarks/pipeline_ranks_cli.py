"""The CLI's per-rank prediction (`slackswap show PROFILE... --pp 4`) against the real ranks of
the 4-rank 1F1B run (benchmarks/results/pipeline_ranks_1F1B_4_8_1_220000_slackswap.json:
`python benchmarks/pipeline_ranks.py 1F1B 4 8 1 220000 slackswap`, a GPT-style model split by
hand into 4 stages of 2 blocks, 8 microbatches, CPU and gloo, keep-all peaks measured on the
unpatched run, steps 2-3).

Each stage of that model is profiled through the CLI (`slackswap profile examples/gpt_stage.py
--device cpu --arg stage=S`), then the pipeline is shown twice: every stage priced as the
middle stage 1 (one profile), and each stage as its own (four profiles: the first with its
embeddings, the last with its norm, head and cross-entropy).

    python benchmarks/pipeline_ranks_cli.py
Writes benchmarks/results/pipeline_ranks_cli.{json,md}.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEASURED = ROOT / "benchmarks" / "results" / "pipeline_ranks_1F1B_4_8_1_220000_slackswap.json"
PIPE = ["--pp", "4", "--schedule", "1F1B", "--microbatches", "8", "--json"]


def _cli(*args: str) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", "from slackswap_cli.cli import main; main()",
                          *args], capture_output=True, text=True, env=env, check=True)
    return out.stdout


def _keep_all(profiles: list[str]) -> list[int]:
    got = json.loads(_cli("show", *profiles, *PIPE))
    return [r["keep_all_peak_bytes"] for r in got["pipeline"]["ranks"]]


def main() -> None:
    measured = {r["rank"]: r for r in json.loads(MEASURED.read_text())}
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for stage in range(4):
            path = str(Path(tmp) / f"stage{stage}.profile.json")
            _cli("profile", str(ROOT / "examples" / "gpt_stage.py"), "--device", "cpu",
                 "--arg", f"stage={stage}", "-o", path, "-q")
            files.append(path)
        one, each = _keep_all([files[1]]), _keep_all(files)
    rows = []
    for rank in range(4):
        m = measured[rank]["keep_all_measured"]
        rows.append({"rank": rank, "held": measured[rank]["held_read"],
                     "keep_all_measured": m,
                     "cli_one_profile": one[rank], "cli_one_error": round(one[rank] / m - 1, 4),
                     "cli_each_stage": each[rank],
                     "cli_each_error": round(each[rank] / m - 1, 4),
                     "plan_pipeline": measured[rank]["keep_all_predicted"]})
    out = ROOT / "benchmarks" / "results" / "pipeline_ranks_cli"
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    out.with_suffix(".md").write_text(_markdown(rows))
    print(_markdown(rows))


def _markdown(rows: list[dict]) -> str:
    body = "".join(
        f"| {r['rank']} | {r['held']} | {r['cli_one_profile']} ({r['cli_one_error']:+.1%}) | "
        f"{r['cli_each_stage']} ({r['cli_each_error']:+.1%}) | {r['plan_pipeline']} | "
        f"{r['keep_all_measured']} |\n" for r in rows)
    return (
        "# Per-rank prediction from the CLI against the real ranks (1F1B, 4 ranks, 8 "
        "microbatches)\n\n`python benchmarks/pipeline_ranks_cli.py`. The real-rank run: `python "
        "benchmarks/pipeline_ranks.py 1F1B 4 8 1 220000 slackswap` (benchmarks/results/"
        "pipeline_ranks_1F1B_4_8_1_220000_slackswap.md; CPU, gloo, a GPT-style model split by "
        "hand into 4 stages of 2 blocks, three AdamW steps, keep-all peaks of steps 2-3 on the "
        "unpatched run). Bytes of activation memory per rank.\n\n"
        "    slackswap profile examples/gpt_stage.py --device cpu --arg stage=S -o sS.profile.json"
        "   # S = 0..3\n"
        "    slackswap show s1.profile.json --pp 4 --schedule 1F1B --microbatches 8"
        "   # every stage as stage 1\n"
        "    slackswap show s0.profile.json s1.profile.json s2.profile.json s3.profile.json "
        "--pp 4 --schedule 1F1B --microbatches 8   # each stage as it is\n\n"
        "| rank | held | keep-all: CLI, every stage as stage 1 | keep-all: CLI, each stage its "
        "own profile | keep-all: plan_pipeline | keep-all measured |\n"
        "|---|---|---|---|---|---|\n" + body)


if __name__ == "__main__":
    main()
