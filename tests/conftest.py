"""Fixtures shared by the test files (plain helpers live in helpers.py and workloads.py)."""
import pytest


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
