"""The Python version the project states (pyproject's requires-python) is the one the code needs.

vermin reads every module of the package and of the testkit and names the least Python each
construct needs (syntax and standard-library members alike); it must not be newer than the
stated minimum. The test suite itself runs under the interpreter it runs under, which must meet
the minimum too, so every module is also imported under a Python the project supports.
"""
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def stated_minimum() -> tuple[int, int]:
    spec = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    m = re.fullmatch(r">=\s*3\.(\d+)", spec.strip())
    assert m, f"requires-python {spec!r} is not of the form '>=3.N'"
    return 3, int(m.group(1))


def test_this_interpreter_meets_the_stated_minimum():
    assert sys.version_info[:2] >= stated_minimum()


def test_no_construct_needs_a_newer_python_than_stated():
    vermin = shutil.which("vermin") or shutil.which("vermin", path=str(Path(sys.executable).parent))
    if vermin is None:
        pytest.skip("vermin is not installed (pip install -e '.[dev]' installs it)")
    major, minor = stated_minimum()
    out = subprocess.run(
        [vermin, "--no-tips", "--violations", f"-t={major}.{minor}-",
         "slackswap_cli", "slackswap_testkit"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"code needs a Python newer than {major}.{minor}:\n{out.stdout}{out.stderr}"
    assert "Analyzing" in out.stdout  # it did look at the files
