"""The swap engine: host pool, offload/prefetch/wait, the step store's accounting (CPU; CUDA if present)."""
import gc

import pytest
import torch

from slackswap_cli.run import swap as rt

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_pool_reuses_buffers_by_shape_stride_dtype():
    pool = rt.HostPool(pinned=False)
    a = pool.get((4, 8), (8, 1), torch.float32)
    assert pool.allocated_bytes == 4 * 8 * 4
    pool.put(a)
    b = pool.get((4, 8), (8, 1), torch.float32)
    assert b is a and pool.allocated_bytes == 128          # reused, nothing new allocated
    c = pool.get((4, 8), (1, 4), torch.float32)  # other strides: another buffer
    d = pool.get((4, 8), (8, 1), torch.float16)  # other dtype: another buffer
    assert c is not a and d is not a
    assert pool.allocated_bytes == 128 + 128 + 64
    pool.put(b)
    assert pool.free_bytes() == 128


def test_offload_prefetch_wait_round_trip_keeps_values_and_strides():
    x = torch.randn(6, 10).t()            # non-contiguous: strides (1, 10)
    h = rt.offload(x)
    assert h.host is not None and torch.equal(h.host, x)
    assert h.host.stride() == x.stride() and h.host.data_ptr() != x.data_ptr()
    rt.prefetch(h)
    y = rt.wait(h)
    assert torch.equal(y, x) and y.stride() == x.stride()
    assert y.data_ptr() != x.data_ptr()   # a fresh "device" tensor, not the original


def test_offload_of_overlapping_tensor_gets_dense_copy():
    x = torch.randn(3, 1).expand(3, 4)    # stride 0: not dense
    y = rt.wait(rt.offload(x))
    assert torch.equal(y, x) and y.is_contiguous()


def test_device_storage_is_released_while_host_copy_exists():
    store = rt.StepStore()
    x = torch.arange(1000, dtype=torch.float32)
    store.offload("x", x)
    handle = store.swapped["x"]
    assert handle.device_storage_alive()
    del x
    gc.collect()
    assert not handle.device_storage_alive()           # the forward's tensor is gone ...
    assert torch.equal(handle.host, torch.arange(1000, dtype=torch.float32))  # ... its data is on the host
    assert store.held_device_bytes() == 0
    y = store.wait("x")
    assert torch.equal(y, torch.arange(1000, dtype=torch.float32))
    assert "x" not in store.swapped


def test_storage_offload_on_the_cpu_copies_the_whole_storage_and_tracks_it():
    """The eager runtime's swap of a view (`offload_storage`): on the CPU's engine the
    storage is copied storage to storage, all of it; the handle knows when the forward's
    storage is freed."""
    from torch.multiprocessing.reductions import StorageWeakRef
    base = torch.arange(24, dtype=torch.float32)
    view = base[4:16].view(3, 4).t()       # a part of the storage, transposed
    st = view.untyped_storage()
    h = rt.offload_storage(st, view.device, StorageWeakRef(st))
    assert h.nbytes == 96 and h.host.dtype == torch.uint8
    assert torch.equal(h.host, base.view(torch.uint8))        # every byte, not the view's
    assert h.device_storage_alive()
    del base, view, st
    gc.collect()
    assert not h.device_storage_alive()
    back = rt.wait(h).view(torch.float32)
    assert torch.equal(back, torch.arange(24, dtype=torch.float32))


def test_store_counts_kept_storages_once_and_skips_excluded():
    w = torch.randn(8, 8)                 # a "parameter": exists anyway
    a = torch.randn(16, 4)
    store = rt.StepStore(exclude=[w])
    store.keep("a", a)
    store.keep("a_t", a.t())              # a view of a: same storage
    store.keep("w_t", w.t())              # a view of a parameter: costs nothing
    assert store.held_device_bytes() == 16 * 4 * 4
    assert store.take("a") is a
    assert store.held_device_bytes() == 16 * 4 * 4      # a_t still holds the storage
    store.take("a_t")
    assert store.held_device_bytes() == 0


def test_wait_without_prefetch_still_works_and_returns_buffer_to_pool():
    pool = rt.host_pool()
    x = torch.randn(5, 7)
    free_before = pool.free_bytes()
    y = rt.wait(rt.offload(x))
    assert torch.equal(x, y)
    assert pool.free_bytes() == free_before + 5 * 7 * 4   # host buffer back in the pool
    z = rt.offload(torch.randn(5, 7))                      # and reused by the next offload
    assert pool.free_bytes() == free_before
    rt.wait(z)


@cuda
def test_cuda_round_trip_on_side_streams():
    x = torch.randn(1024, 1024, device="cuda")
    expected = x.clone()
    store = rt.StepStore()
    store.offload("x", x)
    h = store.swapped["x"]
    assert h.host.is_pinned()
    del x                                  # freed on the compute stream; record_stream guards the copy
    torch.cuda.synchronize()
    assert store.held_device_bytes() == 0
    store.prefetch("x")
    y = store.wait("x")
    assert torch.equal(y, expected)
