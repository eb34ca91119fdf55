"""Checks several test files share: one definition each."""
import subprocess
import sys
import textwrap


def assert_clean_error(result, code, needle=""):
    """A CliRunner result that is a user-facing error: the exit code, `Error:` and `Hint:` on
    stderr, `needle` in the message (case-insensitive), no traceback, no stray exception."""
    text = result.stdout + result.stderr
    assert result.exit_code == code, text
    assert "Error:" in result.stderr and "Hint:" in result.stderr, text
    assert needle.lower() in result.stderr.lower(), text
    assert "Traceback" not in text, text
    assert result.exception is None or isinstance(result.exception, SystemExit), text


def run_torch_blocked(code: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter where `import torch` fails (as on a machine without
    torch); afterwards it asserts torch was never imported. Returns the finished process."""
    body = ("import sys\nsys.modules['torch'] = None  # any `import torch` now raises\n"
            + textwrap.dedent(code)
            + "\nassert 'torch' not in {m.split('.')[0] for m in sys.modules"
              " if sys.modules[m] is not None}\n")
    return subprocess.run([sys.executable, "-c", body], capture_output=True, text=True,
                          timeout=timeout)


def hand_hw(**overrides):
    """The tests' hand-computable hardware: 1 TFLOP/s, 1 TB/s HBM, 10 GB/s copies each way
    (1 MB in 100 us), no copy latency, duplex at half speed, unlimited memory; `overrides`
    replace fields (e.g. `name="slow", h2d_bytes_per_s=1e8`)."""
    from slackswap_cli.hardware import HardwareSpec
    base = dict(name="test", peak_flops_per_s=1e12, matmul_efficiency=1.0,
                hbm_bytes_per_s=1e12, hbm_efficiency=1.0, memory_bytes=1 << 40,
                h2d_bytes_per_s=1e10, d2h_bytes_per_s=1e10, copy_latency_us=0.0,
                duplex=True, duplex_derate=0.5)
    return HardwareSpec(**{**base, **overrides})


def random_hw(rng):
    """Random copy bandwidths, latency and duplex behaviour (the property tests' hardware)."""
    bw = rng.choice([2e9, 5e9, 1e10, 3e10, 1e11])
    return hand_hw(name="random", h2d_bytes_per_s=bw * rng.uniform(0.7, 1.3),
                   d2h_bytes_per_s=bw * rng.uniform(0.7, 1.3),
                   copy_latency_us=rng.choice([0.0, 2.0, 10.0]),
                   duplex=rng.random() < 0.7, duplex_derate=rng.uniform(0.5, 1.0))


def random_decisions(prof, rng):
    """A random valid plan: keep / swap (sometimes pinned) / recompute where allowed."""
    from slackswap_cli.schema import Decision
    bwd = range(prof.n_forward, len(prof.ops))
    out = []
    for t in prof.saved_activations:
        acts = ["keep", "swap"] + (["recompute"] if t.recomputable else [])
        a = rng.choice(acts)
        pin = rng.choice(bwd) if a == "swap" and rng.random() < 0.3 else None
        out.append(Decision(t.id, a, pin))
    return out


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (for a gloo process group)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def two_us_kernels(monkeypatch):
    """Price ops with 2 us a kernel (slackswap_testkit/small_costs.py says why), for tests of
    the run side that need plans of KiB-sized models to recompute as well as swap."""
    from slackswap_cli import op_cost
    from slackswap_testkit.small_costs import two_us_kernel_model
    model = two_us_kernel_model()
    monkeypatch.setattr(op_cost, "default_cost_model", lambda: model)


def _mean_square(out, inputs):
    return out.pow(2).mean()


def recompute_only_plan(model, x, below: float):
    """`model` planned on `(x,)` by recompute-only at its first feasible budget, read from the
    InfeasibleError at fraction `below` (loss: the output's mean square; a fake trace)."""
    import pytest

    import slackswap_cli as slackswap
    from slackswap_cli.budget import first_feasible_budget
    from slackswap_cli.errors import InfeasibleError
    from slackswap_cli.hardware import load_hardware
    kw = dict(loss_fn=_mean_square, device="fake:cpu", planner="recompute-only")
    with pytest.raises(InfeasibleError) as e:
        slackswap.plan_model(model, (x,), budget=below, **kw)
    first = first_feasible_budget(e.value.plan.profile, load_hardware(None), "recompute-only")
    return slackswap.plan_model(model, (x,), budget=int(first), **kw)


def bitwise_calls(model, x, plan, calls: int = 3) -> list:
    """`model` patched with `plan`, then `calls` training steps on `x` (the output's mean
    square), each asserted bitwise against an unpatched twin's gradients: the patched
    forward's last_report after each."""
    import copy

    import torch

    import slackswap_cli as slackswap
    twin = copy.deepcopy(model)
    slackswap.patch(model, plan)
    reports = []
    for _ in range(calls):
        grads = []
        for m in (twin, model):
            m(x).pow(2).mean().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
            m.zero_grad(set_to_none=True)
        assert all(torch.equal(a, b) for a, b in zip(*grads))
        reports.append(model.forward.__slackswap__.last_report)
    return reports


def load_benchmark(name: str, on_path: bool = False):
    """The benchmark script `name` (a file in benchmarks/) as a module, registered under
    `name` (a dataclass in it looks its module up there); `on_path`: benchmarks/ put on
    sys.path first, for one that imports a sibling."""
    import importlib.util
    from pathlib import Path
    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    if on_path and str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, mod)
    spec.loader.exec_module(mod)
    return mod
