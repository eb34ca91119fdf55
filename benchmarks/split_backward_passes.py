"""What one microbatch of a pipeline stage holds during a split backward's input pass, against
what the per-rank model counts there (slackswap_cli/pipeline/stages.py `rank_peak`: an input
pass "I" at the stage's own peak, as a full backward, plus its boundary bytes).

One process, no ranks: a middle stage (index 1 of 4, two blocks) of the GPT-style model and of
Hugging Face's GPT-2 (dropout 0.1; slackswap_testkit/pipeline_run.py), unpatched, one
microbatch, measured by run/verify/memtrace.py as the two-rank runs are:

- the full backward's peak (`out.backward(grad)`, what frees saved tensors as it goes);
- torch's split backward (torch/distributed/pipelining/_backward.py): the input pass's peak
  (`stage_backward_input`, the graph retained: no saved tensor is freed), the state it leaves
  until the weight pass, and the weight pass's peak;
- `split_held_bytes` (what `Boundary.split` counts from I to W) and the bytes the model puts
  on an I: the full backward's peak plus the output's gradient received and the input's
  gradient sent.

    python benchmarks/split_backward_passes.py
Writes benchmarks/results/split_backward_passes.{json,md}.
"""
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.distributed.pipelining._backward import (  # noqa: E402
    stage_backward_input,
    stage_backward_weight,
)

from slackswap_cli.run.parallel.split_backward import split_held_bytes  # noqa: E402
from slackswap_cli.run.verify.memtrace import MemTracker  # noqa: E402
from slackswap_testkit.pipeline_run import FAMILIES, MB, D, T  # noqa: E402


def _stage(family: str):
    torch.manual_seed(0)
    return FAMILIES[family](1, 4, 2), torch.randn(MB, T, D, requires_grad=True)


def _full_peak(family: str) -> int:
    mod, x = _stage(family)
    tr = MemTracker()
    with tr:
        out = mod(x)
        out.backward(torch.ones_like(out))
    tr.exclude([p.grad for p in mod.parameters()] + [x.grad])
    tr.finish()
    return max(tr.timeline())


def _split(family: str) -> dict:
    mod, x = _stage(family)
    tr = MemTracker()
    with tr:
        out = mod(x)
        grad = torch.ones_like(out)
        sent, groups = stage_backward_input([out], [grad], [x], mod.parameters())
        after_i = len(tr.samples)
        torch.zeros(1)          # a call after the input pass: the state it leaves
        stage_backward_weight(mod.parameters(), groups)
    tr.exclude([p.grad for p in mod.parameters()])
    tr.finish()
    line = tr.timeline()
    return {"input_pass_peak": max(line[:after_i]), "after_input_pass": line[after_i],
            "weight_pass_peak": max(line[after_i + 1:]),
            "boundary": out.untyped_storage().nbytes() + sum(
                t.untyped_storage().nbytes() for t in sent if t is not None)}


def row(family: str) -> dict:
    mod, x = _stage(family)
    got = _split(family)
    full = _full_peak(family)
    model_i = full + got.pop("boundary")
    return {"model": family, "full_backward_peak": full, **got,
            "split_held_bytes": split_held_bytes(mod, (x,), None, False, False),
            "model_input_pass": model_i, "input_pass_over_model": got["input_pass_peak"] - model_i,
            "input_pass_over_after": got["input_pass_peak"] - got["after_input_pass"]}


def main() -> None:
    rows = [row(f) for f in ("gpt", "gpt2")]
    keys = list(rows[0])
    md = ("# A split backward's input pass, one microbatch of a middle stage\n\n"
          "Bytes of live activation memory (run/verify/memtrace.py), unpatched. "
          "`python benchmarks/split_backward_passes.py`\n\n"
          "| " + " | ".join(keys) + " |\n" + "|---" * len(keys) + "|\n"
          + "".join("| " + " | ".join(str(r[k]) for k in keys) + " |\n" for r in rows))
    out = ROOT / "benchmarks" / "results"
    (out / "split_backward_passes.json").write_text(json.dumps(rows, indent=1) + "\n")
    (out / "split_backward_passes.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
