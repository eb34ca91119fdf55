"""What `compile_planned` cannot offload, known from the profile before a plan is made.

`compile_planned` (run/compiled/backend.py) offloads a swapped root with torch's own insertion pass
(`torch._functorch._activation_offloading`): a `device_put` to the host placed after the
value's last forward use in the *forward graph that computes it*, and one back before its first
use in the backward graph. torch's `can_offload` takes only values its forward graph computes
and returns for backward: not a graph input (a placeholder: nothing in this graph made it),
not a view, not a non-contiguous tensor (slackswap offloads every output of a multi-output op
and values that are also model outputs itself, and refuses what does not cover its storage).
So these kinds of saved value are not offloaded whatever the plan says:

- **not dense**: a result whose elements do not cover its storage (its bytes in the profile
  exceed shape x dtype size): the host copy would not be the storage backward reads;
- **a decomposed layer or batch norm's statistics** (`native_layer_norm`'s mean and rstd,
  `native_batch_norm`'s saved mean and invstd): inductor decomposes the op before partitioning
  (`var_mean`, `rsqrt`), and its decomposed backward reads values of its own or re-derives
  them, so a swap of the profiled result is not carried out (ViT at 0.5: each layer norm's
  mean, 136 B, read by no backward op; the test CNN's batch norm statistics, 64 B);
- **per-block compile only** (`compile_planned(per_block=True)`, each repeated block compiled
  on its own): a value made in one graph and saved by another, which there is a graph input -
  a block's output saved by the next block's first layer norm, the embeddings saved by block 0
  - (its producing op and some op of backward reading it lie in different blocks, or one of
  them outside every block).

Everything else a whole-model `compile_planned` offloads (a decomposed reader's own values are
re-derived from the root or offloaded in its place: run/compiled/derived.py).

`plan --for-compile model|per-block` (`plan_model(..., for_compile=...)`) hands these roots to
the planner as `no_swap` (a `StaticSettings` option): it treats them as keep-or-recompute, and
`planners.judge` marks a plan that swaps one anyway infeasible. Eager plans are unchanged (the
option is empty unless asked for).
"""
from __future__ import annotations

from math import prod

from .errors import InputError
from .layers import op_layer_indices
from .profile_build import dtype_bytes
from .schema import Profile

__all__ = ["COMPILE_MODES", "check_mode", "not_offloadable", "no_swap_option"]

COMPILE_MODES = ("model", "per-block")
# ops whose results after the first inductor's decomposition makes as inner values of its own
DECOMPOSED_STATS = frozenset({"aten.native_layer_norm.default",
                              "aten.native_batch_norm.default"})
ACROSS_GRAPHS = "saved by another block's graph, where it is a graph input"


def check_mode(mode: str) -> None:
    """Refuse a `--for-compile` mode other than COMPILE_MODES."""
    if mode not in COMPILE_MODES:
        raise InputError(f"--for-compile takes {' or '.join(COMPILE_MODES)}, not {mode!r}",
                         hint="model: compile_planned(model); per-block: "
                              "compile_planned(model, per_block=True)")


def not_offloadable(prof: Profile, mode: str = "model") -> dict[int, str]:
    """Candidate root id -> why `compile_planned` (whole model, or `mode="per-block"`) cannot
    offload it (see the module docstring)."""
    check_mode(mode)
    out: dict[int, str] = {}
    layer = op_layer_indices(prof) if mode == "per-block" else None
    for t in prof.saved_activations:
        op = prof.ops[t.producer]
        if t.size_bytes > dtype_bytes(t.dtype) * prod(t.shape):
            out[t.id] = "not dense: its elements do not cover its storage"
        elif op.target in DECOMPOSED_STATS and t.id in op.outputs[1:]:
            out[t.id] = "a statistic of an op inductor decomposes before partitioning"
        elif layer is not None:
            made = layer[t.producer]
            read = {layer[c] for tid in (t.id, *prof.aliases.get(t.id, ()))
                    for c in prof.tensors[tid].consumers if prof.ops[c].phase == "backward"}
            if read and read != {made} and not (made is None and read == {None}):
                out[t.id] = ACROSS_GRAPHS
    return out


def no_swap_option(prof: Profile, mode: str | None) -> dict:
    """The planner options for `--for-compile mode` ({} for an eager plan: None): `no_swap`,
    every value it cannot offload; `no_recompute`, those made by another graph (per-block),
    which the graph saving them cannot re-run either."""
    if mode is None:
        return {}
    why = not_offloadable(prof, mode)
    return {"no_swap": tuple(sorted(why)),
            "no_recompute": tuple(sorted(t for t, w in why.items() if w == ACROSS_GRAPHS))}
