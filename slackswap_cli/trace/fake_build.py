"""Build a model under fake tensors the way its author wrote it: `.to(dtype)`, `.half()`, init.

`--device fake` runs `workload()` inside a FakeTensorMode, so every parameter is a FakeTensor
(shape, dtype and device; no data). Two things in ordinary model code do not work there out of
the box, and `fake_build(mode)` makes both work while `workload()` runs:

- **Module conversions** (`model.to(torch.bfloat16)`, `.half()`, `.float()`, `.to("cpu")`).
  `nn.Module._apply` replaces a FakeTensor parameter by `torch.utils.swap_tensors(old, new)`,
  which keeps the Parameter object (so tied weights stay tied) but refuses any tensor that a
  weak reference points to. FakeTensorMode's converter memo (a `WeakValueDictionary` from the
  meta tensor it wrapped to the FakeTensor) holds exactly such references to every fake view
  it made, and `Parameter(fake)` is a view (`detach`). Here the swap first drops the memo's own
  entries for the two tensors, then swaps. Those entries would be stale after the swap anyway
  (the object now holds the other tensor's data), and any other weak reference still makes the
  swap refuse, as before.
- **Value-dependent weight init.** `torch.nn.init.trunc_normal_` (Hugging Face ViT, DeiT,
  Swin, ...) redraws samples while any lies outside its bounds: it asks the data
  (`mask.any()`, `.item()`), which fake tensors do not have. Initial values of a fake tensor
  mean nothing, so init on a fake tensor returns it unchanged.
- **Settings computed with tensors.** Many vision models spread stochastic-depth rates with
  `torch.linspace(0, rate, n).tolist()` (Hugging Face ConvNeXt, and about twenty more). A
  small `torch.linspace` made while building is computed for real and wrapped as a *constant*
  FakeTensor, which FakeTensorMode can answer `.item()` and `.tolist()` for.

The patches are in place only while `workload()` runs under `fake_build`; real tensors take
torch's own path unchanged.
"""
from __future__ import annotations

import contextlib
import weakref

import torch
import torch.utils._pytree as pytree

_CONSTANT_NUMEL = 4096   # a linspace this small is a setting, not data worth not allocating

def _forget(memo, tensor) -> None:
    """Drop `memo`'s entries whose weak reference points at `tensor` (its memo of fake views)."""
    data = getattr(memo, "data", None)
    if not isinstance(data, dict):
        return
    for ref in weakref.getweakrefs(tensor):
        if isinstance(ref, weakref.KeyedRef) and data.get(ref.key) is ref:
            del data[ref.key]


@contextlib.contextmanager
def fake_build(fake_mode):
    """While active: module conversions and `trunc_normal_` work on `fake_mode`'s FakeTensors."""
    from torch._subclasses.fake_tensor import FakeTensor

    # private to torch: should a later torch move it, conversions fail as they did before
    converter = getattr(getattr(fake_mode, "fake_tensor_converter", None), "meta_converter", None)
    memo = getattr(converter, "tensor_memo", None)
    swap_original = torch.utils.swap_tensors
    trunc_original = getattr(torch.nn.init, "_no_grad_trunc_normal_", None)

    def swap_tensors(t1, t2):
        for t in (t1, t2):
            if memo is not None and isinstance(t, FakeTensor) and t.fake_mode is fake_mode:
                _forget(memo, t)
        return swap_original(t1, t2)

    def no_grad_trunc_normal_(tensor, *args, **kwargs):
        if isinstance(tensor, FakeTensor):
            return tensor     # no values to draw: the shape is all a fake tensor has
        return trunc_original(tensor, *args, **kwargs)

    linspace_original = torch.linspace

    def linspace(*args, **kwargs):
        out = linspace_original(*args, **kwargs)
        small = (out.numel() <= _CONSTANT_NUMEL and out.device.type == "cpu"
                 and not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs))))
        if not (small and isinstance(out, FakeTensor) and out.fake_mode is fake_mode):
            return out
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        with unset_fake_temporarily():
            real = linspace_original(*args, **kwargs)
        return fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, real, make_constant=True)

    torch.utils.swap_tensors = swap_tensors
    torch.linspace = linspace
    if trunc_original is not None:
        torch.nn.init._no_grad_trunc_normal_ = no_grad_trunc_normal_
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap_original
        torch.linspace = linspace_original
        if trunc_original is not None:
            torch.nn.init._no_grad_trunc_normal_ = trunc_original
