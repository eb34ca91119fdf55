"""The two files everything else reads: the profile and the plan.

A **profile** (`slackswap.profile`, version 1) is one traced training step (forward, loss,
backward) at fixed shapes: the ops in execution order and the tensors between them.

- `ops[i].id == i`; forward ops come first, then backward. `inputs`/`outputs` are tensor ids.
- `tensors[j].id == j`. `kind` is `activation` (a value some op produced during the step),
  `input`, `parameter`, `buffer`, or `gradient` (a parameter's or input's gradient that the
  step returns: it lives in `.grad`, not in activation memory).
- `alias_of` points at the storage root (never at another alias): a view shares its root's
  bytes, so memory counts the root once and keeps it alive as long as any alias is in use.
- `saved` is true for a forward value read by a backward op; on a root it is true when the root
  or any of its aliases is read by backward. Saved activation roots are the planner's choices.
- `recomputable` is false for inputs, parameters, buffers and outputs of random ops (dropout).
  The recompute recipe of a tensor is its producer op: re-run it on the producer's inputs.

**Activation memory**, the quantity budgets and peaks refer to, is the bytes of live activation
roots (kind `activation`, `alias_of` null). A root is live from its producer's end until the end
of the last op that reads it or any of its aliases; a value nobody reads dies at its producer's
end. Parameters, inputs, buffers and gradients are outside it.

A **plan** (`slackswap.plan`, version 1) says for each saved activation root: keep, swap or
recompute; plus the schedule the simulator used and the numbers it predicted.

Both are frozen dataclasses, serialised with orjson. Loading checks format, version and that
every id refers to something that exists; writing is atomic (temp file, then rename).

The package: `types` (the dataclasses, formats, fingerprints), `load` (reading a file),
`validate` (the checks a loaded one must pass), `write` (dumps, save, write_atomic). Every
public name is re-exported here: `from slackswap_cli.schema import Profile, load_plan` and
`schema.save(...)` are the ways in. No module of it imports torch.
"""
from .load import load_plan, load_profile, plan_from_dict, profile_from_dict, sniff_format
from .types import (
    ACTIONS,
    KINDS,
    PHASES,
    PLAN_FORMAT,
    PLAN_VERSION,
    PROFILE_FORMAT,
    PROFILE_VERSION,
    TIME_SOURCES,
    Action,
    Decision,
    Op,
    Plan,
    Predicted,
    Profile,
    ScheduleEvent,
    Tensor,
    op_fingerprint,
    saved_flags,
)
from .validate import MAX_BYTES, MAX_COUNT, MAX_US, validate_plan, validate_profile
from .write import check_target, dumps, save, write_atomic

__all__ = [
    "ACTIONS", "KINDS", "MAX_BYTES", "MAX_COUNT", "MAX_US", "PHASES", "PLAN_FORMAT",
    "PLAN_VERSION", "PROFILE_FORMAT", "PROFILE_VERSION", "TIME_SOURCES", "Action", "Decision",
    "Op", "Plan", "Predicted", "Profile", "ScheduleEvent", "Tensor", "check_target", "dumps",
    "load_plan", "load_profile", "op_fingerprint", "plan_from_dict", "profile_from_dict", "save",
    "saved_flags", "sniff_format", "validate_plan", "validate_profile", "write_atomic",
]
