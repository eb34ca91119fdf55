"""Published bf16 training runs, predicted: tokens/s and peak memory per GPU, and what
slackswap's plan gives instead at the same memory.

Each run (`RUNS`) is a measured torchtitan run with its configuration stated in its source
(pytorch/torchtitan; file and commit named per run): Llama 3 8B / 70B, FSDP2 over N GPUs,
bf16 compute with fp32 parameters, gradients reduced in fp32, AdamW, no float8, no
torch.compile. For each:

1. **Profile.** `examples/llama3.py` (Hugging Face's Llama at the run's size, SDPA) traced with
   `--device fake` on the GPU's preset, at the run's local batch and sequence, with 2 and 3
   layers. Every figure below is computed on both and extrapolated linearly to the run's
   depth: v(L) = v(2) + (L - 2) (v(3) - v(2)) (the blocks repeat; the embeddings, head and
   loss are in the constant part).
2. **AC setting.** The run's setting through its baseline planner (`torchtitan-sac` or
   `full-ac`; no AC: `recompute-only` with no memory limit, which keeps everything), judged
   by the simulator with no memory limit: step time, activation peak; plus `checkpoint_gap`
   (what torch's checkpoint holds and re-runs beyond that picture; none without AC).
3. **FSDP.** Static memory per GPU: fp32 parameters, fp32 gradients and AdamW's two fp32
   states, sharded over N (16 bytes per parameter / N); the unsharded bf16 parameters of two
   blocks (the one running and the one prefetched) and of the root (embeddings, final norm,
   head: FSDP2 keeps the root unsharded through the step). Communication: every block's bf16
   parameters are all-gathered in forward and again in backward (but the last block's,
   which torchtitan does not reshard after forward), its gradients reduce-scattered in
   fp32, (N - 1) / N of the bytes each over the link (`LINKS`: a ring's bus bandwidth per
   GPU times 0.8; between hosts the host's eight NICs together). FSDP2 prefetches the next
   block's all-gather under the current block's compute, so per block only what exceeds the
   block's compute is exposed, plus the first all-gather and the last reduce-scatter (and the
   root's, once each); the compute beside the hidden part runs slower by a published average
   (`OVERLAP_SLOWDOWN`).
4. **Predicted:** tokens/s per GPU = local batch x seq / (step + exposed communication + the
   overlap's slowdown + optimizer step: AdamW and gradient clipping over the shard, memory
   bound + FSDP2's copies on the compute stream: each all-gather's output copied into the unsharded
   parameters, each block's bf16 gradients cast into the fp32 reduce-scatter input,
   `COPY_OUT_BYTES` and `COPY_IN_BYTES`, priced as memory-bound copies);
   peak memory per GPU = static + activation peak + checkpoint gap: what the caching
   allocator hands out at the peak. The published figure is torch's max *reserved* memory:
   predicted reserved adds what FSDP2's own streams keep cached at that peak
   (`ROOT_POOL_BYTES`: the root's all-gather output and fp32 reduce-scatter input). Not
   counted: fragmentation within the default stream's pool, cuBLAS workspaces (MiBs); the
   CUDA context and NCCL's buffers are not torch's reserved memory. Retries that free cached
   blocks when the GPU runs out are not modelled (reserved assumes memory to spare).
5. **slackswap at the same memory:** slackswap's plan on each profile, with the activation
   budget the AC setting used there (its simulated peak plus the checkpoint gap), extrapolated
   the same way; FSDP communication as above.

One figure is fitted to these runs, and declared as such: the presets'
`bf16_sustained_fraction` (`slackswap_cli/hardware.py` [FIT], `BF16_SUSTAINED_FRACTION`), what
fraction of the sourced tensor-core rates below a training step sustains. `calibration` fits
it (benchmarks/bf16_fit.py: least squares on log(measured / predicted tokens/s), the runs
predicted with it at 1) on all eight runs, on all but one run at a time (each run's error at
the fraction fitted on the other seven) and on one GPU kind's runs to predict the other's;
the tables show the uncalibrated, calibrated and left-out errors. Everything else is sourced,
not fitted: the presets' peaks are datasheet figures (the 500 W H100's
interpolated between two datasheets), their bf16 GEMM and fused-attention fractions are
published kernel measurements (`slackswap_cli/hardware.py`, [EFF] and [ATTN]: best shapes and
"up to" figures, so an upper bound on speed), the cost model's other constants are
`op_costs.json`'s (fitted on fp32 steps of other models), the link rates are stated in `LINKS`,
FSDP2's copies and side-stream pools are read from torch's FSDP2 code (`COPY_OUT_BYTES`,
`COPY_IN_BYTES`, `ROOT_POOL_BYTES`). The breakdown table (where each predicted step goes)
sums the op times of the traces by class, extrapolated like every other figure.

    python benchmarks/published_runs.py   # writes benchmarks/results/published_runs.{json,md}
    python benchmarks/published_runs.py --profiles /tmp/runs   # keeps the traces to reuse
    python benchmarks/published_runs.py --check-depth 8   # the extrapolation against 8 layers
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bf16_fit import fit_fraction, leave_kind_out, leave_one_out  # noqa: E402
from slackswap_cli.hardware import BF16_SUSTAINED_FRACTION, PRESETS  # noqa: E402
from slackswap_cli.op_cost import (  # noqa: E402
    default_cost_model,
    op_class,
    op_time_us,
    price_profile,
)
from slackswap_cli.planners import make_plan  # noqa: E402
from slackswap_cli.planners.ac_settings import checkpoint_gap, sac_cached_ops  # noqa: E402
from slackswap_cli.planners.common import State, build_cost_model  # noqa: E402
from slackswap_cli.schema import load_profile  # noqa: E402

GIB = 1 << 30
TT = "pytorch/torchtitan"
# link -> (GB/s per direction a ring collective moves per GPU: its bus bandwidth, source). The
# rate used is 0.8 of it (NCCL's ring bus bandwidth on large messages reaches about 80-95% of
# the link: the NVIDIA/nccl-tests thread "Evaluation of NCCL test result", 2022, 85-96 GB/s
# measured against 100). Between hosts NCCL runs one ring per NIC, so a GPU's ring traffic
# leaves the host over all of its eight NICs at once: the bus bandwidth is the host's NIC
# bandwidth, 8x one GPU's (that thread: 24 A100s, 4 HDR NICs a host, busbw near the 100 GB/s
# the four NICs give together), up to NVLink's.
LINKS = {
    "nvlink4": (450.0, "NVLink 4 on H100 SXM: 900 GB/s both directions (H100 datasheet)"),
    "rdma400": (400.0, "400 Gb/s RDMA per GPU between hosts (the run's source states it): "
                       "8 x 50 GB/s a host, under NVLink 4's 450"),
    "ib200": (200.0, "200 Gb/s InfiniBand per GPU between hosts (8 x 25 GB/s a host, under "
                     "A100 NVLink 3's 300): assumed, the source does not state the A100 "
                     "cluster's network"),
}
LINK_EFFICIENCY = 0.8
# compute that runs beside a collective runs slower (NCCL's kernels take SMs and HBM
# bandwidth): "overlapping computation and communication can result in an average
# computational slowdown of 18.9%, with a maximum of 40.0%" ("Characterizing
# Compute-Communication Overlap in GPU-Accelerated Distributed Deep Learning: Performance and
# Power Implications", arXiv 2507.03114, its abstract: GPT and Llama models on 4 A100s, H100s,
# MI250s and MI210s): the average, applied to the compute that FSDP's hidden traffic overlaps
OVERLAP_SLOWDOWN = 0.189
# AdamW reads parameter, gradient and both moments and writes back parameter and moments (28
# bytes in fp32); clipping reads the gradient for its norm and scales it in place (12)
OPTIMIZER_BYTES = 28 + 12
# FSDP2's copies on the compute stream (pytorch/pytorch torch/distributed/fsdp/_fully_shard/,
# _composable/fsdp/ in 2024: read at 01d66d21f and 002a76fbf): `wait_for_unshard` copies each
# all-gather's output into the unsharded parameters (`foreach_all_gather_copy_out`) on the
# current stream: bf16 read and written, 4 bytes per parameter per unshard; the reduce-scatter
# copies the bf16 gradients into its fp32 input (`foreach_reduce_scatter_copy_in`, a cast)
# and the current stream waits for that copy before freeing the gradients: 2 bytes read and 4
# written per parameter per reduce-scatter
COPY_OUT_BYTES, COPY_IN_BYTES = 2 + 2, 2 + 4
# layers, hidden, kv heads x head dim, MLP, vocab (examples/llama3.py)
SIZES = {"8b": (32, 4096, 1024, 14336, 128256), "70b": (80, 8192, 1024, 28672, 128256),
         "llama2-13b": (40, 5120, 5120, 13824, 32000), "llama2-70b": (80, 8192, 1024, 28672, 32000)}


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    size: str
    hardware: str
    gpus: int
    link: str
    batch: int
    seq: int
    ac: str                      # the baseline planner of its AC setting ("none": keep all)
    tokens_per_s: float          # measured, per GPU
    memory_gib: float | None     # measured, per GPU (torch's max reserved), None: not published
    low_peak: float | None = None  # a lower dense bf16 peak the source allows (FLOP/s)
    low_peak_source: str = ""


# torchtitan's footnote: its H100's peak "is between SXM and NVL"
NVL = (835e12, "H100 NVL datasheet: 1,671 TFLOPS bf16 with sparsity, 835 dense")
RUNS = [
    Run("8B, 8x H100, FSDP 8, selective op AC", f"{TT} benchmarks/llama3_h100_202412_torchtitan.md "
        "Table 1 row FSDP (torchtitan 9dec370, torch 1963fc8)", "8b", "h100-sxm-96gb", 8,
        "nvlink4", 2, 8192, "torchtitan-sac", 5762, 82.4, *NVL),
    Run("8B, 128x H100, FSDP 128, selective op AC", f"{TT} benchmarks/llama3_h100_202412_"
        "torchtitan.md Table 3 row FSDP (torchtitan 9dec370)", "8b", "h100-sxm-96gb", 128,
        "rdma400", 2, 8192, "torchtitan-sac", 5605, 67.0, *NVL),
    Run("8B, 64x A100, FSDP 64, selective op AC", f"{TT} docs/performance.md at 1ea476e9f "
        "(2024-04-24), train_configs/llama3_8b.toml there (seq 8192)", "8b", "a100-pcie4", 64,
        "ib200", 1, 8192, "torchtitan-sac", 2973, None),
    Run("70B, 64x A100, FSDP 64, full AC", f"{TT} docs/performance.md at 1ea476e9f "
        "(2024-04-24), train_configs/llama3_70b.toml there (seq 8192)", "70b", "a100-pcie4", 64,
        "ib200", 1, 8192, "full-ac", 331, None),
    # the Llama 2 table of the same file (seq 4096: train_configs/llama2_*.toml there)
    Run("Llama 2 13B, 64x A100, FSDP 64, no AC", f"{TT} docs/performance.md at 1ea476e9f "
        "(2024-04-24), Llama 2 table, train_configs/llama2_13b.toml there (seq 4096)",
        "llama2-13b", "a100-pcie4", 64, "ib200", 2, 4096, "none", 2162, None),
    Run("Llama 2 13B, 64x A100, FSDP 64, selective op AC", f"{TT} docs/performance.md at "
        "1ea476e9f (2024-04-24), Llama 2 table", "llama2-13b", "a100-pcie4", 64, "ib200", 2,
        4096, "torchtitan-sac", 1904, None),
    Run("Llama 2 70B, 64x A100, FSDP 64, selective op AC", f"{TT} docs/performance.md at "
        "1ea476e9f (2024-04-24), Llama 2 table, train_configs/llama2_70b.toml there (seq "
        "4096)", "llama2-70b", "a100-pcie4", 64, "ib200", 1, 4096, "torchtitan-sac", 355, None),
    Run("Llama 2 70B, 64x A100, FSDP 64, full AC", f"{TT} docs/performance.md at 1ea476e9f "
        "(2024-04-24), Llama 2 table", "llama2-70b", "a100-pcie4", 64, "ib200", 2, 4096,
        "full-ac", 353, None),
]


def block_params(size: str) -> tuple[int, int]:
    """(parameters per block, parameters outside the blocks) of Llama 3 at `size`."""
    _, h, kv, mlp, vocab = SIZES[size]
    block = h * (2 * h + 2 * kv) + 3 * h * mlp + 2 * h
    return block, 2 * vocab * h + h


def hardware(run: Run, low: bool, fraction: float | None = None):
    """The run's preset, or with `low` the same at the lower peak its source allows; with
    `fraction` its `bf16_sustained_fraction` set to that (1: uncalibrated)."""
    hw = PRESETS[run.hardware]
    if fraction is not None:
        hw = dataclasses.replace(hw, bf16_sustained_fraction=fraction)
    if not low:
        return hw
    return dataclasses.replace(hw, name=f"{hw.name}-low-peak", peak_flops_per_s=run.low_peak)


@lru_cache(maxsize=None)
def _load(path: Path):
    return load_profile(path)


def profile(run: Run, layers: int, out: Path, hw):
    """The run's trace at `layers` layers (on its preset), priced on `hw`: a kept trace is
    priced again, so its op times follow this checkout's presets and op costs."""
    path = out / f"{run.size}_{run.hardware}_b{run.batch}_l{layers}.profile.json"
    if not path.exists():
        exe = Path(sys.executable).with_name("slackswap")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        subprocess.run([str(exe), "profile", "examples/llama3.py", "--device", "fake",
                        "--hardware", run.hardware, "--arg", f"size='{run.size}'",
                        "--arg", f"n_layer={layers}", "--arg", f"batch={run.batch}",
                        "--arg", f"seq={run.seq}", "-o", str(path), "-q"],
                       check=True, cwd=ROOT, env=env)
    return price_profile(_load(path), hw)


# the parts of a step the breakdown shows: op classes (op_cost.CLASSES) grouped
PARTS = {"gemm": "GEMMs", "attention": "attention", "loss": "loss", "embedding": "embedding"}
MEMORY_PART = "elementwise, norm, reduction"


def class_times(prof) -> dict:
    """Forward and backward op time (us) by part (`PARTS`, the rest `MEMORY_PART`)."""
    out = dict.fromkeys([*PARTS.values(), MEMORY_PART], 0.0)
    for op in prof.ops:
        out[PARTS.get(op_class(op.target), MEMORY_PART)] += op.time_us
    return {f"part:{k}": v for k, v in out.items()}


def figures(run: Run, prof, hw, ours: bool = True) -> dict:
    """The AC setting and (with `ours`) slackswap on one profile: times (us) and activation
    bytes."""
    ac = make_plan("recompute-only" if run.ac == "none" else run.ac, prof, hw, 1 << 50)
    gap_bytes = gap_us = 0   # no AC: every activation kept, no checkpoint
    if run.ac != "none":
        m = build_cost_model(prof, hw)
        acts = ac.actions()
        state = State(m, [acts[t] for t in m.cands])
        gap = checkpoint_gap(prof, state, sac_cached_ops(prof) if run.ac == "torchtitan-sac"
                             else set())
        gap_bytes, gap_us = gap.held_bytes, gap.time_us
    budget = ac.predicted.peak_bytes + gap_bytes
    base = {"ac_step_us": ac.predicted.step_us + gap_us, "fwd_us": prof.summary["forward_us"],
            "bwd_us": prof.summary["backward_us"]}
    if not ours:
        return base
    ours = make_plan("slackswap", prof, hw, budget)
    return {"ac_step_us": ac.predicted.step_us + gap_us,
            "ours_swapped_bytes": ours.predicted.swapped_bytes,
            "ours_recompute_us": ours.predicted.recompute_us,
            "ac_recompute_us": ac.predicted.recompute_us + gap_us,
            "ac_peak_bytes": budget, "gap_bytes": gap_bytes, "gap_us": gap_us,
            "ours_step_us": ours.predicted.step_us if ours.feasible else None,
            "ours_peak_bytes": ours.predicted.peak_bytes,
            "fwd_us": prof.summary["forward_us"], "bwd_us": prof.summary["backward_us"],
            **class_times(prof)}


def scaled(f2: dict, f3: dict, layers: int) -> dict:
    out = {}
    for k, v2 in f2.items():
        v3 = f3[k]
        out[k] = None if v2 is None or v3 is None else v2 + (layers - 2) * (v3 - v2)
    out["fwd_block_us"] = f3["fwd_us"] - f2["fwd_us"]
    out["bwd_block_us"] = f3["bwd_us"] - f2["bwd_us"]
    return out


def exposed_comm_us(run: Run, f: dict, step_us: float) -> tuple[float, float]:
    """(exposed communication, total communication) in us of one step (see the docstring)."""
    layers = SIZES[run.size][0]
    blk, root = block_params(run.size)
    rate = LINKS[run.link][0] * 1e9 * LINK_EFFICIENCY / 1e6          # bytes per us
    share = (run.gpus - 1) / run.gpus
    ag, rs = 2 * blk * share / rate, 4 * blk * share / rate
    ag_root, rs_root = 2 * root * share / rate, 4 * root * share / rate
    # backward's block time includes its share of the AC setting's replay
    bwd_block = f["bwd_block_us"] + (step_us - f["fwd_us"] - f["bwd_us"]) / layers
    exposed = (ag_root + rs_root + ag + rs
               + (layers - 1) * max(0.0, ag - f["fwd_block_us"])
               + (layers - 1) * max(0.0, ag + rs - bwd_block))
    total = ag_root + rs_root + (2 * layers - 1) * ag + layers * rs
    return exposed, total


def comm_us(run: Run, f: dict, step_us: float) -> dict:
    """One step's FSDP communication (us): `exposed` and `total` (`exposed_comm_us`), and
    `slowdown`, what the compute beside the hidden part loses (`OVERLAP_SLOWDOWN`: the hidden
    traffic's duration runs compute at 1 / (1 + s) of its speed, so it costs s / (1 + s) of
    that duration); `charged` = exposed + slowdown, what the step pays."""
    exposed, total = exposed_comm_us(run, f, step_us)
    slowdown = (total - exposed) * OVERLAP_SLOWDOWN / (1 + OVERLAP_SLOWDOWN)
    return {"exposed": exposed, "total": total, "slowdown": slowdown,
            "charged": exposed + slowdown}


def optimizer_us(run: Run) -> float:
    """AdamW (foreach) over the rank's fp32 shard, after clipping the gradients' norm: memory
    bound, `OPTIMIZER_BYTES` per parameter at the preset's achievable HBM bandwidth."""
    blk, root = block_params(run.size)
    shard = (SIZES[run.size][0] * blk + root) / run.gpus
    return shard * OPTIMIZER_BYTES / PRESETS[run.hardware].achievable_hbm_bytes_per_s * 1e6


def fsdp_copy_us(run: Run, hw=None) -> float:
    """FSDP2's copies on the compute stream in one step (`COPY_OUT_BYTES` per parameter per
    unshard: every block in forward and again in backward but the last, the root once;
    `COPY_IN_BYTES` per parameter per reduce-scatter: every block and the root once), each
    priced as one memory-bound copy kernel by the cost model (`op_time_us`, class
    elementwise)."""
    hw = hw or PRESETS[run.hardware]
    layers = SIZES[run.size][0]
    blk, root = block_params(run.size)
    model = default_cost_model()

    def copy(nbytes):
        return op_time_us(hw, model, "elementwise", "bfloat16", 0, nbytes)
    return ((2 * layers - 1) * copy(COPY_OUT_BYTES * blk) + copy(COPY_OUT_BYTES * root)
            + layers * copy(COPY_IN_BYTES * blk) + copy(COPY_IN_BYTES * root))


# FSDP2's collectives allocate in their own streams (pytorch/pytorch
# torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, under _composable/fsdp/ in the 2024
# FSDP2 the runs used: read at 01d66d21f): each all-gather's output under `all_gather_copy_in_stream`, each reduce-scatter's
# fp32 input and output (the sharded gradients are views of it) under `reduce_scatter_stream`.
# The caching allocator hands a freed block only to a later allocation on the stream it was
# allocated on (torch.Tensor.record_stream's documentation: "the caching allocator is aware of
# only the stream where a tensor was allocated"), so each stream's high-water mark stays
# reserved. Beyond what `static_bytes` counts: the copy-in stream's high-water holds the
# root's bf16 all-gather output beside the first block's (forward keeps each all-gather's
# output until the next block's copy-out: `FSDPParamGroup.wait_for_unshard`), the
# reduce-scatter stream's the root's fp32 reduce-scatter input beside every sharded gradient
# (the root reduces last, at the end of backward): 2 + 4 bytes per root parameter
ROOT_POOL_BYTES = 2 + 4


def static_bytes(run: Run) -> dict:
    """Per GPU: the sharded fp32 state, the unsharded bf16 parameters (two blocks and the
    root), and what the side streams' pools keep reserved beyond them (`ROOT_POOL_BYTES`)."""
    blk, root = block_params(run.size)
    total = SIZES[run.size][0] * blk + root
    return {"sharded": -(-16 * total // run.gpus), "unsharded": 2 * (2 * blk + root),
            "stream_pools": ROOT_POOL_BYTES * root}


def scaled_figures(run: Run, out: Path, low: bool = False, fraction: float | None = None,
                   ours: bool = True) -> dict:
    hw = hardware(run, low, fraction)
    return scaled(figures(run, profile(run, 2, out, hw), hw, ours),
                  figures(run, profile(run, 3, out, hw), hw, ours), SIZES[run.size][0])


def step_tokens_per_s(run: Run, f: dict) -> float:
    """Predicted tokens/s per GPU from the run's scaled figures: the AC setting's step, FSDP's
    charged communication, the optimizer and FSDP2's copies."""
    step = (f["ac_step_us"] + comm_us(run, f, f["ac_step_us"])["charged"] + optimizer_us(run)
            + fsdp_copy_us(run))
    return run.batch * run.seq / step * 1e6


def calibration(out: Path) -> dict:
    """The fit of `BF16_SUSTAINED_FRACTION` on these runs (benchmarks/bf16_fit.py): the
    fraction from all eight, and left out one run and one GPU kind at a time, each run's
    prediction taken with the presets' fraction set to f (uncalibrated: f = 1)."""
    runs = {r.name: r for r in RUNS}
    cache: dict = {}

    def predict(name: str, frac: float) -> float:
        if (name, frac) not in cache:
            run = runs[name]
            cache[name, frac] = step_tokens_per_s(
                run, scaled_figures(run, out, fraction=frac, ours=False))
        return cache[name, frac]
    measured = {r.name: r.tokens_per_s for r in RUNS}
    kind = {r.name: r.hardware.split("-")[0].upper() for r in RUNS}
    fraction = fit_fraction(measured, predict)
    return {"fitted_fraction": fraction, "committed_fraction": BF16_SUSTAINED_FRACTION,
            "uncalibrated": {n: predict(n, 1.0) for n in runs},
            "at_fit": {n: predict(n, fraction) / measured[n] - 1 for n in runs},
            "leave_one_out": {n: list(v) for n, v in leave_one_out(measured, predict).items()},
            "leave_kind_out": {k: [f, errs] for k, (f, errs) in
                               leave_kind_out(measured, kind, predict).items()},
            "kind": kind}


def predict(run: Run, out: Path) -> dict:
    f = scaled_figures(run, out)
    opt = optimizer_us(run)
    st = static_bytes(run)
    tokens = run.batch * run.seq
    copies = fsdp_copy_us(run)
    comm = comm_us(run, f, f["ac_step_us"])
    tps = step_tokens_per_s(run, f)
    mem = (st["sharded"] + st["unsharded"] + f["ac_peak_bytes"]) / GIB
    reserved = mem + st["stream_pools"] / GIB
    row = {"run": run.name, "source": run.source, "ac": run.ac, "gpus": run.gpus,
           "hardware": run.hardware, "link": LINKS[run.link][1],
           "measured_tokens_per_s": run.tokens_per_s, "measured_memory_gib": run.memory_gib,
           "predicted_tokens_per_s": tps, "predicted_memory_gib": mem,
           "tokens_error": tps / run.tokens_per_s - 1,
           "predicted_reserved_gib": reserved,
           "memory_error": None if run.memory_gib is None else reserved / run.memory_gib - 1,
           "stream_pools_gib": st["stream_pools"] / GIB,
           "sharded_gib": st["sharded"] / GIB, "unsharded_gib": st["unsharded"] / GIB,
           "activations_gib": f["ac_peak_bytes"] / GIB, "gap_gib": f["gap_bytes"] / GIB,
           "compute_ms": f["ac_step_us"] / 1e3, "comm_ms": comm["total"] / 1e3,
           "exposed_comm_ms": comm["exposed"] / 1e3, "optimizer_ms": opt / 1e3,
           "overlap_slowdown_ms": comm["slowdown"] / 1e3,
           "fsdp_copies_ms": copies / 1e3,
           "measured_step_ms": tokens / run.tokens_per_s * 1e3,
           "predicted_step_ms": tokens / tps * 1e3,
           "parts_ms": {**{k[5:]: v / 1e3 for k, v in f.items() if k.startswith("part:")},
                        "AC recompute": (f["ac_step_us"] - f["fwd_us"] - f["bwd_us"]) / 1e3},
           "compute_only_tokens_per_s": tokens / (f["ac_step_us"] + opt + copies) * 1e6,
           "ac_recompute_ms": f["ac_recompute_us"] / 1e3,
           "slackswap_recompute_ms": f["ours_recompute_us"] / 1e3,
           "slackswap_swapped_gib": f["ours_swapped_bytes"] / GIB}
    row.update(beside(run, f, out, opt + copies, tps))
    return row


def beside(run: Run, f: dict, out: Path, fixed_us: float, tps: float) -> dict:
    """The run at the lower peak its source allows, and slackswap's plan at the AC setting's
    memory (`fixed_us`: the optimizer and FSDP's copies, the same for both)."""
    tokens = run.batch * run.seq
    row = {"low_peak_tokens_per_s": None, "low_peak_source": None}
    if run.low_peak:
        low = scaled_figures(run, out, low=True)
        row["low_peak_tokens_per_s"] = tokens / (
            low["ac_step_us"] + fixed_us + comm_us(run, low, low["ac_step_us"])["charged"]) * 1e6
        row["low_peak_source"] = run.low_peak_source
    if f["ours_step_us"] is not None:
        charged = comm_us(run, f, f["ours_step_us"])["charged"]
        row["slackswap_tokens_per_s"] = tokens / (f["ours_step_us"] + charged + fixed_us) * 1e6
        row["slackswap_vs_ac"] = row["slackswap_tokens_per_s"] / tps
        row["slackswap_compute_vs_ac"] = f["ac_step_us"] / f["ours_step_us"]
    else:
        row["slackswap_tokens_per_s"] = row["slackswap_vs_ac"] = None
        row["slackswap_compute_vs_ac"] = None
    return row


def pct(x):
    return "-" if x is None else f"{100 * x:+.1f}%"


def rate(x):
    return "-" if x is None else f"{x:,.0f}"


def time_lines(rows: list[dict], cal: dict) -> list[str]:
    """The tokens/s table: uncalibrated, calibrated, and each run with the fraction fitted on
    the other runs and on the other GPU kind's runs."""
    fitted, committed = cal["fitted_fraction"], cal["committed_fraction"]
    same = ("the same" if fitted == committed else
            f"NOT the fitted {fitted:.3f}: commit the fitted value or explain the difference")
    lines = ["", "**Time, and what is fitted.** `bf16_sustained_fraction` scales the presets' "
             "bf16/fp16 tensor-core rates (GEMM, batched GEMM, attention, convolution; "
             "`slackswap_cli/hardware.py` [FIT]). It is the one figure fitted to these runs: "
             "least squares on log(measured / predicted tokens/s) over all eight, predictions "
             f"taken with it at 1 (benchmarks/bf16_fit.py). Fitted now: **{fitted:.3f}**; "
             f"committed in `BF16_SUSTAINED_FRACTION` (the presets as shipped): "
             f"{committed:.3f}, {same}. "
             "Uncalibrated: the fraction at 1 (only sourced figures). Calibrated: the presets "
             "as shipped. Leave one run out: the fraction fitted on the other seven runs and "
             "this run's error with it. Other GPU kind: the fraction fitted on the runs of the "
             "other GPU kind only (A100 runs for the H100 ones and back).", "",
             "| run | AC | tokens/s measured | uncalibrated | error | calibrated | error | "
             "leave one run out: fraction | error | other GPU kind: fraction | error |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['ac']} | {rate(r['measured_tokens_per_s'])} | "
                     f"{rate(r['uncalibrated_tokens_per_s'])} | {pct(r['uncalibrated_error'])} | "
                     f"{rate(r['predicted_tokens_per_s'])} | {pct(r['tokens_error'])} | "
                     f"{r['loo_fraction']:.3f} | {pct(r['loo_error'])} | {r['kind_out_fraction']:.3f} | "
                     f"{pct(r['kind_out_error'])} |")
    return lines


def write_md(rows: list[dict], cal: dict, path: Path) -> None:
    lines = ["# Published bf16 runs, predicted", "",
             "`python benchmarks/published_runs.py` (method: its docstring; sources below). "
             "Per GPU; memory: measured is torch's max reserved; predicted allocated is what "
             "the allocator hands out at the peak, predicted reserved adds what FSDP2's side "
             "streams keep cached (the docstring; no fragmentation, context, NCCL buffers). "
             "Every figure but the tokens/s table's uncalibrated column is priced on the "
             "presets as shipped, calibrated.", *time_lines(rows, cal), "",
             "**Memory** (not touched by the calibration):", "",
             "| run | AC | memory measured | predicted allocated | predicted reserved | error |",
             "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        mm = "-" if r["measured_memory_gib"] is None else f"{r['measured_memory_gib']:.1f} GiB"
        lines.append(f"| {r['run']} | {r['ac']} | {mm} | "
                     f"{r['predicted_memory_gib']:.1f} GiB | "
                     f"{r['predicted_reserved_gib']:.1f} GiB | {pct(r['memory_error'])} |")
    lines += ["", "Beside each reproduction: its step without FSDP communication, at the lower "
              "peak its source allows, and slackswap's plan at the same activation memory "
              "(the AC setting's, checkpoint gap included), FSDP communication the same:", "",
              "| run | compute only | at the lower peak | AC recompute ms | slackswap tokens/s "
              "| vs AC | compute only, vs AC | its recompute ms | its swaps GiB |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        vs = "-" if r["slackswap_vs_ac"] is None else f"{r['slackswap_vs_ac']:.3f}x"
        ours = ("does not fit" if r["slackswap_tokens_per_s"] is None
                else rate(r["slackswap_tokens_per_s"]))
        cvs = ("-" if r["slackswap_compute_vs_ac"] is None
               else f"{r['slackswap_compute_vs_ac']:.3f}x")
        lines.append(f"| {r['run']} | {rate(r['compute_only_tokens_per_s'])} | "
                     f"{rate(r['low_peak_tokens_per_s'])} | {r['ac_recompute_ms']:.0f} | {ours} "
                     f"| {vs} | {cvs} | {r['slackswap_recompute_ms']:.0f} | "
                     f"{r['slackswap_swapped_gib']:.1f} |")
    lines += ["", "Memory parts (GiB) and time parts (ms per step):", "",
              "| run | sharded state | unsharded params | activations | of which checkpoint gap "
              "| side streams' pools | forward + backward | optimizer | FSDP comm | exposed |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['run']} | {r['sharded_gib']:.2f} | {r['unsharded_gib']:.2f} | "
                     f"{r['activations_gib']:.2f} | {r['gap_gib']:.2f} | "
                     f"{r['stream_pools_gib']:.2f} | {r['compute_ms']:.0f} | "
                     f"{r['optimizer_ms']:.0f} | "
                     f"{r['comm_ms']:.0f} | {r['exposed_comm_ms']:.0f} |")
    lines += breakdown_lines(rows)
    lines += ["", "Sources:", ""]
    for r in rows:
        low = f"; lower peak: {r['low_peak_source']}" if r["low_peak_source"] else ""
        lines.append(f"- {r['run']}: {r['source']}; link: {r['link']}{low}")
    path.write_text("\n".join(lines) + "\n")


def breakdown_lines(rows: list[dict]) -> list[str]:
    """Where each predicted step goes (ms), against the measured step (batch x seq / tokens/s
    per GPU): op time by part over forward and backward, the AC setting's recompute (its
    replay and checkpoint gap), the optimizer, FSDP2's copies, exposed communication and
    what the compute beside the hidden communication loses."""
    parts = list(rows[0]["parts_ms"])
    lines = ["", "Where the predicted step goes (ms per step; missing = measured step - "
             "predicted step):", "",
             "| run | measured step | predicted step | missing | " + " | ".join(parts)
             + " | optimizer | FSDP copies | exposed comm | overlap slowdown |",
             "|---|" + "---:|" * (len(parts) + 7)]
    for r in rows:
        step = r["predicted_step_ms"]
        cells = [r["measured_step_ms"], step, r["measured_step_ms"] - step,
                 *r["parts_ms"].values(), r["optimizer_ms"], r["fsdp_copies_ms"],
                 r["exposed_comm_ms"], r["overlap_slowdown_ms"]]
        lines.append(f"| {r['run']} | " + " | ".join(f"{round(c):,}" for c in cells) + " |")
    return lines


def check_depth(layers: int, out: Path) -> None:
    """Print the 2- and 3-layer extrapolation against a direct trace at `layers` layers, for
    the first and the fourth run (the 8B on H100, the Llama 3 70B on A100)."""
    for run in (RUNS[0], RUNS[3]):
        hw = hardware(run, False)
        f2, f3, fx = (figures(run, profile(run, n, out, hw), hw) for n in (2, 3, layers))
        for key in ("ac_step_us", "ac_peak_bytes", "ours_step_us", "ours_peak_bytes"):
            guess = f2[key] + (layers - 2) * (f3[key] - f2[key])
            print(f"{run.name}: {key} at {layers} layers extrapolated {guess:.6g}, traced "
                  f"{fx[key]:.6g} ({guess / fx[key] - 1:+.3%})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", type=Path, default=None,
                    help="keep the traced profiles in this folder (and reuse them)")
    ap.add_argument("--check-depth", type=int, default=None, metavar="N",
                    help="only compare the extrapolation with a direct trace of N layers")
    args = ap.parse_args()
    out_dir = ROOT / "benchmarks" / "results"
    with tempfile.TemporaryDirectory() as tmp:
        keep = args.profiles or Path(tmp)
        keep.mkdir(parents=True, exist_ok=True)
        if args.check_depth:
            check_depth(args.check_depth, keep)
            return
        rows = [predict(run, keep) for run in RUNS]
        cal = calibration(keep)
    for r in rows:
        loo_f, loo_err = cal["leave_one_out"][r["run"]]
        kind_f, kind_errs = cal["leave_kind_out"][cal["kind"][r["run"]]]
        r.update(uncalibrated_tokens_per_s=cal["uncalibrated"][r["run"]],
                 uncalibrated_error=cal["uncalibrated"][r["run"]] / r["measured_tokens_per_s"] - 1,
                 loo_fraction=loo_f, loo_error=loo_err, kind_out_fraction=kind_f,
                 kind_out_error=kind_errs[r["run"]])
    (out_dir / "published_runs.json").write_text(
        json.dumps({"calibration": cal, "runs": rows}, indent=1) + "\n")
    write_md(rows, cal, out_dir / "published_runs.md")
    print((out_dir / "published_runs.md").read_text())


if __name__ == "__main__":
    main()
