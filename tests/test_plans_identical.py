"""Plans do not depend on the CPU that computes them: the same profile gives the same plan,
byte for byte, whichever instruction set numpy dispatches to (docs/planning.md, "Plans
identical on every machine").

A fast subset of `benchmarks/plans_unchanged.py`: a few planner cases on the samples, each
digested as that script digests it, computed in subprocesses with numpy's CPU dispatch
unrestricted and restricted (`NPY_DISABLE_CPU_FEATURES`: every dispatched feature this CPU has
turned off, and, where it has several, only the widest). The digests must agree with each
other and with the committed baseline (`benchmarks/results/plans_unchanged.json`, made on
another machine). Before the planners broke ties by a stated rule, numpy's SIMD selection
(`argpartition`) picked a different candidate among equal prices with AVX2 than without, and
these cases differed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BASELINE = REPO / "benchmarks" / "results" / "plans_unchanged.json"
# cases that differed between dispatch settings before the tie rule (plans_unchanged's keys)
CASES = ["resnet50/recompute-only/0.1", "resnet50/recompute-only/0.5",
         "bert-large/recompute-only/0.6"]
# slackswap's own passes too, polish off to stay fast (compared across settings only: the
# baseline holds the polished plan)
EXTRA = ["resnet50/slackswap/0.5"]

WORKER = """
import json, sys
sys.path.insert(0, "benchmarks")
import plans_unchanged as pu
from slackswap_cli.planners import plan_and_simulate
from slackswap_cli.schema import load_profile
out, profiles = {}, {}
for case in sys.argv[1:]:
    stem, name, frac = case.split("/")
    prof = profiles.setdefault(stem, load_profile(f"sample_profiles/{stem}.json"))
    frac = float(frac)
    budget = int(prof.summary["peak_activation_bytes"] * frac)
    options = {"polish_work_ops": 0} if case in %r else {}
    plan, res = plan_and_simulate(name, prof, pu.HW, budget, frac, record=True, **options)
    out[case] = pu.case_digest(plan, res)
print(json.dumps(out))
""" % (EXTRA,)


def dispatch_settings() -> dict[str, str | None]:
    """Name -> NPY_DISABLE_CPU_FEATURES: unrestricted, every dispatched feature this CPU has
    off, and only the widest one off (where there are several)."""
    found = list(np.show_config(mode="dicts")["SIMD Extensions"].get("found") or [])
    settings: dict[str, str | None] = {"unrestricted": None}
    if found:
        settings["baseline only"] = " ".join(found)
    if len(found) > 1:
        settings[f"without {found[-1]}"] = found[-1]
    return settings


def start(disabled: str | None) -> subprocess.Popen:
    """The worker on CASES and EXTRA with `disabled` as NPY_DISABLE_CPU_FEATURES (None: unset)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("NPY_DISABLE_CPU_FEATURES", None)
    if disabled:
        env["NPY_DISABLE_CPU_FEATURES"] = disabled
    return subprocess.Popen([sys.executable, "-c", WORKER, *CASES, *EXTRA], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def digests(proc: subprocess.Popen) -> dict[str, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_plans_do_not_depend_on_the_cpu_dispatch():
    settings = dispatch_settings()
    procs = {name: start(disabled) for name, disabled in settings.items()}   # side by side
    runs = {name: digests(proc) for name, proc in procs.items()}
    first = runs["unrestricted"]
    differ = {name: sorted(k for k in first if d[k] != first[k]) for name, d in runs.items()}
    assert not any(differ.values()), f"digests differ from the unrestricted run: {differ}"
    baseline = json.loads(BASELINE.read_text())["cases"]
    changed = sorted(k for k in CASES if baseline[k] != first[k])
    assert not changed, (
        f"{changed}: plans differ from benchmarks/results/plans_unchanged.json; if the planners "
        "changed on purpose, run `python benchmarks/plans_unchanged.py` and commit its output")
    if len(settings) == 1:      # no dispatched feature to turn off: say so rather than pass
        pytest.skip("numpy dispatches to no optional CPU feature here: compared with the "
                    "baseline only")
