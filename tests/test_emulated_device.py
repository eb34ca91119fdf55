"""The swap engine's CUDA code (`swap.StreamEngine`) on the emulated asynchronous device
(slackswap_testkit/emulated_device.py): first that the emulator corrupts what each missing
synchronization leaves unordered (so a pass below means something), then training bitwise
against eager under it. The in-place patch and the written-out step run here; the retained
graph, pipeline, tensor parallel, FSDP2 and zoo cases with SLACKSWAP_SLOW=1
(`make test-emulated`)."""
import gc
import os

import pytest
import torch
from test_zoo import ALL as ZOO_SUBSET

from slackswap_cli.run import swap
from slackswap_testkit import emulated_cases as cases
from slackswap_testkit.emulated_device import EmulatedDevice, emulated_device, is_poisoned

slow = pytest.mark.skipif(os.environ.get("SLACKSWAP_SLOW") != "1",
                          reason="minutes of CPU: SLACKSWAP_SLOW=1 (make test-emulated)")


def _round_trip(free_source: bool = True):
    x = torch.randn(6, 10)
    want = x.clone()
    h = swap.offload(x)
    if free_source:
        del x
        gc.collect()
    return h, want


def test_copies_run_late_and_targets_hold_the_sentinel_until_waited():
    with emulated_device() as dev:
        h, want = _round_trip()
        assert dev.d2h.ran == 0 and is_poisoned(h.host)      # queued, not run
        assert not h.d2h_done.query()
        swap.prefetch(h)
        assert is_poisoned(h.device_copy) and dev.h2d.ran == 0
        y = swap.wait(h)                                      # the compute stream waits
        assert torch.equal(y, want) and not dev.stats.poisoned
        assert h.host is None and dev.stats.copies == 2


def test_the_cuda_path_is_the_one_that_runs():
    with emulated_device():
        h, _ = _round_trip()
        assert isinstance(h.engine.engine, swap.StreamEngine)
        swap.wait(h)
    assert isinstance(swap.engine_for(torch.device("cpu")), swap.SyncEngine)   # put back


class _Without(swap.StreamEngine):
    """The engine with one synchronization left out (`skip`), to show the emulator sees it."""
    skip = ""

    def __init__(self, dev, pool):
        ops = dev
        if self.skip == "record_stream":
            ops = _Ops(dev, record_stream=lambda t, s: None)
        super().__init__(ops, pool)

    def wait_copy(self, handle):
        if self.skip != "compute_wait":
            super().wait_copy(handle)


class _Ops:
    def __init__(self, dev, **over):
        self._dev, self._over = dev, over

    def __getattr__(self, name):
        return self._over.get(name, getattr(self._dev, name))


@pytest.mark.parametrize("skip", ["record_stream", "compute_wait"])
def test_a_missing_synchronization_gives_the_sentinel(skip, monkeypatch):
    monkeypatch.setattr(_Without, "skip", skip)
    monkeypatch.setattr(swap, "StreamEngine", _Without)
    with emulated_device() as dev:
        h, want = _round_trip()
        y = swap.wait(h)
        assert torch.isnan(y).all()
    if skip == "record_stream":
        assert dev.stats.poisoned == {"device source freed before its copy ran": 1}


def test_a_copy_not_ordered_after_the_compute_stream_is_corrupted():
    dev = EmulatedDevice()
    x, host = torch.randn(4), dev.empty_host((4,), (1,), torch.float32)
    dev.begin_call()
    with dev.stream(dev.d2h):              # no wait_stream on the compute stream first
        dev.copy(host, x)
    dev.end_call()
    dev.synchronize()
    assert is_poisoned(host)
    assert list(dev.stats.poisoned) == ["copy not ordered after the compute stream's work "
                                        "on its source"]


def test_a_host_buffer_reused_while_a_copy_still_reads_it_is_overwritten():
    """Two copies of one host buffer on the two side streams with no event between them: a
    race, both give the sentinel; with the H2D stream waiting on the D2H copy's event, none."""
    for ordered in (False, True):
        dev = EmulatedDevice()
        x, host = torch.randn(4), dev.empty_host((4,), (1,), torch.float32)
        target = dev.empty_device((4,), (1,), torch.float32, "cpu")
        dev.begin_call()
        dev.d2h.wait_stream(dev.compute)
        with dev.stream(dev.d2h):
            dev.copy(host, x)
            done = dev.Event()
            done.record(dev.d2h)
        dev.h2d.wait_stream(dev.compute)
        if ordered:
            dev.h2d.wait_event(done)
        with dev.stream(dev.h2d):
            dev.copy(target, host)
        dev.end_call()
        dev.synchronize()
        assert torch.equal(target, x) == ordered
        assert bool(dev.stats.poisoned) != ordered


@pytest.mark.parametrize("kind", ["patch", "written"])
def test_trains_bitwise_under_the_emulated_device(kind):
    """3 AdamW steps of the tiny GPT, a plan that swaps and recomputes: in-place patch and
    the written-out step module, every copy late, equal to eager bit for bit."""
    got = cases.run_case(kind)
    assert got["swaps"] > 0 and got["recomputes"] > 0
    assert got["error"] is None and got["bitwise"], got
    assert got["stats"]["deferred"] > 0 and not got["stats"]["poisoned"]


@slow
@pytest.mark.parametrize("lag", [None, 1])
def test_a_second_backward_through_a_retained_graph_is_bitwise(lag):
    got = cases.run_case("twice", args={**cases.SMALL, "dropout": 0.0}, lag=lag)
    assert got["error"] is None and got["bitwise"], got
    assert not got["stats"]["poisoned"]


@slow
def test_two_models_on_two_compute_streams_are_bitwise():
    """The pool's event check is what orders a host buffer's reuse between two compute
    streams that nothing else orders (emulated_cases.run_two_streams)."""
    got = cases.run_case("two-streams")
    assert got["error"] is None and got["bitwise"], got
    assert not got["stats"]["poisoned"]


def _ranks_emulated(monkeypatch, run):
    """`run()` with every rank's patched training under the emulated device; the ranks'
    results, each checked to have copied through it with nothing corrupted."""
    from slackswap_testkit.emulated_device import ENV
    monkeypatch.setenv(ENV, "1")
    ranks = run()
    for rank, res in enumerate(ranks):
        seen = res["patched"]["emulated"]
        assert seen is not None and not seen["poisoned"], (rank, seen)
    assert sum(r["patched"]["emulated"]["copies"] for r in ranks) > 0
    return ranks


@slow
def test_pipeline_with_a_split_backward_is_bitwise(monkeypatch, tmp_path):
    """plan_pipeline on 2 gloo ranks, ZBVZeroBubble (each weight pass a second backward
    through the saved tensors), as tests/test_pipeline_ranks.py's default-suite run (the
    budget holds the ranks' 32 KiB of receive buffers)."""
    from slackswap_testkit import pipeline_run
    ranks = _ranks_emulated(monkeypatch, lambda: pipeline_run.run(
        "ZBVZeroBubble", 2, 2, 2, 253_000, tmp_path, "slackswap", "gpt", 5e7, quick=True))
    for rank, res in enumerate(ranks):
        assert pipeline_run.same(res["plain"], res["patched"]), rank
    assert sum(r["row"]["swapped_bytes"] for r in ranks) > 0


@slow
@pytest.mark.parametrize("layout,world,blocks", [("block-sp", 2, 1), ("block-fsdp", 4, 2)],
                         ids=["tensor-parallel", "tp-with-fsdp2"])
def test_tensor_parallel_and_fsdp2_are_bitwise(layout, world, blocks, monkeypatch, tmp_path):
    """Tensor parallel (sequence parallel block) on 2 ranks; TP inside pairs with FSDP2
    (`fully_shard`) across them on 4: each rank's losses and local parameters as plain."""
    from slackswap_testkit import tp_run
    ranks = _ranks_emulated(monkeypatch, lambda: tp_run.run(layout, world, 0.5, tmp_path,
                                                            blocks=blocks))
    for rank, res in enumerate(ranks):
        assert tp_run.same(res["plain"], res["patched"]), rank
        assert res["patched"]["swaps"] > 0


ZOO = ZOO_SUBSET           # every model tests/test_zoo.py holds to its committed row


@slow
@pytest.mark.parametrize("library,name", ZOO, ids=[n for _, n in ZOO])
def test_zoo_models_are_bitwise(library, name):
    """Models of the zoo subset (tests/test_zoo.py) planned, patched and trained against
    eager as `make zoo` does, every swap on the emulated device."""
    pytest.importorskip("timm")
    pytest.importorskip("torchvision")
    from benchmarks import zoo
    with emulated_device() as dev:
        got = zoo.check(library, name)
    assert got["status"] in ("pass", "pass-real") and got["bitwise"], got
    assert not dev.stats.poisoned
    if got["keep_swap_recompute"].split("/")[1] != "0":
        assert dev.stats.copies > 0
