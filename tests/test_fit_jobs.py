"""`slackswap fit --jobs 2`: batches traced in forked processes ahead of planning give the same
JSON as tracing them one by one here (`--jobs 1`), failures included."""
import time

import orjson
import pytest
from typer.testing import CliRunner
from workloads import ROOT

from slackswap_cli.cli import app
from slackswap_cli.errors import SlackswapError
from slackswap_cli.hardware import PRESETS
from slackswap_cli.trace.static_memory import Profiler, _Traced

UNPICKLABLE = '''
import torch
from torch import nn

class Opaque(Exception):
    def __init__(self):
        super().__init__("cannot go through a pipe")

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
    def forward(self, x):
        return self.fc(x).relu().pow(2).mean()

def workload(batch=2):
    if batch == 3:
        raise Opaque()
    if batch == 5:
        import time
        time.sleep(120)
    torch.manual_seed(0)
    return Net(), (torch.randn(batch, 8),)
'''


def _fit_json(args, out):
    r = CliRunner().invoke(app, ["fit", *args, "--json", "-o", str(out)])
    assert r.exit_code == 0, r.output + r.stderr
    data = orjson.loads(r.stdout)
    data.pop("plan")
    data.pop("profile")
    return data, r.stderr


def test_jobs_2_gives_the_rows_of_jobs_1(tmp_path):
    args = [str(ROOT / "examples" / "tiny_gpt.py"), "--batch", "1,2,4,8"]
    one, err1 = _fit_json([*args, "--jobs", "1"], tmp_path / "one.plan.json")
    two, err2 = _fit_json([*args, "--jobs", "2"], tmp_path / "two.plan.json")
    assert one == two
    assert [x["derived_from"] for x in two["rows"]] == [None, None, None, [2, 4]]
    decided = lambda err: [x for x in err.splitlines() if x.endswith(("profiling", "4"))]
    assert decided(err1) == decided(err2)


def test_a_failure_that_does_not_pickle_is_the_same_row(tmp_path):
    path = tmp_path / "opaque.py"
    path.write_text(UNPICKLABLE)
    rows = {}
    for jobs in ("1", "2"):
        data, _ = _fit_json([str(path), "--batch", "2,3,4", "--jobs", jobs],
                            tmp_path / f"o{jobs}.plan.json")
        rows[jobs] = data["rows"]
    assert rows["1"] == rows["2"]
    assert rows["2"][1]["reason"].endswith("raised Opaque: cannot go through a pipe")
    assert [x["feasible"] for x in rows["2"]] == [True, False, True]


class Opaque(Exception):
    def __init__(self):
        super().__init__("cannot go through a pipe")
        self.callback = lambda: None


def _raise_opaque(batch):
    raise Opaque()


def test_an_exception_that_does_not_pickle_comes_back_with_its_text():
    # the workload loader and the tracer wrap what they catch in (picklable) TraceErrors;
    # anything else raised in the child comes back as a SlackswapError "Type: message"
    child = _Traced(_raise_opaque, 3)
    with pytest.raises(SlackswapError) as info:
        child.result()
    assert info.value.message == "Opaque: cannot go through a pipe"
    assert child.proc.exitcode == 0


def test_close_stops_a_trace_still_running(tmp_path):
    path = tmp_path / "opaque.py"
    path.write_text(UNPICKLABLE)
    profiler = Profiler(str(path), entry="workload", args={}, batch_arg="batch", device="fake",
                        hardware=PRESETS["a100-pcie4"], workers=2)
    child = profiler.submit(5)                  # sleeps two minutes
    time.sleep(0.5)
    assert child.proc.is_alive()
    t0 = time.perf_counter()
    profiler.close()
    assert not child.proc.is_alive() and time.perf_counter() - t0 < 10
