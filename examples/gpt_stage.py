"""One stage of a GPT-style model split into pipeline stages (the model of
slackswap_testkit/pipeline_run.py): profile it once, plan it, and see each pipeline rank's
memory and the step with the schedule's bubbles:

    slackswap profile examples/gpt_stage.py --device cpu -o stage.profile.json
    slackswap plan stage.profile.json --budget 0.5 -o stage.plan.json
    slackswap simulate stage.plan.json --pp 4 --schedule 1F1B --microbatches 8

A middle stage (`stage=1` of `n_stages=4`): its input a hidden state that takes a gradient, as
PipelineStage's received inputs do, its loss a stand-in sum (its backward saves what the
gradient sent back does). `batch` is the microbatch; `family="llama"` makes it a Llama-style
stage (RMSNorm, rotary attention, SwiGLU: `make_llama_stage`).
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stand_in(out, inputs):
    return out.float().sum()


def workload(stage=1, n_stages=4, batch=2, layers=2, family="gpt"):
    from slackswap_testkit.pipeline_run import FAMILIES, MB, D, T, V, loss_fn
    module = FAMILIES[family](stage, n_stages, layers)
    torch.manual_seed(7)
    rows = batch or MB
    if stage == 0:
        x = torch.randint(0, V, (rows, T))
    else:
        x = torch.randn(rows, T, D, requires_grad=True)
    if stage == n_stages - 1:
        target = torch.randint(0, V, (rows, T))
        return module, (x,), lambda out, inputs: loss_fn(out, target)
    return module, (x,), _stand_in
