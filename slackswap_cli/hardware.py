"""Hardware the simulator and the roofline cost model run on.

A `HardwareSpec` holds the handful of numbers that decide how long an op takes and how long a
copy between device and host takes:

- compute: peak dense bf16 matmul FLOP/s times an achievable fraction (large GEMMs reach about
  70-80% of the datasheet peak), and HBM bandwidth times an achievable fraction (streaming
  kernels reach about 80-90%),
- a fixed per-kernel overhead (launch and tail effects) added to every op that touches memory,
- the host link: pinned-memory H2D and D2H bandwidth, a fixed per-copy latency, and whether the
  two directions run at once (separate copy engines over a full-duplex link) and, if so, the
  fraction of its bandwidth each direction keeps while the other one is busy.

Roofline: time = max(flops / achievable FLOP/s, bytes / achievable HBM bytes/s) + overhead.
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
    kernel_overhead_us: float = 2.0  # per-kernel launch/tail cost added by the roofline
    description: str = ""

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
        if not isinstance(spec.description, str):
            raise FormatError(f"{source}: description must be a string, got "
                              f"{spec.description!r:.60}", hint="describe the machine in words")
        for name, (lo, hi, hint) in _BOUNDS.items():
            value = getattr(spec, name)
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                  and math.isfinite(value) and lo <= value <= hi)
            if name == "memory_bytes":
                ok = ok and (isinstance(value, int) or float(value).is_integer())
            if not ok:
                raise FormatError(f"{source}: {name} is {value!r:.40}, expected a number in "
                                  f"[{lo:g}, {hi:g}]", hint=hint)
        if not isinstance(spec.duplex, bool):
            raise FormatError(f"{source}: duplex must be true or false, got {spec.duplex!r}",
                              hint="true when the link copies both ways at once")
        return spec


# What a hardware file may hold: bounds far outside any real machine on both sides, but
# tight enough that every simulated time stays finite and the event loop moves on (a bandwidth
# of 5e-324 B/s or a latency of 1e308 us would make copies last forever).
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
}

# Sources:
# [A100]   NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 312 TFLOPS dense BF16, 2039 GB/s HBM2e.
# [H100]   NVIDIA H100 Tensor Core GPU datasheet (SXM5): 989 TFLOPS dense BF16, 3.35 TB/s HBM3.
# [H200]   NVIDIA H200 Tensor Core GPU datasheet (SXM): 989 TFLOPS dense BF16, 4.8 TB/s HBM3e, 141 GB.
# [GH200]  NVIDIA GH200 Grace Hopper Superchip datasheet: H100-class GPU (989 TFLOPS dense BF16),
#          96 GB HBM3 at 4.0 TB/s, NVLink-C2C 900 GB/s total (450 GB/s each way).
# [4090]   NVIDIA Ada Lovelace architecture whitepaper, RTX 4090: 165.2 TFLOPS dense BF16 with FP32
#          accumulate, 1008 GB/s GDDR6X, 24 GB.
# [PCIe4]  Pinned cudaMemcpy on PCIe 4.0 x16 (31.5 GB/s raw) measures about 25-26 GB/s each way
#          (NVIDIA bandwidthTest / nvbandwidth reports on A100 hosts); bidirectional runs reach about
#          42-45 GB/s together, so each direction keeps about 85% while the other one is busy.
# [PCIe5]  Pinned cudaMemcpy on PCIe 5.0 x16 (63 GB/s raw) measures about 53-57 GB/s each way
#          (nvbandwidth on H100 PCIe / H200 NVL hosts).
# [C2C]    Grace Hopper microbenchmarks (e.g. Fusco et al., "Understanding Data Movement in Tightly
#          Coupled Heterogeneous Systems: A Case Study with the Grace Hopper Superchip", 2024)
#          measure roughly 350 GB/s host->device and about 300 GB/s device->host over NVLink-C2C.
# [EFF]    Large bf16 GEMMs reach about 70-75% of dense peak on A100/H100 (cuBLAS); streaming
#          elementwise kernels reach about 80-90% of HBM bandwidth.
# [LAT]    A cudaMemcpyAsync of a small pinned buffer costs on the order of 5-10 us end to end.
PRESETS: dict[str, HardwareSpec] = {
    "a100-pcie4": HardwareSpec(
        name="a100-pcie4",
        peak_flops_per_s=312e12,             # [A100]
        matmul_efficiency=0.72,              # [EFF]
        hbm_bytes_per_s=2039 * GB,           # [A100]
        hbm_efficiency=0.85,                 # [EFF]
        memory_bytes=80 * GIB,               # [A100]
        h2d_bytes_per_s=25.7 * GB,           # [PCIe4]
        d2h_bytes_per_s=25.7 * GB,           # [PCIe4]
        copy_latency_us=8.0,                 # [LAT]
        duplex=True, duplex_derate=0.85,     # [PCIe4]
        description="A100 80GB SXM on a PCIe 4.0 x16 host link",
    ),
    "h100-pcie5": HardwareSpec(
        name="h100-pcie5",
        peak_flops_per_s=989e12,             # [H100]
        matmul_efficiency=0.70,              # [EFF]
        hbm_bytes_per_s=3350 * GB,           # [H100]
        hbm_efficiency=0.85,                 # [EFF]
        memory_bytes=80 * GIB,               # [H100]
        h2d_bytes_per_s=55.0 * GB,           # [PCIe5]
        d2h_bytes_per_s=55.0 * GB,           # [PCIe5]
        copy_latency_us=6.0,                 # [LAT]
        duplex=True, duplex_derate=0.85,     # [PCIe5], same link behaviour as PCIe 4.0
        description="H100 80GB SXM on a PCIe 5.0 x16 host link",
    ),
    "h200-pcie5": HardwareSpec(
        name="h200-pcie5",
        peak_flops_per_s=989e12,             # [H200]
        matmul_efficiency=0.70,              # [EFF]
        hbm_bytes_per_s=4800 * GB,           # [H200]
        hbm_efficiency=0.85,                 # [EFF]
        memory_bytes=141 * 10**9,            # [H200]
        h2d_bytes_per_s=55.0 * GB,           # [PCIe5]
        d2h_bytes_per_s=55.0 * GB,           # [PCIe5]
        copy_latency_us=6.0,                 # [LAT]
        duplex=True, duplex_derate=0.85,     # [PCIe5]
        description="H200 141GB on a PCIe 5.0 x16 host link",
    ),
    "gh200-c2c": HardwareSpec(
        name="gh200-c2c",
        peak_flops_per_s=989e12,             # [GH200]
        matmul_efficiency=0.70,              # [EFF]
        hbm_bytes_per_s=4000 * GB,           # [GH200]
        hbm_efficiency=0.85,                 # [EFF]
        memory_bytes=96 * 10**9,             # [GH200]
        h2d_bytes_per_s=350.0 * GB,          # [C2C]
        d2h_bytes_per_s=300.0 * GB,          # [C2C]
        copy_latency_us=4.0,                 # [LAT]
        duplex=True, duplex_derate=0.9,      # [GH200] 450 GB/s each way leaves headroom
        description="GH200 Grace Hopper, NVLink-C2C between Grace and Hopper",
    ),
    "rtx4090-pcie4": HardwareSpec(
        name="rtx4090-pcie4",
        peak_flops_per_s=165.2e12,           # [4090]
        matmul_efficiency=0.75,              # [EFF]
        hbm_bytes_per_s=1008 * GB,           # [4090]
        hbm_efficiency=0.85,                 # [EFF]
        memory_bytes=24 * GIB,               # [4090]
        h2d_bytes_per_s=25.0 * GB,           # [PCIe4]
        d2h_bytes_per_s=25.0 * GB,           # [PCIe4]
        copy_latency_us=8.0,                 # [LAT]
        duplex=True, duplex_derate=0.85,     # [PCIe4] GeForce parts have two copy engines too
        description="GeForce RTX 4090 on a PCIe 4.0 x16 host link",
    ),
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
