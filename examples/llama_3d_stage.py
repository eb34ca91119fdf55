"""One pipeline stage of the Llama-style model that slackswap_testkit/three_d_run.py trains under
FSDP2 x TP x PP, as one tensor parallel rank holds it: `tp` > 1 builds the stage's blocks at
their local widths (each rank's query and key/value heads and MLP columns), the plain module
whose shapes are those of a DTensor rank's local shards. `fit` gives it the three degrees:

    slackswap fit examples/llama_3d_stage.py --pp 2 --fsdp 2 --tp 2 --batch 1,2,4 --memory 4MiB

The first stage (`stage=0`: the token embedding and two blocks); `batch` is the microbatch.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _stand_in(out, inputs):
    return out.float().sum()


def workload(stage=0, n_stages=2, batch=2, tp=1):
    from slackswap_testkit.three_d_run import D, Stage, T, V, loss_fn
    module = Stage(stage, n_stages, tp)
    torch.manual_seed(7)
    x = (torch.randint(0, V, (batch, T)) if stage == 0
         else torch.randn(batch, T, D, requires_grad=True))
    if stage == n_stages - 1:
        target = torch.randint(0, V, (batch, T))
        return module, (x,), lambda out, inputs: loss_fn(out, target)
    return module, (x,), _stand_in
