"""The activation-checkpointing settings users run today, as planners judged by the simulator.

Each decides per saved activation root, block by block (the repeated blocks `layers` finds
from module paths), what the framework's own rule would keep or recompute:

- `torchtitan-sac`: torchtitan's selective op AC (`SelectiveAC` in
  torchtitan's module torchtitan.distributed.activation_checkpoint; `_apply_ac_to_transformer_block` with
  `_save_list` in torchtitan.parallelisms.parallelize_llama at the commit of its 2024-12
  benchmarks). Inside each block the output of an op in its save list (`SAVE_OPS`: matmuls,
  fused attention, max, reduce-scatter) is kept, except every second matmul of the block
  (`aten.mm`, `aten.linear`, counted in forward order: the 2nd, 4th, ... are recomputed);
  everything else the block saves is recomputed. The 2024-12 list was mm, the flash and
  memory-efficient SDPA kernels, abs, max and reduce-scatter; today's adds torch's other
  compute-intensive ops (addmm, bmm, convolution, ...), linear, cuDNN attention, topk and
  all-to-all, and no longer abs. On a bias-free Llama (mm and SDPA only) both pick the same.
- `full-ac`: `torch.utils.checkpoint` around every block (torchtitan `FullAC`; Hugging
  Face's `gradient_checkpointing_enable()`, an alias of `activation_checkpointing_enable` in
  transformers/modeling_utils.py that wraps each `GradientCheckpointingLayer`, the decoder
  layers, non-reentrant by default): only what the next block reads stays; it is
  `checkpoint-layers` with every block checkpointed.
- `megatron-selective`: Megatron-LM's `recompute_granularity = "selective"` with its default
  `recompute_modules = ["core_attn"]` (megatron.core.transformer.transformer_config; the
  checkpoint is `_checkpointed_attention_forward` in megatron.core.transformer.attention,
  around the core attention with query, key and value as its inputs): the core attention
  (scores, softmax, dropout, the product with V; a fused kernel's output and log-sum-exp)
  is recomputed from the kept query, key and value, everything else is kept. Random outputs
  (an attention dropout mask) cannot be recomputed here and are kept.

In every block the rule leaves alone, and outside the blocks (embeddings, head, loss),
everything is kept. A tensor whose recompute would have to re-run ops of another block (what
the block received, or derives from it with no saved value in between) is kept: a
checkpoint keeps the block's input instead.

What the simulator does not see of torch's checkpoint (`checkpoint_gap` counts it, and the
planners' notes say it): the checkpoint saves the block's input where the profile may save
a copy derived from it (Hugging Face's RMSNorm saves an fp32 copy of a bf16 input); selective
AC caches the output of every op it saves whether backward reads it or not (the down
projection's output); and the replay re-runs the whole block forward except the cached ops,
where the simulator re-runs only the chains of the recomputed tensors. That is torchtitan's
replay (`early_stop=False`); torch's default, which Hugging Face's checkpoint gets, stops once
backward has what it needs, and re-runs less.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..layers import op_layer_indices
from ..schema import Decision, Profile
from ..units import fmt_bytes
from .baselines import checkpoint_layers
from .common import KEEP, RECOMPUTE, PlannerOutput, State, build_chains, build_cost_model

MATMULS = frozenset({"aten.mm.default", "aten.linear.default"})
FUSED_ATTENTION = frozenset({
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",   # the same kernel, as a fake
    #                                                                 trace on the CPU records it
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._flash_attention_forward.default",
    "aten._efficient_attention_forward.default",
})
SAVE_OPS = MATMULS | FUSED_ATTENTION | frozenset({
    "aten.addmm.default", "aten.bmm.default", "aten.convolution.default", "aten._scaled_mm.default",
    "aten.upsample_bilinear2d.default", "aten._scaled_dot_product_attention_math.default",
    "aten.max.default", "aten.topk.default", "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
})


@dataclass(frozen=True)
class CheckpointGap:
    """What torch's checkpoint does beyond the simulator's picture of a block-wise plan."""
    input_bytes: int        # block inputs the checkpoints save (activations from outside)
    derived_kept_bytes: int  # kept candidates that derive from those inputs (the profile's)
    cached_unread_bytes: int  # selective AC: cached outputs backward does not read
    replay_extra_us: float  # forward ops the replay re-runs that no recompute chain does
    replay_cached_us: float  # ops the recompute chains re-run that the cache serves instead

    @property
    def held_bytes(self) -> int:
        """Bytes torch holds from forward to backward beyond what the simulator keeps."""
        return self.input_bytes - self.derived_kept_bytes + self.cached_unread_bytes

    @property
    def time_us(self) -> float:
        return self.replay_extra_us - self.replay_cached_us


def _blocks(profile: Profile, hw, recompute_op) -> State:
    """The state that recomputes a block's candidate where `recompute_op(op_id)` says so of
    its producer and torch could (see the module docstring); everything else kept."""
    layers = op_layer_indices(profile)
    m = build_cost_model(profile, hw)
    ch = build_chains(m)
    actions = []
    for c, tid in enumerate(m.cands):
        b = m.layer[c]
        readers = [o for x in (tid, *profile.aliases.get(tid, ()))
                   for o in profile.tensors[x].consumers if o < m.nf]
        ok = (b is not None and bool(m.recomputable[c]) and bool(np.isfinite(ch.cost[c]))
              and all(layers[o] == b for o in readers)
              and all(layers[o] == b for o in ch.ops[c]))
        actions.append(RECOMPUTE if ok and recompute_op(int(m.p[c])) else KEEP)
    return State(m, actions, ch)


def _plan(profile: Profile, hw, recompute_op, what: str) -> tuple[PlannerOutput, State | None]:
    if all(x is None for x in op_layer_indices(profile)):
        keep = [Decision(tensor=t.id, action=KEEP) for t in profile.saved_activations]
        return PlannerOutput(keep, ("no repeated blocks found in module paths; kept "
                                    "everything",)), None
    state = _blocks(profile, hw, recompute_op)
    n_rec = sum(a == RECOMPUTE for a in state.actions)
    notes = (f"{what}: recomputed {n_rec} of {len(state.m.cands)} saved tensors, "
             f"{state.recompute_us():.0f} us of recompute",)
    return PlannerOutput(state.decisions(), notes), state


def sac_cached_ops(profile: Profile) -> set[int]:
    """The forward ops of the blocks whose outputs torchtitan's selective AC caches: those in
    `SAVE_OPS`, but only every other matmul of each block (the 1st, 3rd, ...)."""
    layers = op_layer_indices(profile)
    count: dict[int, int] = {}
    cached = set()
    for op in profile.ops[:profile.n_forward]:
        b = layers[op.id]
        if b is None:
            continue
        if op.target in MATMULS:
            count[b] = count.get(b, 0) + 1
            if count[b] % 2 == 1:
                cached.add(op.id)
        elif op.target in SAVE_OPS:
            cached.add(op.id)
    return cached


def torchtitan_sac(profile: Profile, hw, budget_bytes: int):
    cached = sac_cached_ops(profile)
    out, state = _plan(profile, hw, lambda op: op not in cached,
                       "torchtitan selective op AC")
    if state is not None:
        out = PlannerOutput(out.decisions, out.notes + (_gap_note(profile, state, cached),))
    return out


def full_ac(profile: Profile, hw, budget_bytes: int):
    out = checkpoint_layers(profile, hw, budget_bytes, k=1)
    notes = tuple(out.notes) + ("full AC: torch.utils.checkpoint around every block",)
    if all(x is None for x in op_layer_indices(profile)):
        return PlannerOutput(out.decisions, notes)
    m = build_cost_model(profile, hw)
    actions = {d.tensor: d.action for d in out.decisions}
    state = State(m, [actions[t] for t in m.cands])
    return PlannerOutput(out.decisions, notes + (_gap_note(profile, state, set()),))


def is_core_attention(profile: Profile, op_id: int) -> bool:
    """An op of the core attention: a fused attention kernel, or, in a module whose path
    names attention ("attn", "attention"), an op writing a (..., heads, seq, seq) matrix
    (the unfused path's scores, softmax, dropout; a convolution's square feature map is not
    one)."""
    op = profile.ops[op_id]
    if op.target in FUSED_ATTENTION:
        return True
    if "attn" not in op.module.lower() and "attention" not in op.module.lower():
        return False
    return any(len(sh) >= 4 and sh[-1] == sh[-2] > 1
               for sh in (profile.tensors[t].shape for t in op.outputs))


def megatron_selective(profile: Profile, hw, budget_bytes: int):
    return _plan(profile, hw, lambda op: is_core_attention(profile, op),
                 "Megatron selective recompute (core attention)")[0]


def checkpoint_gap(profile: Profile, state: State, cached: set[int]) -> CheckpointGap:
    """What torch's block checkpoint holds and re-runs beyond the simulator's picture of the
    plan in `state` (a block-wise plan: `full-ac` with `cached` empty, `torchtitan-sac` with
    `sac_cached_ops`). A block counts as checkpointed when the plan recomputes in it."""
    m, ch = state.m, state.ch
    layers = op_layer_indices(profile)
    ckpt = {m.layer[c] for c, a in enumerate(state.actions) if a == RECOMPUTE}
    chain_ops = {o for c, a in enumerate(state.actions) if a == RECOMPUTE for o in ch.ops[c]}
    saved = {t.id for t in profile.saved_activations}
    inputs, derived, unread, extra, served = set(), 0, 0, 0.0, 0.0
    for op in profile.ops[:profile.n_forward]:
        b = layers[op.id]
        if b not in ckpt:
            continue
        for t in op.inputs:
            src = profile.tensors[profile.root(t)]
            if src.kind == "activation" and src.producer is not None \
                    and layers[src.producer] != b:
                inputs.add(src.id)
        if op.id in cached:
            unread += sum(profile.tensors[t].size_bytes for t in op.outputs
                          if profile.tensors[t].alias_of is None and t not in saved)
            served += m.op_us[op.id] if op.id in chain_ops else 0.0
        elif op.id not in chain_ops:
            extra += m.op_us[op.id]
    for c, a in enumerate(state.actions):
        if a == KEEP and m.layer[c] in ckpt and m.cands[c] not in inputs \
                and any(layers[o] != m.layer[c] for o in ch.ops[c]):
            derived += int(m.size[c])
    in_bytes = sum(profile.tensors[t].size_bytes for t in inputs if t not in saved)
    return CheckpointGap(in_bytes, derived, unread, float(extra), float(served))


def _gap_note(profile, state, cached) -> str:
    g = checkpoint_gap(profile, state, cached)
    more = "more" if g.held_bytes >= 0 else "less"
    return (f"not simulated: torch's checkpoint holds {fmt_bytes(abs(g.held_bytes))} {more} "
            f"(the blocks' inputs, {fmt_bytes(g.input_bytes)}, where this plan keeps "
            f"{fmt_bytes(g.derived_kept_bytes)} derived from them; cached outputs backward does "
            f"not read, {fmt_bytes(g.cached_unread_bytes)}) and its replay takes "
            f"{abs(g.time_us):.0f} us {'more' if g.time_us >= 0 else 'less'}")
