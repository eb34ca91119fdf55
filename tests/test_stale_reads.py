"""A root a chain reads, written in place after it was saved: on the first call the chain
reads it through an alias the recorder made (`first_call._lined_up`'s pin), whose version
counter is its own, so no version check sees the write. What holds the run bitwise is that
a chain never reads a value a later write overwrote (the profile's stale reads are not
recomputable: trace/graph_profile.py), and a write the chain does want is in the alias's
data already; a write under a view autograd saved is refused when the step is traced."""

import pytest
import torch
from helpers import bitwise_calls, recompute_only_plan, two_us_kernels

import slackswap_cli as slackswap
from slackswap_cli.errors import TraceError


class _Block(torch.nn.Module):
    """`r` made by an op that saves nothing, read by tanh (which saves its output), then
    written in place; autograd saves only a view of `r` (its slice, through `sin`)."""

    def __init__(self, how):
        super().__init__()
        self.how = how
        self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x):
        r = self.a(x) + 1
        t = torch.tanh(r)
        if self.how == "raise":
            v = r[:, :8].sin()       # saves the slice; the write below is under it
            r.mul_(0.5)
            return self.b(t) + v.sum(1, keepdim=True)
        if self.how == "data":
            r.data.mul_(0.5)         # a write autograd's version counter does not see
        else:
            r.mul_(0.5)
        if self.how == "after":
            t = torch.tanh(r)        # reads the written value
        return self.b(t) + r[:, :8].sin().sum(1, keepdim=True)


def _loss(out, inputs):
    return out.pow(2).mean()


def _planned(how):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_Block(how) for _ in range(2)))
    x = torch.randn(32, 64)
    return model, x, recompute_only_plan(model, x, 0.3)


def _tanh_outputs(plan):
    """{name: (recomputable, action)} of the tanh outputs tanh's backward reads."""
    acts = {d.tensor: str(d.action) for d in plan.plan.decisions}
    return {t.name: (t.recomputable, acts.get(t.id)) for t in plan.profile.tensors
            if t.name.startswith("tanh") and "backward" not in t.name and t.saved}


@pytest.mark.parametrize("how", ["before", "data"])
def test_a_value_written_after_it_was_read_is_never_a_chains(monkeypatch, how):
    """tanh read `r` before the write (seen by autograd, or through `.data`): re-running
    tanh would read the written value, so its output is kept, never recomputed."""
    two_us_kernels(monkeypatch)
    model, x, plan = _planned(how)
    assert plan.actions()["recompute"] > 0
    tanh = _tanh_outputs(plan)
    assert tanh and not any(ok for ok, _ in tanh.values()), tanh
    bitwise_calls(model, x, plan)


def test_a_chain_reads_the_written_value_through_the_recorders_alias(monkeypatch):
    """tanh reads `r` after the write: its output is recomputed from `r`, which on the first
    call is the recorder's alias (its version 0, the write already in its data)."""
    two_us_kernels(monkeypatch)
    model, x, plan = _planned("after")
    tanh = _tanh_outputs(plan)
    assert any(act == "recompute" for _, act in tanh.values()), tanh
    bitwise_calls(model, x, plan)


def test_a_write_under_a_saved_view_is_refused_when_traced():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_Block("raise") for _ in range(2)))
    with pytest.raises(TraceError, match="modified by an inplace operation"):
        slackswap.plan_model(model, (torch.randn(32, 64),), budget=0.5, loss_fn=_loss,
                             device="fake:cpu")


class _Scan(torch.nn.Module):
    """A linear scan as Hugging Face's RecurrentGemma runs it: `c = zeros_like(h)`, then
    `c[:, t] = r` step by step (each a write into `c` through a view), then `c * h`, whose
    output the recompute-only plan re-runs from `c` (kept: a root written in place cannot
    be recomputed)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        h = self.a(x)
        c = torch.zeros_like(h)
        r = torch.zeros_like(h[:, 0])
        for t in range(h.shape[1]):
            r = r * 0.5 + h[:, t]
            c[:, t] = r
        return self.b(c * h)


def test_a_chain_reads_a_root_written_through_views_after_it_was_made(monkeypatch):
    """The chain re-running `c * h` reads `c` as the forward read it, after the writes (its
    version then, not its production's): on the first call it is at hand, not a crash in
    backward; later calls follow the template; every call bitwise."""
    two_us_kernels(monkeypatch)
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Scan(), _Scan())
    x = torch.randn(4, 6, 16)
    plan = recompute_only_plan(model, x, 0.01)
    prof, acts = plan.profile, {d.tensor: str(d.action) for d in plan.plan.decisions}
    scans = [t for t in prof.tensors if t.name.startswith("zeros_like") and t.saved
             and t.shape == (4, 6, 16)]
    assert scans and all(acts[t.id] == "keep" and not t.recomputable for t in scans), scans
    chain_ops = {p for ops in plan.table["chains"].values() for p in ops}
    assert any(t.id in prof.ops[p].inputs for t in scans for p in chain_ops)
    recorded = [r["recorded"] for r in bitwise_calls(model, x, plan)]
    assert recorded == [True, False, False]
