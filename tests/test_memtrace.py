"""memtrace: live activation storages op by op, views once, weak references, exclusion."""
import torch

from slackswap_cli.run.verify.memtrace import SKIP, MemTracker, caller_line


def test_views_count_once_and_frees_are_seen_at_the_next_call():
    x = torch.ones(256)                              # exists before: not activation memory
    tr = MemTracker()
    with tr:
        a = x * 2                                    # 1 KiB allocated
        v = a.view(16, 16)                           # a view: nothing new
        b = v + 1                                    # 1 KiB more
        del a, v                                     # a's storage dies here ...
        c = b.sum()                                  # ... seen at this call
        del b
        d = c + 1                                    # b dead too
    tr.finish()
    assert [s.target for s in tr.samples] == ["aten.mul.Tensor", "aten.view.default",
                                              "aten.add.Tensor", "aten.sum.default",
                                              "aten.add.Tensor"]
    assert tr.timeline() == [1024, 1024, 2048, 1028, 8]
    assert d.item() == 256 * 3 + 1


def test_views_and_in_place_results_of_inputs_cost_nothing():
    w = torch.randn(8, 8)
    tr = MemTracker()
    with tr:
        t = w.t()                                    # view of a parameter-like tensor
        w.mul_(1.0)                                  # in place on it
        y = t @ t
    tr.finish()
    assert tr.timeline() == [0, 0, 256]
    assert len(tr.storages) == 1 and y.shape == (8, 8)


def test_tracking_keeps_nothing_alive():
    tr = MemTracker()
    with tr:
        a = torch.ones(1000) + 1
        ref = a.untyped_storage()._cdata
        del a
        torch.ones(1) + 1
    tr.finish()
    st = [s for s in tr.storages if s.key == ref][0]
    assert st.died == 2 and st.nbytes == 4000     # seen dead at the third call


def test_exclude_takes_gradients_off_the_whole_timeline():
    tr = MemTracker()
    with tr:
        g = torch.ones(100) * 3
        h = torch.ones(50) * 2
    tr.finish()
    before = tr.timeline()
    assert tr.exclude([g]) == 1
    after = tr.timeline()
    assert [b - a for a, b in zip(after, before)] == [0, 400, 400, 400][:len(before)]
    # ones(100) until the next call, ones(50), then h and the dying ones(50)
    assert after == [400, 400, 200, 400] and h.numel() == 50


def test_locate_names_calls_and_skip_allocates_nothing():
    def host_side():
        return torch.empty(64)

    def step():
        a = torch.ones(16) * 2
        b = host_side()
        return a, b

    tr = MemTracker(caller_line({step.__code__: "step", host_side.__code__: SKIP}))
    with tr:
        out = step()
        torch.ones(4) + 1                             # outside both: labelled None
    tr.finish()
    labels = [s.label for s in tr.samples]
    assert labels[0][0] == "step" and labels[2] is SKIP and labels[-1] is None
    assert not tr.samples[2].allocated and len(out) == 2


def test_autograd_saved_tensors_keep_storages_alive():
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(4, 32)
    tr = MemTracker()
    with tr:
        h = torch.tanh(x @ w)                        # tanh saves its output for backward
        loss = h.sum()
        del h
        loss.backward()
    tr.finish()
    tr.exclude([w.grad])
    tl = tr.timeline()
    # the matmul result (freed once tanh ran) and tanh's output (saved) were live together
    assert max(tl) >= 2 * 4 * 32 * 4
    assert tl[-1] < max(tl)
