"""The compiled path's synchronization (slackswap_testkit/offload_order.py): torch's CUDA offload
insertion applied to the graphs `compile_planned` partitions, on the CPU, and checked for what
its ops need: each offload's wait keeps its device value alive and nothing reads the value
after the wait frees it; each reload read only through its wait. A KV cache's tensor that is
both a model output and offloaded would reach the caller freed: `offload.keep_outputs`."""
import os

import pytest
import torch
from workloads import plan_at, profiled, write_patched

from slackswap_cli.run.compiled import offload
from slackswap_cli.run.emit import load_patched
from slackswap_cli.trace.joint import loss_from_output, split_inputs
from slackswap_cli.trace.workload import load_workload
from slackswap_testkit.offload_order import captured

SLOW = pytest.mark.skipif(os.environ.get("SLACKSWAP_SLOW") != "1",
                          reason="a second compile of Llama: SLACKSWAP_SLOW=1")


def _graphs(files, tmp_path, name="llama_cache"):
    prof = profiled(files, name, device="fake:cpu")
    path = write_patched(tmp_path, plan_at(prof, 0.5 * prof.summary["peak_activation_bytes"]),
                         prof, name=f"{name}_sync.py")
    work = load_workload(str(files[name]))
    torch._dynamo.reset()
    with captured() as got:
        model = load_patched(str(path)).compile_planned(work.model, backend="aot_eager",
                                                        quiet=True)
        a, kw = split_inputs(work.inputs)
        loss_from_output(model(*a, **kw), work.inputs, work.loss_fn).backward()
    torch._dynamo.reset()
    return got


def test_torchs_offload_waits_keep_what_they_free_unread(files, tmp_path):
    """Llama with its KV cache: every offload paired with a wait sunk to the end of forward
    (the offloaded device values are held until forward returns), every reload read through
    its wait, and the cache's offloaded tensors not freed under the caller."""
    got = _graphs(files, tmp_path)
    assert len(got) == 1 and got[0]["offloads"] == got[0]["reloads"] > 0, got
    assert got[0]["problems"] == [], got
    assert got[0]["sunk_waits"] == got[0]["offloads"]


@SLOW
def test_without_keep_outputs_the_kv_cache_would_be_freed(files, tmp_path, monkeypatch):
    monkeypatch.setattr(offload, "keep_outputs", lambda fw, outs: None)
    got = _graphs(files, tmp_path)
    assert got[0]["problems"] and all("read after its offload's wait freed it (by output)" in p
                                      for p in got[0]["problems"]), got
