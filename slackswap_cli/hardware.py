"""Hardware the simulator and the roofline cost model run on.

A `HardwareSpec` holds the handful of numbers that decide how long an op takes and how long a
copy between device and host takes:

- compute: peak dense bf16 matmul FLOP/s times an achievable fraction (the best bf16 GEMM
  measured on that GPU, [EFF]), the fraction fused (flash) attention reaches ([ATTN]), the
  FP32 (FMA), TF32 and FP8 peaks and the SM count (what `op_cost` prices an op by, after the
  arithmetic it runs), and HBM bandwidth times an achievable fraction (streaming kernels
  reach about 80-90%),
- a fixed per-kernel overhead (launch and tail effects) added to every op that touches memory,
- the host link: pinned-memory H2D and D2H bandwidth, a fixed per-copy latency, and whether the
  two directions run at once (separate copy engines over a full-duplex link) and, if so, the
  fraction of its bandwidth each direction keeps while the other one is busy.

Plain roofline (sources that know no op classes): time = max(flops / achievable FLOP/s,
bytes / achievable HBM bytes/s) + overhead. Profiles are priced by `op_cost` (per op class and
dtype, with constants fitted on measured GPU steps).
Copy: time = latency + bytes / bandwidth (bandwidth times the derate while both directions
are busy).

Presets cite their sources next to each figure. Figures that are measurements (host link) are
typical published measurements of pinned `cudaMemcpyAsync`, not datasheet link rates. Users can
pass a JSON file with the same field names instead of a preset name.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import orjson

from .errors import FormatError, InputError, require_file
from .units import GIB

GB = 1e9  # link and HBM figures are quoted in decimal GB/s


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops_per_s: float          # dense bf16 tensor-core FLOP/s (datasheet)
    matmul_efficiency: float         # achievable fraction of peak for large GEMMs
    hbm_bytes_per_s: float           # datasheet HBM bandwidth
    hbm_efficiency: float            # achievable fraction for streaming kernels
    memory_bytes: int                # device memory
    h2d_bytes_per_s: float           # pinned host->device copy bandwidth (measured)
    d2h_bytes_per_s: float           # pinned device->host copy bandwidth (measured)
    copy_latency_us: float           # fixed cost of one copy (launch + DMA setup)
    duplex: bool                     # H2D and D2H run at the same time
    duplex_derate: float             # fraction of bandwidth each direction keeps when both run
    kernel_overhead_us: float = 2.0  # per-kernel launch/tail cost added by the plain roofline
    description: str = ""
    # the arithmetic an op runs (op_cost.py): 0 = not given (a hardware file written before
    # these existed; fp32 is then priced at peak_flops_per_s, fp8 at bf16's)
    fp32_flops_per_s: float = 0.0    # FP32 FMA units, no tensor cores (datasheet)
    tf32_flops_per_s: float = 0.0    # dense TF32 tensor-core FLOP/s (datasheet; 0 = none)
    fp8_flops_per_s: float = 0.0     # dense FP8 tensor-core FLOP/s (datasheet; 0 = none)
    sm_count: int = 0                # streaming multiprocessors (GEMM waves; 0 = not given)
    link_source: str = ""            # where the H2D / D2H / both-at-once figures come from
    # what bounds the fp32 FMA rate and the memory traffic of small tensors (op_cost.py;
    # 0 = not given: no bound of that kind)
    fp32_lanes_per_sm: int = 0       # FP32 cores per SM: 64, or 128 (two FP32 datapaths)
    board_power_w: float = 0.0       # board power limit (TDP), watts (datasheet)
    l2_bytes: int = 0                # L2 cache size
    l2_bytes_per_s: float = 0.0      # L2 read bandwidth (whitepaper bytes/clk x boost clock)
    # fraction of peak_flops_per_s a bf16/fp16 fused attention kernel (SDPA's flash) reaches,
    # causal FLOPs halved ([ATTN]); 0 = not given: matmul_efficiency
    attention_efficiency: float = 0.0
    # the same for its backward kernel where published apart ([ATTN]); 0 = not given:
    # attention_efficiency
    attention_backward_efficiency: float = 0.0
    # fraction of the bf16/fp16 tensor-core rates above (matmul_efficiency and the attention
    # fractions: best-shape, "up to" figures) a training step sustains ([FIT]: fitted to
    # published runs, not a datasheet figure); 1 = not given: the figures as they are
    bf16_sustained_fraction: float = 1.0

    # -- derived -----------------------------------------------------------------------------
    @property
    def achievable_flops_per_s(self) -> float:
        return self.peak_flops_per_s * self.matmul_efficiency

    @property
    def achievable_hbm_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.hbm_efficiency

    def roofline_us(self, flops: float, bytes_moved: float) -> float:
        """Time of one kernel: the slower of its compute and its memory traffic, plus overhead.

        An op that neither computes nor touches memory (a view, a reshape of metadata) is free.
        """
        if flops <= 0 and bytes_moved <= 0:
            return 0.0
        compute_us = flops / self.achievable_flops_per_s * 1e6
        memory_us = bytes_moved / self.achievable_hbm_bytes_per_s * 1e6
        return max(compute_us, memory_us) + self.kernel_overhead_us

    def copy_us(self, size_bytes: int, direction: str, contended: bool = False) -> float:
        """Time of one pinned copy of `size_bytes` in `direction` ('h2d' or 'd2h')."""
        bw = self.h2d_bytes_per_s if direction == "h2d" else self.d2h_bytes_per_s
        if contended and self.duplex:
            bw *= self.duplex_derate
        return self.copy_latency_us + size_bytes / bw * 1e6

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str = "hardware") -> "HardwareSpec":
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise FormatError(f"{source}: unknown hardware field(s) {', '.join(unknown)}",
                              hint=f"valid fields: {', '.join(fields)}")
        missing = [n for n, f in fields.items()
                   if n not in data and f.default is dataclasses.MISSING]
        if missing:
            raise FormatError(f"{source}: missing hardware field(s) {', '.join(missing)}",
                              hint="copy a preset with `slackswap hardware --json` and edit it")
        try:
            spec = cls(**data)
        except TypeError as exc:  # pragma: no cover - guarded above
            raise FormatError(f"{source}: {exc}") from None
        if not isinstance(spec.name, str) or not spec.name.strip() or len(spec.name) > 100:
            raise FormatError(f"{source}: name must be a non-empty string, got {spec.name!r:.60}",
                              hint='name the hardware, e.g. "name": "my-a100"')
        if not isinstance(spec.link_source, str):
            raise FormatError(f"{source}: link_source must be a string, got "
                              f"{spec.link_source!r:.60}", hint="say where the link figures "
                              "come from")
        if not isinstance(spec.description, str):
            raise FormatError(f"{source}: description must be a string, got "
                              f"{spec.description!r:.60}", hint="describe the machine in words")
        for name, (lo, hi, hint) in _BOUNDS.items():
            value = getattr(spec, name)
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value) and (lo <= value <= hi
                                                or (name in _ZERO_MEANS_NONE and value == 0)))
            if name in ("memory_bytes", "sm_count", "fp32_lanes_per_sm", "l2_bytes"):
                ok = ok and (isinstance(value, int) or float(value).is_integer())
            if not ok:
                zero = "0 or " if name in _ZERO_MEANS_NONE else ""
                raise FormatError(f"{source}: {name} is {value!r:.40}, expected {zero}a number "
                                  f"in [{lo:g}, {hi:g}]", hint=hint)
        if not isinstance(spec.duplex, bool):
            raise FormatError(f"{source}: duplex must be true or false, got {spec.duplex!r}",
                              hint="true when the link copies both ways at once")
        return spec


# What a hardware file may hold: bounds far outside any real machine on both sides, but
# tight enough that every simulated time stays finite and the event loop moves on (a bandwidth
# of 5e-324 B/s or a latency of 1e308 us would make copies last forever). A rate that may be
# 0 ("not given", `_ZERO_MEANS_NONE`) is otherwise held to the floor of the rate it stands in
# for: an FP32 peak of 1 FLOP/s would price a step at a billion years. Whether a profile's
# step on a given machine stays within what a plan records is checked where the two meet
# (`simulate.check_step_range`).
_RATE = "rates are in bytes or FLOPs per second, e.g. 25e9"
_EFF = "an efficiency is the achievable fraction of the peak, e.g. 0.85"
_BOUNDS: dict[str, tuple[float, float, str]] = {
    "peak_flops_per_s": (1e6, 1e20, _RATE),
    "hbm_bytes_per_s": (1e6, 1e16, _RATE),
    "h2d_bytes_per_s": (1e3, 1e16, _RATE),
    "d2h_bytes_per_s": (1e3, 1e16, _RATE),
    "matmul_efficiency": (1e-3, 1.0, _EFF),
    "hbm_efficiency": (1e-3, 1.0, _EFF),
    "duplex_derate": (1e-3, 1.0, _EFF),
    "memory_bytes": (0, 2**60, "device memory in bytes, e.g. 85899345920 for 80 GiB"),
    "copy_latency_us": (0, 1e6, "microseconds per copy, e.g. 8"),
    "kernel_overhead_us": (0, 1e6, "microseconds per kernel, e.g. 2"),
    "fp32_flops_per_s": (1e6, 1e20, _RATE + " (0: not given)"),
    "tf32_flops_per_s": (1e6, 1e20, _RATE + " (0: no TF32)"),
    "fp8_flops_per_s": (1e6, 1e20, _RATE + " (0: no FP8)"),
    "sm_count": (0, 1e6, "the GPU's SM count, e.g. 108 (0: not given)"),
    "fp32_lanes_per_sm": (0, 4096, "FP32 cores per SM, e.g. 64 (0: not given)"),
    "board_power_w": (0, 1e5, "the board's power limit in watts, e.g. 300 (0: not given)"),
    "l2_bytes": (0, 2**40, "the L2 cache in bytes, e.g. 41943040 for 40 MiB (0: not given)"),
    "l2_bytes_per_s": (0, 1e17, _RATE + " (0: not given)"),
    "attention_efficiency": (1e-3, 1.0, _EFF + " (0: matmul_efficiency)"),
    "attention_backward_efficiency": (1e-3, 1.0, _EFF + " (0: attention_efficiency)"),
    "bf16_sustained_fraction": (1e-3, 1.0, "the fraction of the bf16 tensor-core rates a "
                                "training step keeps, e.g. 0.9 (1: the rates as given)"),
}
_ZERO_MEANS_NONE = ("fp32_flops_per_s", "tf32_flops_per_s", "fp8_flops_per_s",
                    "attention_efficiency", "attention_backward_efficiency")

# Sources (datasheet figures are dense, i.e. without structured sparsity):
# [A100]   NVIDIA A100 Tensor Core GPU datasheet: 19.5 TFLOPS FP32, 156 TFLOPS TF32, 312 TFLOPS
#          BF16/FP16 (no FP8); HBM2e 2,039 GB/s (80GB SXM), 1,935 GB/s (80GB PCIe), HBM2 1,555
#          GB/s (40GB PCIe and SXM). 108 SMs: NVIDIA A100 architecture whitepaper.
# [H100]   NVIDIA H100 Tensor Core GPU datasheet (SXM5): 67 TFLOPS FP32, 494.7 TF32, 989 BF16,
#          1,979 FP8, 3.35 TB/s HBM3. 132 SMs: NVIDIA H100 architecture whitepaper (SXM5).
# [H100-96] The H100 of torchtitan's benchmarks (pytorch/torchtitan,
#          benchmarks/llama3_h100_202412_torchtitan.md): 96GB HBM2e at 2.4 TB/s, SXM, 132 SMs,
#          run at a 500 W limit; its peak "is between SXM and NVL" (their footnote; no source
#          states its clock). Each compute figure is interpolated in board power between the
#          H100 NVL datasheet's (400 W: 60 FP32, 417.5 TF32, 835 BF16, 1,671 FP8 dense, 132
#          SMs) and the SXM5's (700 W): at 500 W one third of the way, e.g. 886.3 TFLOPS BF16
#          (an assumption: clock linear in power between the two rated points).
# [H200]   NVIDIA H200 Tensor Core GPU datasheet (SXM): the H100's compute (67 FP32, 494.7 TF32,
#          989 BF16, 1,979 FP8, 132 SMs), 4.8 TB/s HBM3e, 141 GB.
# [GH200]  NVIDIA GH200 Grace Hopper Superchip datasheet: H100-class GPU (67 FP32, 494.7 TF32,
#          989 BF16, 1,979 FP8), 96 GB HBM3 at 4.0 TB/s, NVLink-C2C 900 GB/s total (450 each way).
# [4090]   NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: 82.6 TFLOPS FP32, 82.6 TF32,
#          165.2 BF16 and 330.3 FP8 with FP32 accumulate, 1008 GB/s GDDR6X, 24 GB, 128 SMs.
# [V100]   NVIDIA V100 Tensor Core GPU datasheet (PCIe): 14 TFLOPS FP32, 112 TFLOPS FP16 tensor
#          (no BF16, TF32 or FP8: a bf16 matmul is priced as fp16, which V100 does not run),
#          900 GB/s HBM2, 32 GB. 80 SMs: NVIDIA Volta architecture whitepaper.
# [T4]     NVIDIA T4 datasheet: 8.1 TFLOPS FP32, 65 TFLOPS FP16 mixed precision (no BF16/TF32),
#          320 GB/s GDDR6, 16 GB. 40 SMs: NVIDIA Turing architecture whitepaper.
# [L4]     NVIDIA L4 datasheet: 30.3 TFLOPS FP32, 60 TF32, 121 BF16/FP16, 242.5 FP8 (half the
#          datasheet's with-sparsity figures), 300 GB/s GDDR6, 24 GB. 58 SMs: NVIDIA Ada
#          Lovelace architecture whitepaper (AD104 as configured for L4).
# [CHIP]   FP32 cores per SM: 64 on Volta, Turing and A100 (their whitepapers), 128 on Ada and
#          Hopper (two FP32 datapaths per SM partition; Ada and H100 whitepapers). Board power
#          (TDP): A100 datasheet 400 W SXM, 300 W 80GB PCIe, 250 W 40GB PCIe; H100 SXM5 and H200
#          SXM datasheets 700 W; V100 PCIe datasheet 250 W; T4 datasheet 70 W; L4 datasheet 72 W;
#          RTX 4090: Ada whitepaper, 450 W total graphics power; GH200's datasheet gives the
#          module's (450-1000 W, CPU included), not the GPU's: not given. L2: A100 whitepaper 40 MB
#          and 5,120 bytes/clk read bandwidth (V100: 2,048 bytes/clk), V100 6 MB (Volta
#          whitepaper), T4 4 MB (Turing whitepaper), H100 SXM5 50 MB (H100 whitepaper), L4 48 MB
#          and RTX 4090 72 MB (Ada whitepaper). Ada, Hopper and Turing whitepapers give no L2
#          bytes/clk: theirs is A100's (Ada, Hopper) or V100's (Turing) per SM, an estimate.
# [PCIe3]  Pinned cudaMemcpy on PCIe 3.0 x16 (15.75 GB/s raw each way) measures about 12-13 GB/s
#          each way in published bandwidthTest runs; both at once about 80% each (typical, not
#          measured by slackswap).
# [PCIe4]  Pinned cudaMemcpy on PCIe 4.0 x16 (31.5 GB/s raw) measures about 25-26 GB/s each way
#          (NVIDIA bandwidthTest / nvbandwidth reports on A100 hosts); bidirectional runs reach about
#          42-45 GB/s together, so each direction keeps about 85% while the other one is busy.
#          Published training-time measurements are lower (PipeOffload's profiler: 15 GB/s D2H
#          on A100): benchmarks/gpu_check.py measures the machine at hand.
# [PCIe5]  Pinned cudaMemcpy on PCIe 5.0 x16 (63 GB/s raw) measures about 53-57 GB/s each way
#          (nvbandwidth on H100 PCIe / H200 NVL hosts). Both at once: datasheet only (the 85% of
#          PCIe 4.0 assumed). PipeOffload's profiler measured 21 GB/s D2H on H100.
# [C2C]    Grace Hopper microbenchmarks (e.g. Fusco et al., "Understanding Data Movement in Tightly
#          Coupled Heterogeneous Systems: A Case Study with the Grace Hopper Superchip", 2024)
#          measure roughly 350 GB/s host->device and about 300 GB/s device->host over NVLink-C2C.
# [EFF]    bf16 GEMM: the "Maximum Achievable Matmul FLOPS" table of stas00/ml-engineering
#          (compute/accelerator/README.md; mamf-finder.py, torch.matmul, mean of 100 runs at the
#          best shape found): A100 SXM 271.2 of 312 TFLOPS (86.9%), A100 PCIe 252.9 (81.1%),
#          H100 SXM 794.5 of 989 (80.3%, "H200 is the same"), GH200 828.6 (83.8%, its 900 W
#          141 GiB version). A best-shape figure: an upper bound for a model's GEMMs. GPUs the
#          table lacks (V100, T4, L4, RTX 4090) keep 0.72-0.75 (typical cuBLAS, no measurement
#          cited). Streaming elementwise kernels reach about 80-90% of HBM bandwidth. (Tensor-core
#          efficiency is a published figure, not fitted: the measured steps in
#          benchmarks/data/gpu_truth are fp32. The per-class memory efficiencies and fp32 GEMM
#          efficiencies are fitted: op_costs.json.)
# [ATTN]   Fused attention in bf16/fp16, FLOPs counted as the FlashAttention papers do (causal
#          halved, backward 2.5x forward), as slackswap's trace counts them: FlashAttention-2
#          (Dao 2023, arXiv 2307.08691, section 4.1) "reaches up to 230 TFLOPs/s, 73% of the
#          theoretical maximum" on A100 80GB SXM4, and "up to 335 TFLOPs/s" (forward+backward,
#          Fig. 7) on H100 80GB SXM5: 33.9% of 989 (FlashAttention-3, arXiv 2407.08608: "only
#          35% utilization on the H100"). torch's SDPA flash kernel is FlashAttention-2. Other
#          forms of the same chip (A100 PCIe, GH200) scale it by their [EFF] GEMM fraction over
#          the measured form's; GPUs without a published figure: 0 (matmul_efficiency).
#          The A100's 73% is the forward kernel's: the paper's introduction gives both halves,
#          "up to 73% of the theoretical max throughput in the forward pass, and up to 63% of
#          the theoretical max throughput in the backward pass" (its Fig. 5 and 6, A100 80GB
#          SXM4): the backward kernel is priced at 63% (`attention_backward_efficiency`,
#          scaled like the forward on the A100 PCIe). The H100's 335 TFLOPs/s is forward and
#          backward together: one figure for both.
# [FIT]    Fitted, not published: `BF16_SUSTAINED_FRACTION`, what fraction of the [EFF] and
#          [ATTN] figures (best shapes, "up to" figures) a real bf16 training step sustains on
#          its tensor cores. One parameter, fitted by least squares on log(measured / predicted
#          tokens/s) over the eight published torchtitan runs of benchmarks/published_runs.py
#          (six on A100, two on H100), their predictions taken with the fraction at 1
#          (benchmarks/bf16_fit.py; the fit, and each run's error with the fraction fitted
#          on the other seven, in benchmarks/results/published_runs.md). It stands for what
#          no source gives: the clock a training step holds, causal attention below the "up
#          to" figures, eager FSDP2's CPU. It scales bf16/fp16 GEMM, batched GEMM, attention
#          and convolution compute (op_cost.py), not memory-bound ops, copies or links, not
#          fp8, TF32 or fp32; on the presets whose tensor-core fractions are [EFF] / [ATTN]
#          figures (A100, H100, H200, GH200); the others' 0.72-0.75 are no best-case figure.
# [LAT]    A cudaMemcpyAsync of a small pinned buffer costs on the order of 5-10 us end to end.
_LINK = {
    "pcie3": "[PCIe3] published bandwidthTest figures for PCIe 3.0 x16 (12-13 GB/s each way); "
             "both at once: typical, not measured by slackswap",
    "pcie4": "[PCIe4] NVIDIA bandwidthTest / nvbandwidth reports on A100 hosts (25-26 GB/s each "
             "way, 42-45 GB/s both at once); training-time measurements are lower "
             "(PipeOffload: 15 GB/s D2H on A100)",
    "pcie5": "[PCIe5] nvbandwidth on H100 PCIe / H200 NVL hosts (53-57 GB/s each way); both at "
             "once: datasheet only (PCIe 4.0's 85% assumed); PipeOffload: 21 GB/s D2H on H100",
    "c2c": "[C2C] Fusco et al. 2024 Grace Hopper microbenchmarks (350 GB/s H2D, 300 GB/s D2H); "
           "both at once: datasheet only (450 GB/s each way)",
}


# bytes per clock per SM of the L2 (read): A100 5,120 B/clk over 108 SMs, V100 2,048 B/clk over
# 80 SMs ([CHIP]); GPUs whose whitepaper gives no figure take their generation's
_L2_AMPERE = 5120 / 108
_L2_VOLTA = 2048 / 80


def _chip(lanes: int, watts: float, l2_mib: int, l2_per_sm_clk: float, fp32: float) -> dict:
    """The figures that bound the fp32 rate and small tensors' traffic ([CHIP]); the L2's
    bandwidth is its bytes per SM per clock times the SMs and the boost clock, i.e.
    `fp32 / (2 * lanes)` times the per-SM figure (fp32 = 2 FLOPs x lanes x SMs x clock)."""
    return {"fp32_lanes_per_sm": lanes, "board_power_w": watts, "l2_bytes": l2_mib * 2**20,
            "l2_bytes_per_s": round(l2_per_sm_clk * fp32 / (2 * lanes), -9)}


def _spec(name, bf16, fp32, tf32, fp8, sms, hbm, mem, link, desc, eff=0.72,
          bw=None, chip=None, attn=(0.0, 0.0), sustained=1.0) -> HardwareSpec:
    """A preset: the compute and memory figures given, the host link of `link` (its typical
    bandwidth each way unless `bw` GB/s is given), the `_chip` figures, `attn` the fused
    attention fractions (forward, backward; 0: not given), `sustained` the [FIT] fraction."""
    typical, lat = {"pcie3": (12.5, 10.0), "pcie4": (25.7, 8.0), "pcie5": (55.0, 6.0)}[link]
    bw = typical if bw is None else bw
    return HardwareSpec(
        name=name, peak_flops_per_s=bf16, matmul_efficiency=eff, hbm_bytes_per_s=hbm * GB,
        hbm_efficiency=0.85, memory_bytes=mem, h2d_bytes_per_s=bw * GB,
        d2h_bytes_per_s=bw * GB, copy_latency_us=lat, duplex=True,
        duplex_derate=0.8 if link == "pcie3" else 0.85, description=desc,
        fp32_flops_per_s=fp32, tf32_flops_per_s=tf32, fp8_flops_per_s=fp8, sm_count=sms,
        link_source=_LINK[link], attention_efficiency=attn[0],
        attention_backward_efficiency=attn[1], bf16_sustained_fraction=sustained,
        **(chip or {}))


# [EFF] best measured bf16 GEMM fractions; [ATTN] FlashAttention-2's on the measured form, and
# scaled by the GEMM fraction on another form of the same chip
_EFF_A100_SXM, _EFF_A100_PCIE, _EFF_H100, _EFF_GH200 = 0.869, 0.811, 0.803, 0.838
_ATTN_A100 = (0.73, 0.63)              # forward 230 of 312 TFLOPS; backward 63%
_ATTN_H100 = (round(335 / 989, 4), 0.0)   # 0.3387, forward and backward together
# [FIT] fitted to the eight published runs of benchmarks/published_runs.py (not a published
# figure): benchmarks/published_runs.py with bf16_fit.py at commit 70139e5, printed in
# benchmarks/results/published_runs.md; tests/test_published_runs.py checks it against that run
BF16_SUSTAINED_FRACTION = 0.830
_FIT = BF16_SUSTAINED_FRACTION


def _scaled_attn(base: tuple, eff: float, measured_eff: float) -> tuple:
    return tuple(round(b * eff / measured_eff, 4) for b in base)


def _h100_at(watts: float, nvl: float, sxm: float) -> float:
    """[H100-96]: a compute figure at `watts`, linear in board power between H100 NVL's (400 W)
    and H100 SXM5's (700 W) datasheet figure."""
    return round(nvl + (sxm - nvl) * (watts - 400) / (700 - 400), -9)


_H100_500W = {k: _h100_at(500, nvl, sxm) for k, (nvl, sxm) in
              {"bf16": (835e12, 989e12), "fp32": (60e12, 67e12), "tf32": (417.5e12, 494.7e12),
               "fp8": (1671e12, 1979e12)}.items()}
_A100 = {w: _chip(64, w, 40, _L2_AMPERE, 19.5e12) for w in (250, 300, 400)}
_HOPPER = _chip(128, 700, 50, _L2_AMPERE, 67e12)
PRESETS: dict[str, HardwareSpec] = {
    # name              bf16     fp32     tf32      fp8      SMs  HBM GB/s  memory [source]
    "a100-pcie4": _spec("a100-pcie4", 312e12, 19.5e12, 156e12, 0, 108, 2039, 80 * GIB,  # [A100]
                        "pcie4", "A100 80GB SXM on a PCIe 4.0 x16 host link", chip=_A100[400],
                        eff=_EFF_A100_SXM, attn=_ATTN_A100, sustained=_FIT),
    "h100-pcie5": _spec("h100-pcie5", 989e12, 67e12, 494.7e12, 1979e12, 132, 3350,  # [H100]
                        80 * GIB, "pcie5", "H100 80GB SXM on a PCIe 5.0 x16 host link",
                        eff=_EFF_H100, chip=_HOPPER, attn=_ATTN_H100, sustained=_FIT),
    "h200-pcie5": _spec("h200-pcie5", 989e12, 67e12, 494.7e12, 1979e12, 132, 4800,  # [H200]
                        141 * 10**9, "pcie5", "H200 141GB on a PCIe 5.0 x16 host link",
                        eff=_EFF_H100, chip=_HOPPER, attn=_ATTN_H100, sustained=_FIT),
    "gh200-c2c": HardwareSpec(
        name="gh200-c2c",
        peak_flops_per_s=989e12,             # [GH200]
        matmul_efficiency=_EFF_GH200,        # [EFF]
        hbm_bytes_per_s=4000 * GB,           # [GH200]
        hbm_efficiency=0.85,                 # [EFF]
        memory_bytes=96 * 10**9,             # [GH200]
        h2d_bytes_per_s=350.0 * GB,          # [C2C]
        d2h_bytes_per_s=300.0 * GB,          # [C2C]
        copy_latency_us=4.0,                 # [LAT]
        duplex=True, duplex_derate=0.9,      # [GH200] 450 GB/s each way leaves headroom
        description="GH200 Grace Hopper, NVLink-C2C between Grace and Hopper",
        fp32_flops_per_s=67e12, tf32_flops_per_s=494.7e12, fp8_flops_per_s=1979e12,  # [GH200]
        sm_count=132, link_source=_LINK["c2c"],
        attention_efficiency=_scaled_attn(_ATTN_H100, _EFF_GH200, _EFF_H100)[0],  # [ATTN]
        bf16_sustained_fraction=_FIT,        # [FIT]
        **_chip(128, 0, 50, _L2_AMPERE, 67e12),   # [CHIP] no GPU-only power limit given
    ),
    "rtx4090-pcie4": _spec("rtx4090-pcie4", 165.2e12, 82.6e12, 82.6e12, 330.3e12, 128,  # [4090]
                           1008, 24 * GIB, "pcie4", "GeForce RTX 4090 on a PCIe 4.0 x16 host "
                           "link", eff=0.75, bw=25.0,
                           chip=_chip(128, 450, 72, _L2_AMPERE, 82.6e12)),
    # the GPUs of benchmarks/data/gpu_truth (measured steps), on the host link of their form
    "a100-80gb-pcie": _spec("a100-80gb-pcie", 312e12, 19.5e12, 156e12, 0, 108, 1935,  # [A100]
                            80 * GIB, "pcie4", "A100 80GB PCIe (PCIe 4.0 x16)", chip=_A100[300],
                            eff=_EFF_A100_PCIE,
                            attn=_scaled_attn(_ATTN_A100, _EFF_A100_PCIE, _EFF_A100_SXM),
                            sustained=_FIT),
    "a100-40gb-pcie": _spec("a100-40gb-pcie", 312e12, 19.5e12, 156e12, 0, 108, 1555,  # [A100]
                            40 * GIB, "pcie4", "A100 40GB PCIe (PCIe 4.0 x16)", chip=_A100[250],
                            eff=_EFF_A100_PCIE,
                            attn=_scaled_attn(_ATTN_A100, _EFF_A100_PCIE, _EFF_A100_SXM),
                            sustained=_FIT),
    "a100-40gb-sxm": _spec("a100-40gb-sxm", 312e12, 19.5e12, 156e12, 0, 108, 1555,  # [A100]
                           40 * GIB, "pcie4", "A100 40GB SXM4 on a PCIe 4.0 x16 host link",
                           chip=_A100[400], eff=_EFF_A100_SXM, attn=_ATTN_A100, sustained=_FIT),
    "h100-sxm": _spec("h100-sxm", 989e12, 67e12, 494.7e12, 1979e12, 132, 3350,  # [H100]
                      80 * GIB, "pcie5", "H100 80GB SXM5 on a PCIe 5.0 x16 host link",
                      eff=_EFF_H100, chip=_HOPPER, attn=_ATTN_H100, sustained=_FIT),
    "h100-sxm-96gb": _spec("h100-sxm-96gb", _H100_500W["bf16"], _H100_500W["fp32"],  # [H100-96]
                           _H100_500W["tf32"], _H100_500W["fp8"], 132, 2400, 96 * 10**9,
                           "pcie5", "H100 SXM 96GB HBM2e (2.4 TB/s, 500 W), the GPU of "
                           "torchtitan's 2024-12 benchmarks", eff=_EFF_H100, attn=_ATTN_H100,
                           sustained=_FIT, chip=_chip(128, 500, 50, _L2_AMPERE, _H100_500W["fp32"])),
    "v100-pcie": _spec("v100-pcie", 112e12, 14e12, 0, 0, 80, 900, 32 * GIB,  # [V100]
                       "pcie3", "V100 32GB PCIe (PCIe 3.0 x16); fp16 tensor cores, no bf16",
                       chip=_chip(64, 250, 6, _L2_VOLTA, 14e12)),
    "t4": _spec("t4", 65e12, 8.1e12, 0, 0, 40, 320, 16 * GIB,  # [T4]
                "pcie3", "T4 16GB (PCIe 3.0 x16); fp16 tensor cores, no bf16",
                chip=_chip(64, 70, 4, _L2_VOLTA, 8.1e12)),
    "l4": _spec("l4", 121e12, 30.3e12, 60e12, 242.5e12, 58, 300, 24 * GIB,  # [L4]
                "pcie4", "L4 24GB (PCIe 4.0 x16)", chip=_chip(128, 72, 48, _L2_AMPERE, 30.3e12)),
}

DEFAULT_PRESET = "a100-pcie4"


def load_hardware(name_or_path: str | None) -> HardwareSpec:
    """A preset by name, or a JSON file with HardwareSpec's fields."""
    if name_or_path is None:
        return PRESETS[DEFAULT_PRESET]
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        example = "`slackswap hardware a100-pcie4 --json` prints one to start from"
        require_file(path, "hardware file",
                     hint=f"use a preset ({', '.join(PRESETS)}) or a JSON file")
        try:
            data = orjson.loads(path.read_bytes())
        except orjson.JSONDecodeError as exc:
            raise FormatError(f"hardware file {path} is not valid JSON: {exc}",
                              hint=example) from None
        except OSError as exc:
            raise InputError(f"cannot read hardware file {path}: {exc.strerror or exc}",
                             hint="check the file's permissions") from None
        if not isinstance(data, dict):
            raise FormatError(f"hardware file {path} must hold one JSON object", hint=example)
        data.setdefault("name", path.stem)
        spec = HardwareSpec.from_dict(data, source=str(path))
        # a preset's name stands for the preset's figures: plans and reports show the name,
        # so an edited copy that keeps it would pass off its figures as the preset's
        preset = PRESETS.get(spec.name)
        if preset is not None and spec.to_dict() != preset.to_dict():
            differ = [k for k, v in spec.to_dict().items() if preset.to_dict().get(k) != v]
            raise InputError(
                f"hardware file {path} is named '{spec.name}', a preset's name, but its "
                f"figures differ from the preset's ({', '.join(differ[:4])})",
                hint=f"give it a name of its own (\"name\": \"{spec.name}-custom\"), or pass "
                     f"--hardware {spec.name} for the preset")
        return spec
    raise InputError(f"unknown hardware preset '{name_or_path}'",
                     hint=f"presets: {', '.join(PRESETS)}; or pass a JSON file with the same fields")


def stored_hardware(value, source: str) -> HardwareSpec | None:
    """The hardware a profile was costed on, from its `env.hardware`: the whole spec (what
    `slackswap profile` writes), a preset name (profiles written before specs were stored),
    or None (measured times: no hardware model)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return HardwareSpec.from_dict(value, source=f"{source}: env.hardware")
    if isinstance(value, str) and value in PRESETS:
        return PRESETS[value]
    raise FormatError(f"{source}: env.hardware names {value!r:.60}, which is not a preset "
                      "(this profile stores the hardware's name only)",
                      hint="pass the hardware it was profiled with: --hardware FILE.json, or "
                           "profile the model again, which stores the whole spec")
