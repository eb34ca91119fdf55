"""Fixtures shared by the test files (plain helpers live in helpers.py and workloads.py), and
the slow tier: a test marked `slow_tier` runs only with SLACKSWAP_SLOW=1 (`make test-slow`
runs the tier, `make test-all` everything); each such test names, in its docstring or beside
its marker, the default test that still covers what it checks."""
import os

import pytest

SLOW = os.environ.get("SLACKSWAP_SLOW") == "1"

# `make test` runs the tests in two pytest-xdist workers, one a core: each worker's torch (and
# the processes it starts) then computes on one thread, as two threads a worker would spin
# against the other worker for the same two cores. Set before any test module imports torch.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if SLOW:
        return
    skip = pytest.mark.skip(reason="slow tier: SLACKSWAP_SLOW=1 (make test-slow)")
    for item in items:
        if item.get_closest_marker("slow_tier") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def files(tmp_path_factory):
    """Workload files by name: the shipped tiny GPT and the sources in workloads.SOURCES."""
    from workloads import ROOT, SOURCES
    d = tmp_path_factory.mktemp("workloads")
    out = {"tiny_gpt": ROOT / "examples" / "tiny_gpt.py"}
    for name, src in SOURCES.items():
        (d / f"{name}.py").write_text(src)
        out[name] = d / f"{name}.py"
    return out
