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
  FakeTensor, which FakeTensorMode can answer `.item()` and `.tolist()` for. FakeTensorMode
  propagates constants through an op only when its result has at most
  `fake_tensor.CONSTANT_NUMEL_LIMIT` (1) elements; while `workload()` runs the limit is
  `_CONSTANT_NUMEL`, so `linspace(0, rate, sum(depths)).split(depths)` then `.tolist()` on
  each piece (Hugging Face ConvNeXt at its default depths) works too. Only ops whose inputs are
  all constants propagate (settings made from a linspace or `torch.tensor(...)`), never weights.
- **Copies of modules.** `copy.deepcopy(block)` (every `nn.TransformerEncoder`/`Decoder`
  clones its layer; many models copy a block) copies a FakeTensor through `Tensor.__deepcopy__`,
  which makes the copy in a FakeTensorMode of its own: the traced step then mixes two modes and
  fails. Here a FakeTensor of the build's mode is copied by `clone()` in that mode (a
  parameter stays a parameter, `requires_grad` and Python attributes are kept).
- **Functions compiled by the model's own code.** torchtitan builds its flex-attention
  BlockMask with `torch.compile(create_block_mask)`; called on fake tensors, inductor's compiled
  code reads their (absent) data and the process dies of a segmentation fault (torch 2.13
  and 2.15 alike: tests/test_fake_conversions.py).
  While `workload()` runs, `torch.compiler.set_stance("force_eager")` runs every compiled
  function's Python as it is, which fake tensors follow like any other code.

The patches are in place only while `workload()` runs under `fake_build`; real tensors take
torch's own path unchanged.
"""
from __future__ import annotations

import contextlib
import copy
import weakref

import torch
import torch.utils._pytree as pytree
from torch._subclasses import fake_tensor as fake_tensor_module  # private to torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

_CONSTANT_NUMEL = 4096   # a linspace this small is a setting, not data worth not allocating

def _forget(memo, tensor) -> None:
    """Drop `memo`'s entries whose weak reference points at `tensor` (its memo of fake views)."""
    data = getattr(memo, "data", None)
    if not isinstance(data, dict):
        return
    for ref in weakref.getweakrefs(tensor):
        if isinstance(ref, weakref.KeyedRef) and data.get(ref.key) is ref:
            del data[ref.key]


def _fake_deepcopy(tensor, memo: dict, fake_mode):
    """A copy of `tensor` (a FakeTensor of `fake_mode`) in that same mode, as deepcopy makes it."""
    if id(tensor) in memo:
        return memo[id(tensor)]
    if not tensor.is_leaf:
        return torch.Tensor.__deepcopy__(tensor, memo)   # torch's own error for non-leaves
    with fake_mode, torch.no_grad():
        out = tensor.clone(memory_format=torch.preserve_format)
    if isinstance(tensor, torch.nn.Parameter):
        out = torch.nn.Parameter(out, requires_grad=tensor.requires_grad)
    else:
        out.requires_grad_(tensor.requires_grad)
    memo[id(tensor)] = out
    for key, value in vars(tensor).items():     # attributes the model set on the tensor
        if key not in vars(out):
            setattr(out, key, copy.deepcopy(value, memo))
    return out


@contextlib.contextmanager
def eager_stance():
    """Functions the model's code compiled itself (`torch.compile(fn)`) run their Python:
    `torch.compiler.set_stance("force_eager")`, so fake tensors follow them (inductor's
    compiled code would read a fake tensor's absent data), and dynamo's
    `error_on_nested_fx_trace` off, so make_fx traces through them instead of refusing a
    "dynamo-optimized function". A torch without either (set_stance: before 2.6): no change."""
    with contextlib.ExitStack() as stack:
        set_stance = getattr(getattr(torch, "compiler", None), "set_stance", None)
        if set_stance is not None:
            stack.enter_context(set_stance("force_eager"))
        from torch._dynamo import config  # private to torch (torch_api.PRIVATE_API)
        if hasattr(config, "error_on_nested_fx_trace"):
            stack.enter_context(config.patch(error_on_nested_fx_trace=False))
        yield


@contextlib.contextmanager
def fake_build(fake_mode):
    """While active: module conversions and `trunc_normal_` work on `fake_mode`'s FakeTensors."""
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

    deepcopy_original = FakeTensor.__dict__.get("__deepcopy__")

    def deepcopy(self, memo):
        if self.fake_mode is not fake_mode:
            return torch.Tensor.__deepcopy__(self, memo)
        return _fake_deepcopy(self, memo, fake_mode)

    linspace_original = torch.linspace

    def linspace(*args, **kwargs):
        out = linspace_original(*args, **kwargs)
        small = (out.numel() <= _CONSTANT_NUMEL and out.device.type == "cpu"
                 and not any(isinstance(x, torch.Tensor) for x in pytree.tree_leaves((args, kwargs))))
        if not (small and isinstance(out, FakeTensor) and out.fake_mode is fake_mode):
            return out
        with unset_fake_temporarily():
            real = linspace_original(*args, **kwargs)
        return fake_mode.fake_tensor_converter.from_real_tensor(fake_mode, real, make_constant=True)

    limit_original = fake_tensor_module.CONSTANT_NUMEL_LIMIT
    torch.utils.swap_tensors = swap_tensors
    torch.linspace = linspace
    fake_tensor_module.CONSTANT_NUMEL_LIMIT = max(limit_original, _CONSTANT_NUMEL)
    FakeTensor.__deepcopy__ = deepcopy
    if trunc_original is not None:
        torch.nn.init._no_grad_trunc_normal_ = no_grad_trunc_normal_
    try:
        with eager_stance():
            yield
    finally:
        torch.utils.swap_tensors = swap_original
        torch.linspace = linspace_original
        fake_tensor_module.CONSTANT_NUMEL_LIMIT = limit_original
        if deepcopy_original is None:
            del FakeTensor.__deepcopy__
        else:
            FakeTensor.__deepcopy__ = deepcopy_original
        if trunc_original is not None:
            torch.nn.init._no_grad_trunc_normal_ = trunc_original
