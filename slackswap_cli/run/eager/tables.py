"""A patched module's TABLE and META as the eager runtime reads them: typed, once, at load.

An emitted file holds TABLE (`chains.runtime_table`: the plan as `patch(model)` carries it out)
and META (`emit.patch_meta`) as plain dicts, so the file reads as data. `patch` reads each into
a slotted record here once (`RunTable.of`, `RunMeta.of`); the runtime then reads fields by
name. `source` keeps the dict itself (pickling a patched model stores it; tests ask which
table a call ran).
"""
from __future__ import annotations

__all__ = ["RunTable", "RunMeta"]


class RunTable:
    """TABLE, by field (the keys' meaning: `chains.runtime_table`). `budget_bytes`: the
    guard's limit a re-planned table names (run/eager/replan.py; None: the plan's, from META)."""
    __slots__ = ("n_forward", "ops", "root", "non_activation", "action", "chains", "made_by",
                 "chain_inputs", "op_inputs", "needs", "bwd_use", "last_write", "first_use",
                 "prefetch_at", "keep_after", "saved_by_shape", "budget_bytes", "source")

    def __init__(self, table: dict):
        self.source = table
        self.n_forward = table["n_forward"]
        self.ops = table["ops"]
        self.root = table["root"]
        self.non_activation = table["non_activation"]
        self.action = table["action"]
        self.chains = table["chains"]
        self.made_by = table["made_by"]
        self.chain_inputs = table["chain_inputs"]
        self.op_inputs = table["op_inputs"]
        self.needs = table["needs"]
        self.bwd_use = table["bwd_use"]
        self.last_write = {int(k): v for k, v in table.get("last_write", {}).items()}
        self.first_use = table.get("first_use", {})
        self.prefetch_at = table["prefetch_at"]
        self.keep_after = table.get("keep_after")
        self.saved_by_shape = table.get("saved_by_shape")
        self.budget_bytes = table.get("budget_bytes")

    @classmethod
    def of(cls, table) -> "RunTable":
        """`table` as a RunTable (one already is: itself)."""
        return table if isinstance(table, RunTable) else cls(table)


class RunMeta:
    """What the eager runtime reads of META (`emit.patch_meta`): the profiled signature
    (`device_type`, `param_dtype`, `input_tensors`), the plan's `budget_bytes`, and what a
    re-plan at other shapes needs (run/eager/replan.py): `hardware`, `target_device`, `workload`,
    `budget_fraction`, `planner`, `autocast`, `loss_fn` (a plan made in the training process,
    run/api.py); `value_dependent`: the plan's trace was real, its sizes fixed by the values
    of the profiled batch (no fake trace can plan this model again)."""
    __slots__ = ("device_type", "param_dtype", "input_tensors", "budget_bytes", "hardware",
                 "target_device", "workload", "budget_fraction", "planner", "autocast",
                 "loss_fn", "value_dependent", "source")

    def __init__(self, meta: dict):
        self.source = meta
        params = meta.get("params") or [[None, None, "torch.float32"]]
        self.device_type = meta.get("device_type", "cpu")
        self.param_dtype = params[0][2]
        self.input_tensors = meta.get("input_tensors", [])
        self.budget_bytes = meta.get("budget_bytes")
        self.hardware = meta.get("hardware")
        self.target_device = meta.get("target_device")
        self.workload = meta.get("workload") or {}
        self.budget_fraction = meta.get("budget_fraction")
        self.planner = meta.get("planner")
        self.autocast = meta.get("autocast")
        self.loss_fn = meta.get("loss_fn")
        self.value_dependent = bool(meta.get("value_dependent_sizes"))

    @classmethod
    def of(cls, meta) -> "RunMeta":
        """`meta` as a RunMeta (one already is: itself)."""
        return meta if isinstance(meta, RunMeta) else cls(meta)
