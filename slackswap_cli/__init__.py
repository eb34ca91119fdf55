"""slackswap: fit training into GPU memory by keeping, swapping or recomputing saved activations.

From a training script (docs/library.md):

    plan = slackswap_cli.plan_model(model, inputs, budget=0.5)
    slackswap_cli.patch(model, plan)          # or model = slackswap_cli.compile(model, plan)

`plan_model`, `patch`, `unpatch`, `compile`, `check`, `Plan` (slackswap_cli/run/api.py) and `SlackswapCallback`
(the Hugging Face Trainer's, slackswap_cli/run/hf.py) need torch; they are imported when first
used, so `import slackswap_cli` and the planning core stay torch-free.

Pipeline parallel (docs/pipeline.md; slackswap_cli/run/parallel/pipeline.py), a plan per stage
for its rank's budget and the microbatches the schedule holds there:

    planned = slackswap_cli.plan_pipeline(stages_or_pipe, "1F1B", pp=4, microbatches=8,
                                          budget="20GiB", ranks=[rank])
    planned.patch({rank: stage_module})       # a `PlannedPipeline`
    slackswap_cli.held_microbatches(slackswap_cli.schedule_order("1F1B", pp=4, microbatches=8))

Tensor parallel (docs/tensor_parallel.md) has no entry point of its own: `plan_model` and `patch`
on a model parallelised with DTensor plan and run each rank's local shards.
"""
from __future__ import annotations

import importlib

from .workload_spec import Workload

__version__ = "0.1.0"
__all__ = ["Workload", "__version__", "plan_model", "patch", "unpatch", "compile", "Plan",
           "SlackswapCallback", "check", "CheckReport", "plan_pipeline", "PlannedPipeline",
           "schedule_order", "held_microbatches"]

_LAZY = {"plan_model": "slackswap_cli.run.api", "patch": "slackswap_cli.run.api",
         "unpatch": "slackswap_cli.run.api",
         "compile": "slackswap_cli.run.api", "Plan": "slackswap_cli.run.api",
         "check": "slackswap_cli.run.api", "CheckReport": "slackswap_cli.run.api",
         "SlackswapCallback": "slackswap_cli.run.hf",
         "plan_pipeline": "slackswap_cli.run.parallel.pipeline",
         "PlannedPipeline": "slackswap_cli.run.parallel.pipeline",
         "schedule_order": "slackswap_cli.run.parallel.pipeline",
         "held_microbatches": "slackswap_cli.run.parallel.pipeline"}


def __getattr__(name: str):
    """The torch side of the library face, imported on first use (see the module docstring)."""
    if name in _LAZY:
        try:
            module = importlib.import_module(_LAZY[name])
        except ModuleNotFoundError as exc:
            need = (exc.name or "").split(".")[0]
            if need not in ("torch", "transformers"):
                raise
            how = "'slackswap[torch]'" if need == "torch" else "transformers"
            raise ImportError(f"slackswap_cli.{name} needs {need}, which is not installed: "
                              f"pip install {how}", name=need) from None
        value = getattr(module, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'slackswap_cli' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *_LAZY})
