"""torchtitan's Llama 3.1 405B pipeline runs (FSDP 8 x TP 8 x PP 8, full AC, 1F1B and
Interleaved1F1B) predicted per rank in simulation: each rank's peak memory against the
published one, and what a per-stage slackswap plan gives at the same memory.

Published (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 5; torchtitan
9dec370, torch 1963fc8, 2024-12): 512 H100s (96 GB HBM2e), FSDP 8, TP 8, PP 8, local batch 32,
global batch 256, full activation checkpointing, torch.compile, Float8 linears, AsyncTP; per
GPU 1F1B 100 tokens/s and 82.5 GiB, Interleaved 1F1B 128 tokens/s and 72.7 GiB, the memory
the largest over all GPUs of torch's max reserved memory (its footnote; torchtitan's
metrics module logs `reserved_bytes.all.peak`).

Read from torchtitan at 9dec370 (nothing here is fitted to the published figures):

- the model (torchtitan's llama package: its flavors and model module): 126 layers, dim 16384, 128
  heads, 8 key/value heads, FFN 53248 (4 x 16384, x 2/3, x 1.2, rounded up to 4096), vocab
  128256; sequence 8192 (train_configs/llama3_405b.toml: seq_len 8192, AdamW, full AC);
- microbatches: `pipeline_parallel_microbatches` unset in the toml, so the PP degree, 8
  (torchtitan's pipeline_llama module, pipelining_utils.build_pipeline_schedule): a microbatch is 32 / 8 = 4
  sequences;
- the split (pipelining_utils.generate_split_points, no split points given): 1F1B 8 stages of
  15, 16 x 6, 15 layers; Interleaved1F1B 2 stages a rank (a multi-stage schedule's default),
  16 stages of 7, 8 x 14, 7 layers, rank r running stages r and r + 8; the first stage holds
  the embeddings, the last the final norm, the output projection and the loss;
- TP (parallelize_llama.apply_tp): sequence parallel norms, column-wise wq/wk/wv/w1/w3,
  row-wise wo/w2 (outputs reduce-scattered to sequence shards), the embedding row-wise
  (vocabulary shards, output sequence-sharded), the output projection column-wise with loss
  parallel (logits vocabulary-sharded);
- FSDP2 (apply_fsdp): bf16 parameters in compute, fp32 gradient reduction, and with PP
  `reshard_after_forward=False` on every block and the root; torch's pipeline stage runs every
  backward but the last microbatch's without gradient sync or reshard
  (`backward_maybe_with_nosync`), so a stage's parameters stay unsharded and its gradients
  accumulate unsharded in the reduce dtype (FSDP2's `to_accumulated_grad_if_needed`) until the
  step's last backward.

What is counted per rank (GPU), every figure its own column in the results:

1. **sharded state**: the rank's stages' parameters at TP-local sizes sharded over FSDP 8,
   fp32 parameters and AdamW's two fp32 moments, 12 bytes a parameter;
2. **unsharded parameters**: the stages' TP-local parameters all step long, the linears of
   the blocks in float8 (1 byte: `enable_fsdp_float8_all_gather`), the embedding, the output
   projection (torchtitan leaves it out of float8) and the norms in bf16;
3. **unsharded gradients**: every TP-local parameter's gradient accumulated in fp32 across the
   microbatches (4 bytes a parameter; a block's bf16 gradient before it is added is in 5);
4. **activations under full AC**: the per-rank peak (`stages.rank_peak` over the schedule's
   order, the (chunk-)microbatches in flight, each stage's `full-ac` plan on its fake-tensor
   profile: checkpointed block inputs for every microbatch held, the running microbatch's
   replay of one block and its backward, PipelineStage's output and gradients; the
   checkpoint gap counted: torch's checkpoint keeps each block's bf16 input where the
   simulated plan keeps fp32 copies derived from it);
5. **bf16 gradients in flight**: one block's TP-local parameters in bf16 (a block's gradient
   before FSDP adds it to the fp32 accumulation);
6. **receive buffers**: one per microbatch for each stage's input (not the first stage) and
   its output's gradient (not the last), each a sequence-sharded activation
   (4 x 1024 x 16384 bf16), allocated once and kept (torch 2.6's PipelineStage);
7. **the last stage's outputs**: torch's schedule keeps every microbatch's output on the last
   stage (`output_chunks`, merged for `step()`'s return): at its last backward 7 more
   vocabulary-sharded bf16 logits than the running microbatch's (counted in 4, as
   PipelineStage's output).

Not counted: the caching allocator's reserve beyond what it hands out (the published figure is
max reserved: rounding and fragmentation), float8's own casts (the profile is traced in bf16:
a replayed block's float8 copies of its inputs and weights), torch.compile's buffers, AsyncTP's
symmetric memory, the sharded fp32 gradients after the last reduce-scatter (the activations are
gone by then: `end_of_step_gib` shows that point), NCCL's buffers (outside the allocator).

The profiles: the stage modules below (`stage_workload`: the first, a middle and the last
stage, TP-local sizes, bf16), traced with `--device fake` (nothing allocated) on
`h100-sxm-96gb` at each stage's own depth (1F1B: 15 and 16 layers, Interleaved1F1B: 7 and 8),
and at 2 and 3 layers for the slackswap comparison. A few layers extrapolated do not give the
middle ranks' peaks: under full AC the simulated peak of a 2-5 layer stage sits where its
fp32 norm inputs (the checkpoint gap's derived copies) weigh, and falls per layer, then rises
by the checkpointed block input per layer from about 5 layers on, so each stage's figures
extrapolated linearly from 2 and 3 layers miss the 1F1B middle ranks by -29% to -68% at 16
layers (the first and last ranks by 0.0%): `--check-depth 16` prints it. A TP collective is
written as the local tensor op that allocates what it does: an all-gather of the sequence
shards as `repeat` (its backward sums, as its reduce-scatter does), a reduce-scatter as a
slice made contiguous (its backward a full-size gradient, as an all-gather's).

slackswap at the same memory: each rank's stages planned by `plan_stages` for the rank's
full-AC activation peak as its budget, each stage's plan made for its peak and for what a
microbatch holds from its forward to its backward (pipeline/inflight.py: the rank holds that
once per microbatch in flight), with the windows' judge (pipeline/windows.py, link factors
`WINDOW_FACTORS`: every rank's plans judged on its schedule with its copies on its two
engines, the real link; 0.5 where the copies of the microbatches in flight would otherwise
hold more than the budget leaves), on the 2- and 3-layer profiles themselves (a plan's
structure changes with the depth, so its figures are not extrapolated; `--at-depth` plans at
the run's depths too, slow): each rank's least peak with every stage at its floor beside full
AC's, the judged peak of the plans made for full AC's, and their judged step (bubbles
included) against full AC's at the same depths. The judge issues a copy back during an
earlier action of the rank where memory allows; the patched runtime issues it inside the
microbatch's own backward (docs/pipeline.md), so these steps are the planning core's, not
yet what `plan_pipeline` runs. Full AC's step: the rank-level judge over the schedule's
order, each stage's compute from its profile at its depth (the replay and the checkpoint
gap's included). Tokens/s per GPU as torchtitan counts them: the local batch (32 x 8192
tokens) per step over the TP x PP = 64 GPUs that run it; compute only (no TP, FSDP or PP
communication), bf16 matmuls at the preset's peak (no float8).

    python benchmarks/published_pipeline.py      # writes benchmarks/results/published_pipeline.{json,md}
    python benchmarks/published_pipeline.py --profiles /tmp/p405   # keeps (and reuses) the traces
    python benchmarks/published_pipeline.py --at-depth   # slackswap planned at 15-16 / 7-8 layers too
    python benchmarks/published_pipeline.py --check-depth 16   # 2 and 3 layers extrapolated against 16
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30

# torchtitan 9dec370: Llama 3.1 405B and Table 5's run
DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB = 16384, 126, 128, 8, 53248, 128256
HEAD_DIM = DIM // HEADS
SEQ, LOCAL_BATCH, MICROBATCHES, TP, PP, FSDP = 8192, 32, 8, 8, 8, 8
MICRO = LOCAL_BATCH // MICROBATCHES
HARDWARE = "h100-sxm-96gb"
# the copy link factors the windows' search plans at (pipeline/windows.py): below 1 where the
# copies of the microbatches in flight hold more than the budget leaves
WINDOW_FACTORS = (0.5, 1.0)
MEASURED = {"1F1B": (82.5, 100.0), "Interleaved1F1B": (72.7, 128.0)}   # GiB, tokens/s per GPU
SOURCE = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md Table 5 "
          "(torchtitan 9dec370, torch 1963fc8)")


def split(stages: int) -> list[int]:
    """Layers per stage as torchtitan's generate_split_points splits 126 layers."""
    base, extra = divmod(LAYERS, stages)
    sizes, done = [], 0
    for i in range(stages - 1):
        step = base if i == 0 or extra == 0 else base + 1
        if i > 0 and extra > 0:
            extra -= 1
        sizes.append(step)
        done += step
    return sizes + [LAYERS - done]


def gather(x):
    """The sequence shards all-gathered (see the module docstring)."""
    return x.repeat(1, TP, 1)


def scatter(x):
    """Partial sums reduce-scattered to this rank's sequence shard (see the docstring)."""
    return x[:, : x.shape[1] // TP].contiguous()


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(DIM, dtype=torch.bfloat16))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def _rotary(x, cos, sin):
    """torchtitan's rotary embedding, computed in fp32 and returned in x's dtype."""
    xf = x.float().view(*x.shape[:-1], -1, 2)
    a, b = xf[..., 0], xf[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(3).type_as(x)


def _linear(n_in, n_out):
    return nn.Linear(n_in, n_out, bias=False, dtype=torch.bfloat16)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads, self.kv = HEADS // TP, KV_HEADS // TP
        self.wq, self.wo = _linear(DIM, self.heads * HEAD_DIM), _linear(self.heads * HEAD_DIM, DIM)
        self.wk, self.wv = _linear(DIM, self.kv * HEAD_DIM), _linear(DIM, self.kv * HEAD_DIM)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        q = _rotary(self.wq(x).view(b, s, self.heads, HEAD_DIM), cos, sin)
        k = _rotary(self.wk(x).view(b, s, self.kv, HEAD_DIM), cos, sin)
        v = self.wv(x).view(b, s, self.kv, HEAD_DIM)
        rep = self.heads // self.kv             # torchtitan's repeat_kv: expand and reshape
        k = k[:, :, :, None].expand(b, s, self.kv, rep, HEAD_DIM).reshape(b, s, -1, HEAD_DIM)
        v = v[:, :, :, None].expand(b, s, self.kv, rep, HEAD_DIM).reshape(b, s, -1, HEAD_DIM)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = _linear(DIM, FFN // TP), _linear(DIM, FFN // TP)
        self.w2 = _linear(FFN // TP, DIM)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(), Attention()
        self.ffn_norm, self.feed_forward = RMSNorm(), FeedForward()

    def forward(self, x, cos, sin):
        h = x + scatter(self.attention(gather(self.attention_norm(x)), cos, sin))
        return h + scatter(self.feed_forward(gather(self.ffn_norm(h))))


class Stage(nn.Module):
    """One pipeline stage at TP-local sizes: `first` with the embedding, `last` with the norm
    and the output projection."""

    def __init__(self, layers: int, first: bool, last: bool):
        super().__init__()
        self.tok_embeddings = (nn.Embedding(VOCAB // TP, DIM, dtype=torch.bfloat16)
                               if first else None)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = RMSNorm() if last else None
        self.output = _linear(DIM, VOCAB // TP) if last else None
        freqs = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
        angles = torch.outer(torch.arange(SEQ).float(), freqs)[:, None, :]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        h = scatter(self.tok_embeddings(x)) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h, self.cos, self.sin)
        if self.output is None:
            return h
        return self.output(gather(self.norm(h)))


def _stand_in(out, inputs):
    return out.float().sum()


def stage_workload(kind="middle", layers=2):
    """A stage (`kind`: first, middle or last) of `layers` blocks, one microbatch's input: the
    token ids on the first stage, else the sequence-sharded hidden state taking a gradient;
    the loss: vocabulary-sharded cross-entropy on the last stage, a stand-in sum elsewhere."""
    torch.manual_seed(0)
    module = Stage(layers, kind == "first", kind == "last")
    if kind == "first":
        x = torch.randint(0, VOCAB // TP, (MICRO, SEQ))
    else:
        x = torch.randn(MICRO, SEQ // TP, DIM, dtype=torch.bfloat16, requires_grad=True)
    if kind != "last":
        return module, (x,), _stand_in
    target = torch.randint(0, VOCAB // TP, (MICRO, SEQ))
    return module, (x,), lambda out, inputs: F.cross_entropy(out.flatten(0, 1).float(),
                                                             target.flatten())


# ---- the prediction (imports of the planning library kept here: the workload above is
# ---- imported by `slackswap profile` too)

def _profile(kind: str, layers: int, out: Path):
    from slackswap_cli.schema import load_profile
    path = out / f"405b_{kind}_l{layers}.profile.json"
    if not path.exists():
        exe = Path(sys.executable).with_name("slackswap")
        subprocess.run([str(exe), "profile", str(Path(__file__).resolve()), "--entry",
                        "stage_workload", "--device", "fake", "--hardware", HARDWARE,
                        "--arg", f"kind='{kind}'", "--arg", f"layers={layers}",
                        "-o", str(path), "-q"], check=True, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    return load_profile(path)


def _kind(stage: int, n_stages: int) -> str:
    return "first" if stage == 0 else "last" if stage == n_stages - 1 else "middle"


def _full_ac(prof, hw):
    """(the full-AC plan, its checkpoint gap: what torch's checkpoint holds and re-runs beyond
    the simulator's picture, as benchmarks/published_runs.py counts it)."""
    from dataclasses import replace

    from slackswap_cli.planners import make_plan
    from slackswap_cli.planners.ac_settings import checkpoint_gap
    from slackswap_cli.planners.common import State, build_cost_model
    plan = make_plan("full-ac", prof, hw, 1 << 50)
    m = build_cost_model(prof, hw)
    acts = plan.actions()
    gap = checkpoint_gap(prof, State(m, [acts[t] for t in m.cands]), set())
    timed = replace(plan, predicted=replace(plan.predicted,
                                            step_us=plan.predicted.step_us + gap.time_us))
    return timed, gap


class Case:
    """One schedule at one set of stage depths: per stage its profile, full-AC plan and gap."""

    def __init__(self, schedule: str, depth: dict, profiles: dict, hw):
        from slackswap_cli.pipeline.orders import order
        self.schedule, self.hw = schedule, hw
        self.steps = order(schedule, PP, MICROBATCHES, 2)
        self.n = 1 + max(s for st in self.steps.values() for _, s, _ in st)
        self.profs = {s: profiles[_kind(s, self.n), depth[s]] for s in range(self.n)}
        self.ac = {s: profiles["ac", _kind(s, self.n), depth[s]] for s in range(self.n)}

    def costs(self) -> dict:
        """stage -> its StageCost under full AC, the checkpoint gap counted."""
        from dataclasses import replace

        from slackswap_cli.pipeline.stages import stage_cost
        from slackswap_cli.pipeline.step import SENDS_OF, boundaries
        bound = boundaries(self.profs, self.steps, SENDS_OF[self.schedule])
        cost = {}
        for s, (plan, gap) in self.ac.items():
            c = stage_cost(self.profs[s], plan, bound[s])
            cost[s] = replace(c, held_bytes=c.held_bytes + gap.held_bytes,
                              peak_bytes=c.peak_bytes + gap.held_bytes)
        return cost

    def ac_peaks(self, cost: dict | None = None) -> dict[int, int]:
        """rank -> its activation peak under full AC (`cost`: stage -> StageCost, by default
        this case's own)."""
        from slackswap_cli.pipeline.stages import rank_peak
        cost = self.costs() if cost is None else cost
        return {r: rank_peak(st, cost) for r, st in self.steps.items()}

    def ac_step_us(self) -> float:
        from slackswap_cli.pipeline.step import pipeline_figures
        return pipeline_figures(self.profs, {s: p for s, (p, _) in self.ac.items()},
                                self.schedule, PP, MICROBATCHES, 2, hw=self.hw).judged_step_us

    def _planner(self):
        from slackswap_cli.planners import make_plan
        memo: dict = {}

        def planner(prof, budget_bytes, hw=self.hw):
            # keyed by identity, the profile kept beside its plan so that its id stays its
            # own (a stage planned with a hold passes a profile made for the call)
            key = (id(prof), budget_bytes, hw.name)
            if key not in memo:
                memo[key] = (prof, make_plan("slackswap", prof, hw, budget_bytes))
            return memo[key][1]
        return planner

    def least(self) -> dict[int, int]:
        """rank -> the least activation peak of its stages' slackswap plans (each stage at its
        floor, for its peak alone and with the hold at its floor: `plan_stages` finds nothing
        below it)."""
        from slackswap_cli.pipeline.stages import _least
        from slackswap_cli.pipeline.step import SENDS_OF, boundaries
        bound = boundaries(self.profs, self.steps, SENDS_OF[self.schedule])
        planner, shared = self._planner(), {}
        return {r: _least(st, sorted({s for _, s, _ in st}), self.profs, planner, bound, shared)
                for r, st in self.steps.items()}

    def slackswap(self, budget: dict[int, int]) -> dict:
        """Each rank's stages planned by slackswap for `budget` (rank -> bytes), the windows'
        search (`plan_stages(..., windows=...)` at `WINDOW_FACTORS`: every rank judged with
        its copies on its engines): the judged step, and per rank its judged peak, the peak
        and hold fractions and the link factor its plans were made at, bytes swapped and
        recomputed a step."""
        from slackswap_cli.pipeline.stages import plan_stages
        from slackswap_cli.pipeline.step import SENDS_OF, boundaries, pipeline_figures
        from slackswap_cli.pipeline.windows import Windows
        bound = boundaries(self.profs, self.steps, SENDS_OF[self.schedule])
        table = plan_stages(self.steps, self.profs, budget, None, bound,
                            windows=Windows(self._planner(), self.hw, WINDOW_FACTORS))
        figs = pipeline_figures(self.profs, table.plans, self.schedule, PP, MICROBATCHES, 2,
                                budget, 1e6 / self.hw.d2h_bytes_per_s, hw=self.hw)
        return {"step_us": figs.judged_step_us,
                "ranks": [{"rank": r.rank, "budget_gib": r.budget_bytes / GIB,
                           "judged_peak_gib": figs.judged_peak_bytes[r.rank] / GIB,
                           "fraction": r.fraction, "held_fraction": r.held_fraction,
                           "link_factor": r.link_factor,
                           "swapped_gib": r.swapped_bytes / GIB,
                           "recomputed_gib": r.recomputed_bytes / GIB} for r in table.rows]}


def _params(layers: int, first: bool, last: bool) -> tuple[int, int]:
    """(float8 linear parameters, bf16 parameters) of a stage, TP-local."""
    block = (2 * DIM * (HEADS // TP) * HEAD_DIM + 2 * DIM * (KV_HEADS // TP) * HEAD_DIM
             + 3 * DIM * (FFN // TP))
    other = layers * 2 * DIM + (VOCAB // TP * DIM if first else 0) \
        + ((VOCAB // TP + 1) * DIM if last else 0)
    return layers * block, other


def static_parts(stages: list[tuple[int, bool, bool]]) -> dict:
    """A rank's memory beside its activations (bytes; the module docstring's items 1-3, 5-7)
    for its stages (layers, first, last)."""
    lin = sum(_params(*st)[0] for st in stages)
    other = sum(_params(*st)[1] for st in stages)
    block_lin = _params(1, False, False)[0]
    boundary = MICRO * (SEQ // TP) * DIM * 2
    return {"sharded_state": 12 * (lin + other) // FSDP,
            "unsharded_params": lin + 2 * other,
            "unsharded_grads_fp32": 4 * (lin + other),
            "bf16_grads_in_flight": 2 * (block_lin + 2 * DIM),
            "receive_buffers": MICROBATCHES * boundary * sum((not f) + (not la)
                                                             for _, f, la in stages),
            "last_stage_outputs": (MICROBATCHES - 1) * MICRO * SEQ * (VOCAB // TP) * 2
            * sum(la for _, _, la in stages),
            "sharded_grads_fp32": 4 * (lin + other) // FSDP}


def deep_costs(two: "Case", three: "Case", layers: list[int]) -> dict:
    """stage -> its full-AC StageCost at `layers[stage]` layers, each field extrapolated
    linearly from the 2- and 3-layer traces (a stage's figures are linear in its layers; a
    rank's peak, the largest over the schedule's steps, is not, so it is taken after)."""
    from dataclasses import fields, replace
    c2, c3 = two.costs(), three.costs()
    return {s: replace(c2[s], **{f.name: getattr(c2[s], f.name) + (n - 2) * (
        getattr(c3[s], f.name) - getattr(c2[s], f.name)) for f in fields(c2[s])})
        for s, n in enumerate(layers)}


def depths(schedule: str) -> list[int]:
    return split(PP * (2 if schedule == "Interleaved1F1B" else 1))


def predict(schedule: str, profiles: dict, hw, at_depth: bool = False) -> dict:
    sizes = depths(schedule)
    n = len(sizes)
    cases = {k: Case(schedule, dict.fromkeys(range(n), depth), profiles, hw)
             for k, depth in (("A", 2), ("D", 3))}
    cases["run"] = Case(schedule, dict(enumerate(sizes)), profiles, hw)
    act = {k: c.ac_peaks() for k, c in cases.items()}
    rows = []
    for rank, steps in sorted(cases["A"].steps.items()):
        stages = sorted({s for _, s, _ in steps})
        parts = static_parts([(sizes[s], s == 0, s == n - 1) for s in stages])
        activations = act["run"][rank]
        peak = sum(v for k, v in parts.items() if k != "sharded_grads_fp32") + activations
        end = (parts["sharded_state"] + parts["sharded_grads_fp32"] + parts["receive_buffers"]
               + parts["last_stage_outputs"])
        rows.append({"rank": rank, "stages": stages, "layers": [sizes[s] for s in stages],
                     **{f"{k}_gib": v / GIB for k, v in parts.items()},
                     "activations_gib": activations / GIB, "peak_gib": peak / GIB,
                     "end_of_step_gib": end / GIB})
    measured, tps = MEASURED[schedule]
    worst = max(rows, key=lambda r: r["peak_gib"])
    out = {"schedule": schedule, "measured_gib": measured, "measured_tokens_per_s": tps,
           "predicted_gib": worst["peak_gib"], "worst_rank": worst["rank"],
           "error": worst["peak_gib"] / measured - 1, "ranks": rows, "stage_layers": sizes}
    out.update(_slackswap(cases, act, at_depth))
    return out


def _slackswap(cases: dict, act: dict, at_depth: bool = False) -> dict:
    """Full AC's step at the run's depths and, at 2 and 3 layers a stage (and at the run's
    depths with `at_depth`), each rank's full-AC activation peak against the least
    slackswap's per-stage plans reach (each stage at its floor), and where they reach full
    AC's, the step of those plans (`Case.slackswap`; None where the windows' judge keeps no
    plan under it)."""
    from slackswap_cli.errors import InfeasibleError
    tokens = LOCAL_BATCH * SEQ / (TP * PP)
    ac_us = cases["run"].ac_step_us()
    traced = {}
    for k, layers in (("A", 2), ("D", 3)) + ((("run", "run"),) if at_depth else ()):
        least = cases[k].least()
        ours = None
        if all(least[r] <= act[k][r] for r in least):
            try:
                ours = cases[k].slackswap(act[k])
            except InfeasibleError:
                pass
        ac = ac_us if k == "run" else cases[k].ac_step_us()
        traced[layers] = {"ac_gib": [act[k][r] / GIB for r in sorted(act[k])],
                          "slackswap_least_gib": [least[r] / GIB for r in sorted(least)],
                          "ac_step_s": ac / 1e6,
                          "slackswap_step_s": None if ours is None else ours["step_us"] / 1e6,
                          "slackswap_ranks": None if ours is None else ours["ranks"],
                          "ac_tokens_per_s": tokens / ac * 1e6,
                          "slackswap_tokens_per_s": (None if ours is None
                                                     else tokens / ours["step_us"] * 1e6)}
    return {"ac_step_s": ac_us / 1e6, "ac_tokens_per_s": tokens / ac_us * 1e6,
            "at_traced_depth": traced}


def write_md(results: list[dict], path: Path) -> None:
    lines = ["# torchtitan's Llama 3.1 405B pipeline runs, per rank in simulation", "",
             f"`python benchmarks/published_pipeline.py` (what is counted and every assumption: "
             f"its docstring). Source: {SOURCE}. FSDP 8 x TP 8 x PP 8, local batch 32 (8 "
             "microbatches of 4 x 8192 tokens), full AC. Per GPU; measured: the largest max "
             "reserved memory over all GPUs; predicted: what the allocator hands out at the "
             "worst rank's peak (no reserve, no float8 casts, no compile buffers).", "",
             "| schedule | measured | predicted (worst rank) | error |", "|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['schedule']} | {r['measured_gib']:.1f} GiB | "
                     f"{r['predicted_gib']:.1f} GiB (rank {r['worst_rank']}) | "
                     f"{100 * r['error']:+.1f}% |")
    cols = ("sharded_state", "unsharded_params", "unsharded_grads_fp32", "bf16_grads_in_flight",
            "receive_buffers", "last_stage_outputs", "activations", "peak", "end_of_step")
    for r in results:
        lines += ["", f"{r['schedule']}, per rank (GiB; layers per stage "
                  f"{', '.join(map(str, r['stage_layers']))}):", "",
                  "| rank | stages (layers) | " + " | ".join(c.replace("_", " ") for c in cols)
                  + " |", "|---|---|" + "---:|" * len(cols)]
        for x in r["ranks"]:
            st = ", ".join(f"{s} ({n})" for s, n in zip(x["stages"], x["layers"]))
            lines.append(f"| {x['rank']} | {st} | "
                         + " | ".join(f"{x[c + '_gib']:.2f}" for c in cols) + " |")
    lines += ["", "Full AC's step, compute only (no TP, FSDP or PP communication, bf16 matmuls "
              "at the preset's peak, no float8), each stage traced at its depth:", "",
              "| schedule | full AC step | tokens/s per GPU | measured tokens/s |",
              "|---|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['schedule']} | {r['ac_step_s']:.1f} s | {r['ac_tokens_per_s']:.0f} "
                     f"| {r['measured_tokens_per_s']:.0f} |")
    lines += ["", "slackswap's per-stage plans (`plan_stages` with the windows' judge, link "
              f"factors {', '.join(f'{f:g}' for f in WINDOW_FACTORS)}) at full AC's memory "
              "per rank, each stage's plan made for its peak and for what a microbatch holds "
              "from its forward to its backward (pipeline/inflight.py), at 2 and 3 layers a "
              "stage (and at the run's depths with `--at-depth`; `slackswap vs full AC`: "
              "full AC's step over slackswap's; GiB of activations per rank: full AC's, "
              "checkpoint gap counted / the least slackswap's plans reach, each stage at its "
              "floor / the judged peak of the plans made for full AC's):", "",
              "| schedule | layers a stage | " + " | ".join(f"rank {i}" for i in range(PP))
              + " | full AC step | slackswap step | tokens/s per GPU (full AC / slackswap, as "
              "run) | slackswap vs full AC |", "|---|---|" + "---:|" * (PP + 4)]
    for r in results:
        for layers, t in r["at_traced_depth"].items():
            ours = t["slackswap_ranks"] or [{}] * PP
            cells = " | ".join(f"{a:.2f} / {b:.2f} / " + (
                f"{o['judged_peak_gib']:.2f}" + (" (over)" if o["judged_peak_gib"]
                                                 > o["budget_gib"] else "") if o else "-")
                for a, b, o in zip(t["ac_gib"], t["slackswap_least_gib"], ours))
            step = t["slackswap_step_s"]
            # tokens/s only where the stages are the run's (2 or 3 layers a stage are not)
            tps = (f"{t['ac_tokens_per_s']:.0f} / {t['slackswap_tokens_per_s']:.0f}"
                   if layers == "run" and step is not None else "-")
            lines.append(f"| {r['schedule']} | "
                         f"{'as run' if layers == 'run' else layers} | {cells} | "
                         f"{t['ac_step_s']:.2f} s | "
                         + ("no plan | - | no plan |" if step is None else
                            f"{step:.2f} s | {tps} | {t['ac_step_s'] / step:.3f}x |"))
    lines += ["", "Each rank's plans where they fit (peak fraction / hold fraction, 1: no "
              "hold / copy link factor; GiB swapped + recomputed a step):", ""]
    for r in results:
        for layers, t in r["at_traced_depth"].items():
            if t["slackswap_ranks"]:
                lines.append(f"- {r['schedule']}, {'as run' if layers == 'run' else layers} "
                             "layers: " + "; ".join(
                                 f"rank {o['rank']} {o['fraction']:.3f} / "
                                 f"{o['held_fraction']:.3f} / x{o['link_factor']:g} "
                                 f"({o['swapped_gib']:.1f} + {o['recomputed_gib']:.1f})"
                                 for o in t["slackswap_ranks"]))
    path.write_text("\n".join(lines) + "\n")


def check_depth(layers: int, keep: Path, hw) -> None:
    """Print each 1F1B rank's full-AC activation peak with every stage at `layers` layers,
    traced directly, against the one from the 2- and 3-layer stage costs extrapolated."""
    profiles = {}
    for kind in ("first", "middle", "last"):
        for n in (2, 3, layers):
            prof = _profile(kind, n, keep)
            profiles[kind, n], profiles["ac", kind, n] = prof, _full_ac(prof, hw)
    case = {n: Case("1F1B", dict.fromkeys(range(PP), n), profiles, hw) for n in (2, 3, layers)}
    guess = case[2].ac_peaks(deep_costs(case[2], case[3], [layers] * PP))
    traced = case[layers].ac_peaks()
    for rank in range(PP):
        print(f"rank {rank}: {layers} layers a stage, extrapolated {guess[rank] / GIB:.3f} GiB, "
              f"traced {traced[rank] / GIB:.3f} GiB ({guess[rank] / traced[rank] - 1:+.3%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", type=Path, default=None,
                    help="keep the traced profiles in this folder (and reuse them)")
    ap.add_argument("--at-depth", action="store_true",
                    help="plan slackswap at the run's stage depths too (15-16 and 7-8 layers; "
                         "slow), beside 2 and 3 layers")
    ap.add_argument("--check-depth", type=int, default=None, metavar="N",
                    help="only compare the extrapolation with a direct trace of N layers")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from slackswap_cli.hardware import PRESETS
    hw = PRESETS[HARDWARE]
    with tempfile.TemporaryDirectory() as tmp:
        keep = args.profiles or Path(tmp)
        keep.mkdir(parents=True, exist_ok=True)
        if args.check_depth:
            check_depth(args.check_depth, keep, hw)
            return
        profiles = {}
        need = {(kind, n) for kind in ("first", "middle", "last") for n in (2, 3)}
        for schedule in ("1F1B", "Interleaved1F1B"):
            sizes = depths(schedule)
            need |= {(_kind(s, len(sizes)), n) for s, n in enumerate(sizes)}
        for kind, layers in sorted(need):
            prof = _profile(kind, layers, keep)
            profiles[kind, layers] = prof
            profiles["ac", kind, layers] = _full_ac(prof, hw)
        results = [predict(s, profiles, hw, args.at_depth) for s in ("1F1B", "Interleaved1F1B")]
    out = ROOT / "benchmarks" / "results"
    (out / "published_pipeline.json").write_text(json.dumps(results, indent=1) + "\n")
    write_md(results, out / "published_pipeline.md")
    print((out / "published_pipeline.md").read_text())


if __name__ == "__main__":
    main()
