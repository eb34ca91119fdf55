"""The swap engine a patched module (`slackswap apply`) runs on.

A patched training step keeps some saved activations, recomputes others and *swaps* the rest:
copies them to host memory right after forward produces them, frees the device copy, and
copies them back ahead of their use in backward. This module does the copying, safely:

- **Host buffers** come from a pool keyed by (shape, stride, dtype): pinned (page-locked) on
  CUDA so copies are true DMA and can overlap compute, reused across steps (pinning is slow, so
  we pin once). A buffer goes back to the pool once the copy that reads it has finished.
- **Streams**: D2H copies run on one side stream, H2D copies on another, so both overlap the
  compute stream and each other (PCIe is full duplex).
- **Safety on CUDA**: a side stream first waits for the compute stream (the tensor must be
  written before it is read; a prefetch target must not be written while the compute stream
  may still use that memory). `Tensor.record_stream` tells the caching allocator that the D2H
  stream still reads the device tensor, so freeing it on the compute stream does not let the
  memory be reused before the copy is done. The compute stream waits on the H2D copy's event
  before it uses the prefetched tensor.
- **Engines**: each device type's swaps run on one engine, chosen once (`engine_for`):
  `StreamEngine` over `CudaOps` on CUDA (the streams, events and allocator calls above),
  `SyncEngine` on the CPU (the "host buffer" is another CPU tensor and copies are
  synchronous). `StreamEngine` takes its device calls from an object, so the tests run it,
  the very code CUDA runs, over the emulated asynchronous device of
  `slackswap_testkit/emulated_device.py` (`set_engine`; docs/runtime.md, "The swap engine").

`StepStore` is the per-step object a patched step's forward fills and its backward empties:
`keep(name, t)` / `take(name)` for kept tensors, `offload(name, t)` / `prefetch(name)` /
`wait(name)` for swapped ones. A kernel may leave an output undefined (`None` in Python; the
CPU RNN kernels do so for their workspace when grad mode is off, which `_traced_mode` avoids):
such a value holds no memory, whatever the plan says, so it is held as `None` and handed back
as `None`. The store also accounts honestly for what it holds on the device
(`held_device_bytes`): kept storages (each counted once, parameters, buffers and inputs
excluded, since they exist anyway) plus swapped tensors whose D2H copy has not finished.

Global state: only the reusable pools (host buffers, side streams) and the engines that hold
them, never anything per step.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from ..trace.storage import storage_key, storage_nbytes

__all__ = ["HostPool", "Handle", "StepStore", "offload", "prefetch", "wait", "host_pool",
           "side_streams", "storage_as_bytes", "offload_storage", "Storages", "StorageCopy", "HostCopy",
           "wait_kept", "offload_whole", "CudaOps", "SyncEngine", "StreamEngine", "engine_for", "set_engine"]


# --------------------------------------------------------------------------------------------
# Pools (the only global state)
# --------------------------------------------------------------------------------------------
class HostPool:
    """Host buffers keyed by (shape, stride, dtype), reused across steps; `pinned`:
    page-locked (the CUDA engine's pool), `alloc`: how a new buffer is made (the emulated
    device fills its own with a sentinel).

    `get` hands out a free buffer (or allocates one); `put` returns it together with the event
    of the last copy that touches it, and `get` never hands out a buffer whose copy may still
    run (on CUDA it checks the event; a finished event costs nothing).
    """

    def __init__(self, pinned: bool = False, alloc=None) -> None:
        self._free: dict[tuple, list[tuple[torch.Tensor, Any]]] = {}
        self.pinned, self._alloc = pinned, alloc
        self.allocated_bytes = 0   # host bytes ever allocated by this pool (a reuse check)

    def get(self, shape, stride, dtype) -> torch.Tensor:
        free = self._free.get((tuple(shape), tuple(stride), dtype))
        if free:
            for i, (buf, event) in enumerate(free):
                if event is None or event.query():
                    free.pop(i)
                    return buf
        if self._alloc is not None:
            buf = self._alloc(tuple(shape), tuple(stride), dtype)
        else:
            buf = torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype, device="cpu",
                                      pin_memory=self.pinned)
        self.allocated_bytes += buf.untyped_storage().nbytes()
        return buf

    def put(self, buf: torch.Tensor, event=None) -> None:
        self._free.setdefault((tuple(buf.shape), buf.stride(), buf.dtype), []).append(
            (buf, event))

    def free_bytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for v in self._free.values() for b, _ in v)

    def clear(self) -> None:
        self._free.clear()


_STREAMS: dict[Any, tuple[Any, Any]] = {}


def side_streams(device: torch.device) -> tuple[Any, Any]:
    """(d2h stream, h2d stream) of a CUDA device, created once."""
    key = (device.type, device.index if device.index is not None else torch.cuda.current_device())
    if key not in _STREAMS:
        with torch.cuda.device(key[1]):
            _STREAMS[key] = (torch.cuda.Stream(), torch.cuda.Stream())
    return _STREAMS[key]


class CudaOps:
    """What the stream engine asks of the device: torch.cuda's streams, events and caching
    allocator. The emulated device (`slackswap_testkit/emulated_device.py`) gives the same
    calls over CPU tensors, with copies that run late."""
    pinned = True
    side_streams = staticmethod(side_streams)
    current_stream = staticmethod(lambda device: torch.cuda.current_stream(device))
    stream = staticmethod(lambda s: torch.cuda.stream(s))
    Event = staticmethod(lambda: torch.cuda.Event())

    @staticmethod
    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue the copy on the current stream."""
        dst.copy_(src, non_blocking=True)

    @staticmethod
    def record_stream(t: torch.Tensor, s) -> None:
        t.record_stream(s)

    @staticmethod
    def empty_device(shape, stride, dtype, device) -> torch.Tensor:
        """Device memory from the caching allocator, on the current (compute) stream."""
        return torch.empty_strided(shape, stride, dtype=dtype, device=device)


# --------------------------------------------------------------------------------------------
# Storage accounting
# --------------------------------------------------------------------------------------------
def storage_as_bytes(x: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over all of x's storage (a swap moves the whole root)."""
    s = x.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=x.device).set_(s, 0, (s.nbytes(),), (1,))


class Storages:
    """A set of storages by storage key (`key in storages`), each held weakly: once one is
    freed (a hook's temporary, a swapped activation), a later tensor that reuses its address
    is not taken for it. What a forward read but did not make (parameters, buffers, the call's
    inputs, a hook's values) and what autograd saved are such sets."""
    __slots__ = ("refs",)

    def __init__(self, refs: dict | None = None):
        self.refs: dict = {} if refs is None else refs

    def add(self, x: torch.Tensor) -> None:
        key = storage_key(x)
        ref = self.refs.get(key)
        if ref is None or ref.expired():
            self.refs[key] = StorageWeakRef(x.untyped_storage())

    def __contains__(self, key) -> bool:
        ref = self.refs.get(key)
        return ref is not None and not ref.expired()

    def without_tensors(self, xs: list) -> "Storages":
        """These storages less those of tensors `xs`."""
        keys = {storage_key(x) for x in xs if x.device.type != "meta"}
        return Storages({k: r for k, r in self.refs.items() if k not in keys})

    def with_tensors(self, xs: list) -> "Storages":
        got = Storages(dict(self.refs))
        for x in xs:
            if x.device.type != "meta":
                got.add(x)
        return got


class HostCopy:
    """The host copy of one swapped storage, held by the saved references autograd holds
    (`packs.SwappedRef.host`) and so kept as long as the graph can still unpack them: a
    second backward through a retained graph (`backward(retain_graph=True)` twice, a split
    backward's weight pass) fetches it again (`fetch`, a fresh device copy each time). The
    buffer goes back to the pool when the last of them is gone (the graph freed, or each
    node's saved tensors released by a backward without `retain_graph`), once fetched: a
    copy never fetched (a graph dropped without backward) may still be read through its
    `StorageCopy`, so its buffer is left to the collector rather than handed out again."""
    __slots__ = ("handle", "fetched", "__weakref__")

    def __init__(self, handle: Handle):
        self.handle, self.fetched = handle, False

    def fetch(self) -> torch.Tensor:
        """A device copy of the host bytes (not kept: the caller holds it as long as it
        needs it)."""
        self.fetched = True
        return wait_kept(self.handle)

    def __del__(self):
        h = self.handle
        if self.fetched and h is not None and h.host is not None:
            h.engine.give_back(h)


class StorageCopy:
    """One storage copied to host memory: its copy (`handle`) until fetched back, then the
    device bytes (`dev`) while anything may still read them; `packs`: saved references to it
    autograd has not taken yet; `host`: a weak reference to its `HostCopy` (which the saved
    references hold), to fetch it again after the first backward let go of it; `geo`: the
    (dtype, shape, stride, offset) of the tensor copied as it is, or None (its bytes)."""
    __slots__ = ("ref", "handle", "dev", "packs", "version", "host", "geo")

    def __init__(self, ref, handle, version: int, geo: tuple | None = None):
        self.ref, self.handle, self.dev, self.packs = ref, handle, None, 0
        self.version, self.geo = version, geo
        self.host = None

    def fetch(self) -> torch.Tensor:
        if self.dev is None:
            if self.handle is None:
                return self.fetch_again()
            h = self.handle               # (`wait_kept`)
            if h.device_copy is None:
                h.engine.prefetch(h)
            h.engine.wait_copy(h)
            self.dev, h.device_copy = h.device_copy, None
            self.handle = None
            hc = self.host() if self.host is not None else None
            if hc is not None:
                hc.fetched = True
        return self.dev

    def can_fetch(self) -> bool:
        """Whether `fetch` can give the bytes: at hand, still on the host before the first
        fetch, or after it while a saved reference holds the host copy."""
        return (self.dev is not None or self.handle is not None
                or (self.host is not None and self.host() is not None))

    def fetch_again(self) -> torch.Tensor:
        """After the first backward let go of the device bytes: a fresh device copy from the
        host copy, while a saved reference still holds it (a graph retained for another
        backward), not kept here."""
        hc = self.host() if self.host is not None else None
        if hc is None:
            raise RuntimeError("slackswap: a swapped tensor was read after its last use; "
                               "this is a bug in slackswap, please report it")
        return hc.fetch()


# --------------------------------------------------------------------------------------------
# One swapped tensor
# --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Handle:
    """A tensor living in host memory between forward and backward.

    `host` holds the data once `d2h_done` (CUDA event, None on CPU) has fired; `device_copy`
    is the tensor brought back by `prefetch`, ready once `h2d_done` has fired. `source` is a
    weak reference to the original device tensor: after forward drops it, it is dead (tests
    use it to prove the device storage was released while the host copy exists).
    """
    host: torch.Tensor
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    nbytes: int
    d2h_done: Any = None
    source: Any = None
    device_copy: torch.Tensor | None = None
    h2d_done: Any = None
    engine: Any = None       # the engine that copies it (`engine_for`)
    _storage: Any = field(default=None, repr=False)   # weakref to the device storage

    def device_storage_alive(self) -> bool:
        """Does the forward's device tensor (or storage: `offload_storage`) still exist?
        (False once it has been freed.)"""
        src = self.source
        if isinstance(src, StorageWeakRef):
            return not src.expired()
        return src is not None and src() is not None


def _dense(t: torch.Tensor) -> bool:
    """Does `t` cover its memory exactly once (contiguous up to a permutation of dims)?"""
    if t.is_contiguous():
        return True
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), -t.size(d)))
    return t.permute(order).is_contiguous()


def offload(t: torch.Tensor) -> Handle:
    """Start copying `t` to a host buffer; the caller may drop `t` right after (the engine of
    t's device: `engine_for`)."""
    dense = _dense(t)
    stride = t.stride() if dense else torch.empty(t.shape, device="meta").stride()
    engine = engine_for(t.device)
    handle = Handle(host=None, shape=tuple(t.shape), stride=tuple(stride), dtype=t.dtype,  # type: ignore[arg-type]
                    device=t.device, nbytes=t.numel() * t.element_size(),
                    source=weakref.ref(t), engine=engine)
    engine.offload(t, handle)
    return handle


def offload_whole(t: torch.Tensor, shape: tuple, stride: tuple) -> Handle:
    """`offload(t)` for a contiguous `t` that covers its storage exactly from offset 0, of
    `shape` and `stride` (the eager runtime's swap of most saved tensors: the checks and
    look-ups `offload` makes are known)."""
    device = t.device
    engine = _ENGINES.get(device.type)
    if engine is None:
        engine = engine_for(device)
    handle = Handle(host=None, shape=shape, stride=stride, dtype=t.dtype,  # type: ignore[arg-type]
                    device=device, nbytes=t.nbytes, source=weakref.ref(t), engine=engine)
    engine.offload(t, handle)
    return handle


def offload_storage(st, device: torch.device, ref=None) -> Handle:
    """`offload(storage_as_bytes(x))` for `x`'s storage `st` on `device`, without the
    checks a flat byte view needs not (it is dense; its shape and stride are known): the
    eager runtime's swap of a saved tensor that does not cover its storage exactly. On
    the CPU's `SyncEngine` the storage is copied as it is, with no byte view made (the
    handle's `source` is then `ref`, a `StorageWeakRef` to it, or None)."""
    n = st.nbytes()
    engine = engine_for(device)
    if type(engine) is SyncEngine:
        handle = Handle(host=None, shape=(n,), stride=(1,), dtype=torch.uint8,  # type: ignore[arg-type]
                        device=device, nbytes=n, source=ref, engine=engine)
        engine.offload_storage(st, handle)
        return handle
    t = torch.empty(0, dtype=torch.uint8, device=device).set_(st, 0, (n,), (1,))
    handle = Handle(host=None, shape=(n,), stride=(1,), dtype=torch.uint8,  # type: ignore[arg-type]
                    device=device, nbytes=n, source=weakref.ref(t), engine=engine)
    engine.offload(t, handle)
    return handle


def prefetch(handle: Handle) -> None:
    """Start copying a swapped tensor back to its device (no-op if already started)."""
    if handle.device_copy is None:
        handle.engine.prefetch(handle)


def wait_kept(handle: Handle) -> torch.Tensor:
    """The prefetched device tensor, once its copy is done (prefetches now if nobody did),
    keeping the host buffer for another fetch (`HostCopy` gives it back to the pool)."""
    prefetch(handle)
    dev = handle.device_copy
    handle.engine.wait_copy(handle)
    handle.device_copy = None
    return dev


def wait(handle: Handle) -> torch.Tensor:
    """The prefetched device tensor, once its copy is done (prefetches now if nobody did).

    Returns the host buffer to the pool: it is reusable once the H2D copy has finished.
    """
    prefetch(handle)
    dev = handle.device_copy
    handle.engine.wait_copy(handle)
    if handle.host is not None:
        handle.engine.give_back(handle)
    handle.device_copy = None
    return dev


class SyncEngine:
    """The CPU: the "host buffer" is another CPU tensor and every copy is synchronous."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool

    def offload(self, t: torch.Tensor, handle: Handle) -> None:
        host = self.pool.get(t.shape, handle.stride, t.dtype)
        host.copy_(t)
        handle.host = host

    def offload_storage(self, st, handle: Handle) -> None:
        """A whole storage into a byte buffer, storage to storage (one call, no view)."""
        host = self.pool.get(handle.shape, handle.stride, torch.uint8)
        host.untyped_storage().copy_(st)
        handle.host = host

    def prefetch(self, handle: Handle) -> None:
        if handle.device.type == "cpu":         # (one call: the host buffer is dense)
            handle.device_copy = handle.host.clone()
            return
        dev = torch.empty_strided(handle.shape, handle.stride, dtype=handle.dtype,
                                  device=handle.device)
        dev.copy_(handle.host)
        handle.device_copy = dev

    def wait_copy(self, handle: Handle) -> None:
        pass

    def give_back(self, handle: Handle) -> None:
        self.pool.put(handle.host)
        handle.host = None


class StreamEngine:
    """CUDA (through `ops`: `CudaOps`, or the emulated device's): copies on side streams,
    ordered by waits and events.

    offload: the copy runs on the D2H side stream after everything the compute stream has
    queued so far (so `t` is fully written); `record_stream` keeps the caching allocator from
    reusing `t`'s memory before the copy is done, even if the caller frees `t` at once.
    prefetch: the device memory is allocated on the compute stream (so the allocator orders it
    after the compute stream's earlier uses of that memory), and the H2D stream waits for the
    compute stream before writing into it, and for the D2H copy before reading the host
    buffer. wait_copy: the compute stream waits for the H2D copy before it reads the result.
    give_back: the host buffer goes back to the pool with the event of the last copy that
    reads it (the pool hands it out again once that event has fired).
    """

    def __init__(self, ops, pool: HostPool) -> None:
        self.ops, self.pool = ops, pool

    def offload(self, t: torch.Tensor, handle: Handle) -> None:
        ops = self.ops
        host = self.pool.get(t.shape, handle.stride, t.dtype)
        d2h, _ = ops.side_streams(t.device)
        d2h.wait_stream(ops.current_stream(t.device))
        with ops.stream(d2h):
            ops.copy(host, t)
            ops.record_stream(t, d2h)
            done = ops.Event()
            done.record(d2h)
        handle.host, handle.d2h_done = host, done

    def prefetch(self, handle: Handle) -> None:
        ops = self.ops
        dev = ops.empty_device(handle.shape, handle.stride, handle.dtype, handle.device)
        _, h2d = ops.side_streams(handle.device)
        h2d.wait_stream(ops.current_stream(handle.device))
        with ops.stream(h2d):
            if handle.d2h_done is not None:
                h2d.wait_event(handle.d2h_done)
            ops.copy(dev, handle.host)
            done = ops.Event()
            done.record(h2d)
        handle.device_copy, handle.h2d_done = dev, done

    def wait_copy(self, handle: Handle) -> None:
        if handle.h2d_done is not None:
            self.ops.current_stream(handle.device).wait_event(handle.h2d_done)

    def give_back(self, handle: Handle) -> None:
        self.pool.put(handle.host, handle.h2d_done)
        handle.host = None


_ENGINES: dict[str, Any] = {}


def engine_for(device: torch.device):
    """The engine swaps of `device` run on, made once per device type: `StreamEngine` over
    `CudaOps` for CUDA, `SyncEngine` otherwise; `set_engine` puts another in its place."""
    engine = _ENGINES.get(device.type)
    if engine is None:
        engine = _ENGINES[device.type] = (
            StreamEngine(CudaOps, HostPool(pinned=True)) if device.type == "cuda"
            else SyncEngine(HostPool()))
    return engine


def set_engine(device_type: str, engine):
    """Swaps of `device_type` run on `engine` from now on (None: the default again); returns
    the one it replaces (the emulated device puts itself in for "cpu" and back)."""
    old = _ENGINES.pop(device_type, None)
    if engine is not None:
        _ENGINES[device_type] = engine
    return old


def host_pool(device_type: str = "cpu") -> HostPool:
    """The pool of host buffers of `device_type`'s engine."""
    return engine_for(torch.device(device_type)).pool


# --------------------------------------------------------------------------------------------
# One step's saved state
# --------------------------------------------------------------------------------------------
class StepStore:
    """What a patched step's forward leaves for its backward, by tensor name.

    `exclude` are tensors that exist anyway (parameters, buffers, inputs): keeping a view of
    one costs no activation memory, so their storages are left out of `held_device_bytes`.
    """

    def __init__(self, exclude: list[torch.Tensor] = ()) -> None:
        self.kept: dict[str, torch.Tensor] = {}
        self.swapped: dict[str, Handle] = {}
        self._exclude = {storage_key(t) for t in exclude if isinstance(t, torch.Tensor)}
        self.offloaded_bytes = 0
        self.prefetched_bytes = 0

    # -- forward ---------------------------------------------------------------------------
    def keep(self, name: str, t: torch.Tensor) -> None:
        self.kept[name] = t

    def offload(self, name: str, t: torch.Tensor | None) -> None:
        if t is None:   # an undefined output (an RNN kernel's unused workspace): nothing to copy
            self.kept[name] = None
            return
        self.swapped[name] = offload(t)
        self.offloaded_bytes += self.swapped[name].nbytes

    # -- backward --------------------------------------------------------------------------
    def take(self, name: str) -> torch.Tensor:
        """Hand a kept tensor to backward and forget it (backward frees it after its last use)."""
        return self.kept.pop(name)

    def prefetch(self, name: str) -> None:
        h = self.swapped.get(name)
        if h is None:
            return          # an undefined output, held as None (see `offload`)
        if h.device_copy is None:
            prefetch(h)
            self.prefetched_bytes += h.nbytes

    def wait(self, name: str) -> torch.Tensor | None:
        if name not in self.swapped and self.kept.get(name, 0) is None:
            return self.kept.pop(name)   # an undefined output (see `offload`)
        self.prefetch(name)
        return wait(self.swapped.pop(name))

    # -- accounting ------------------------------------------------------------------------
    def held_device_bytes(self) -> int:
        """Device bytes this store keeps alive for backward right now.

        Kept tensors count by storage (a view and its base once); swapped tensors count only
        while their D2H copy may still be running (on CPU the copy is already done) or once
        prefetched back.
        """
        seen: set = set()
        total = 0
        for t in self.kept.values():
            if not isinstance(t, torch.Tensor):
                continue    # an undefined output (None): it holds no memory
            key = storage_key(t)
            if key in seen or key in self._exclude:
                continue
            seen.add(key)
            total += storage_nbytes(t)
        for h in self.swapped.values():
            if h.device_copy is not None:
                total += h.nbytes
            elif h.d2h_done is not None and not h.d2h_done.query():
                total += h.nbytes  # record_stream holds the device memory until the copy ends
        return total
