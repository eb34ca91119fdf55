import json

import pytest

from slackswap_cli.cli.chrome_trace import (
    MEMORY_COUNTER,
    TRACKS,
    to_chrome_trace,
    write_chrome_trace,
)
from slackswap_cli.errors import InputError
from slackswap_cli.hardware import PRESETS
from slackswap_cli.simulate import simulate
from slackswap_testkit.synthetic import chain_profile

HW = PRESETS["a100-pcie4"]


def plan_result(record=True):
    p = chain_profile(4, act_bytes=8 << 20, fwd_us=100.0)
    a = [t.id for t in p.saved_activations]
    dec = {a[0]: "swap", a[1]: "recompute", a[2]: "swap"}
    return p, simulate(p, dec, HW, budget_bytes=2 * (8 << 20), record=record)


def test_trace_is_json_with_three_tracks_and_marked_events(tmp_path):
    p, r = plan_result()
    path = tmp_path / "trace.json"
    write_chrome_trace(path, r, p, budget_bytes=2 * (8 << 20))
    trace = json.loads(path.read_text())
    evs = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in evs if e.get("name") == "thread_name"}
    assert set(names) == set(TRACKS.values()) == {1, 2, 3}
    assert "compute" in names[1] and "D2H" in names[2] and "H2D" in names[3]
    xs = [e for e in evs if e["ph"] == "X"]
    # every timeline event appears once, on its engine's track
    assert len(xs) == len(r.events)
    by_cat = {}
    for e in xs:
        by_cat.setdefault(e["cat"], []).append(e)
    assert {e["tid"] for e in by_cat["recompute"]} == {1}
    assert {e["tid"] for e in by_cat["offload"]} == {2}
    assert {e["tid"] for e in by_cat["prefetch"]} == {3}
    assert by_cat["recompute"][0]["cname"] != by_cat["forward"][0]["cname"]
    # ops carry their module path; the recompute of f1 names layer 1
    assert by_cat["recompute"][0]["args"]["module"] == "layers.1"
    assert all(e["dur"] >= 0 for e in xs)
    if "stall" in by_cat:
        assert {e["cname"] for e in by_cat["stall"]} == {"terrible"}


def test_memory_counter_matches_simulation():
    p, r = plan_result()
    trace = to_chrome_trace(r, p)
    counters = [(e["ts"], e["args"]["bytes"]) for e in trace["traceEvents"]
                if e["ph"] == "C" and e["name"] == MEMORY_COUNTER]
    assert tuple(counters) == r.memory
    assert max(b for _, b in counters) == r.predicted.peak_bytes
    assert trace["otherData"]["retention"] == r.predicted.retention


def test_needs_a_recorded_timeline():
    p, r = plan_result(record=False)
    with pytest.raises(InputError, match="record=True"):
        to_chrome_trace(r, p)
