"""An emulated asynchronous device: the swap engine's CUDA code (`swap.StreamEngine`) run over
CPU tensors, with copies that run late and every missing synchronization made to corrupt data.

    with emulated_device() as dev:      # swaps of CPU tensors now take the CUDA path
        ...train patched steps...       # dev.stats: copies deferred, copies corrupted, why

What it models (docs/runtime.md, "The swap engine", says the same for a reader):

- **Streams.** Two side streams (D2H, H2D) hold queues of copies, event records and waits. A
  copy runs only when something waits on it: the compute stream waiting on an event after it
  (`wait_event`), another side stream's queued wait reaching it, the end of the `with` block
  (`synchronize`), or, with `lag=n`, once n newer operations are queued on its stream.
- **The compute stream** is the CPU itself: what Python runs has run. There may be several
  (`compute_stream`, entered with `stream` as torch.cuda.stream is): all run on the CPU, each
  with its own clock, so a side stream ordered after one is not ordered after another. The
  host seeing an event finish (`query` true, `synchronize`) orders everything queued after it
  behind what the event covers; a stream's wait does not. Each call into the engine
  starts a new compute "moment" (a tick): the compute stream may have written what the call
  copies just before it, and memory a prefetch allocates may still be in use by the compute
  stream's earlier work. A side-stream copy that reads or writes device memory is correct only
  if its stream waited on the compute stream (`wait_stream`) in this call before the copy was
  queued; otherwise its result is the sentinel.
- **Freed device memory.** A copy holds its device source weakly: a source freed before the copy
  runs gives the sentinel, unless `record_stream` told the allocator the stream still reads it
  (then the storage is held until the stream has run what was queued on it by the end of the
  engine call, the earliest a free could come).
- **Prefetch targets** are allocated filled with the sentinel and hold it until their copy runs.
- **Host buffers.** Fresh ones hold the sentinel. Every copy's access to a host buffer is checked
  against earlier accesses from the other side stream with vector clocks (what each stream's
  waits order it after, the compute stream's waits passed on by `wait_stream`): two accesses
  not ordered, one of them a write, are a race, and both copies then give the sentinel (a
  buffer handed out again while an earlier copy still reads or writes it is overwritten).

The sentinel is every byte 0xFF: NaN in every floating dtype, -1 in signed integers.
What it cannot model: a data race between two compute streams (both are the CPU), the
timing of real copies (the worst case is taken instead, not measured), memory (a copy not yet
run holds its target and, after `record_stream`, its source: peaks differ from CUDA's), and
anything outside `StreamEngine` (torch's own offload ops of the compiled path, NCCL/gloo).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from slackswap_cli.run import swap

__all__ = ["emulated_device", "emulated_if_asked", "EmulatedDevice", "EmulatedEngine", "poison",
           "is_poisoned", "ENV", "emulated_stats"]

SENTINEL = 0xFF


def poison(t: torch.Tensor) -> None:
    """Every byte of t's storage set to the sentinel."""
    swap.storage_as_bytes(t).fill_(SENTINEL)


def is_poisoned(t: torch.Tensor) -> bool:
    """Whether every byte of t's storage is the sentinel."""
    b = swap.storage_as_bytes(t)
    return b.numel() > 0 and bool((b == SENTINEL).all())


def _merge(into: dict, other: dict) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


@dataclass
class Stats:
    copies: int = 0            # side-stream copies queued
    deferred: int = 0          # ... that had not run when the next engine call began
    poisoned: dict = field(default_factory=dict)   # why -> copies that gave the sentinel

    def poison(self, why: str) -> None:
        self.poisoned[why] = self.poisoned.get(why, 0) + 1


class _Op:
    """One queued operation of a side stream: a copy, or a wait on another stream's queue."""
    __slots__ = ("stream", "index", "clock", "run", "why")

    def __init__(self, stream, index, clock, run):
        self.stream, self.index, self.clock, self.run, self.why = stream, index, clock, run, None


class FakeStream:
    """A side stream: a queue run in order, only as far as something needs it."""

    def __init__(self, dev: "EmulatedDevice", name: str):
        self.dev, self.name = dev, name
        self.ops: list[_Op] = []
        self.ran = 0
        self.clock: dict = {}          # stream -> ops of it this stream's next op follows

    def __repr__(self):
        return f"FakeStream({self.name})"

    def enqueue(self, run) -> None:
        _merge(self.clock, self.dev.host_clock)   # (what the host saw finish is before)
        self.push(_Op(self, len(self.ops), dict(self.clock), run))

    def push(self, op: _Op) -> None:
        self.ops.append(op)
        self.clock[self] = len(self.ops)
        if self.dev.lag is not None:
            self.run_to(len(self.ops) - self.dev.lag)

    def wait_stream(self, other) -> None:
        if isinstance(other, FakeCompute):
            _merge(self.clock, other.clock)
            self.clock[other] = self.dev.tick
        else:
            _merge(self.clock, other.clock)
            upto = len(other.ops)
            self.enqueue(lambda op: other.run_to(upto))

    def wait_event(self, ev: "FakeEvent") -> None:
        if ev.stream is None:
            return
        _merge(self.clock, ev.clock)
        self.enqueue(lambda op: ev.run())

    def run_to(self, n: int) -> None:
        while self.ran < n:
            op = self.ops[self.ran]
            self.ran += 1
            op.run(op)
            self.dev.release_held()


class FakeCompute:
    """A compute stream: the CPU, which has already run what Python asked of it. There may be
    several (`EmulatedDevice.compute_stream`): all run on the CPU, so between them only the
    side streams' order to each is modelled (each its own clock)."""

    def __init__(self, dev: "EmulatedDevice", name: str = "compute"):
        self.dev, self.name = dev, name
        self.clock: dict = {}

    def __repr__(self):
        return f"FakeCompute({self.name})"

    def wait_event(self, ev: "FakeEvent") -> None:
        ev.run()
        _merge(self.clock, ev.clock)

    def wait_stream(self, other) -> None:
        other.run_to(len(other.ops))
        _merge(self.clock, other.clock)


class FakeEvent:
    """A point in a side stream's queue."""

    def __init__(self):
        self.stream, self.index, self.clock = None, 0, {}

    def record(self, stream) -> None:
        if isinstance(stream, FakeCompute):
            self.stream = None            # the compute stream is always done
            return
        self.stream, self.index, self.clock = stream, len(stream.ops), dict(stream.clock)

    def query(self) -> bool:
        """Whether the copies before it ran; if so, the host has seen them finish, and what
        any stream is asked to do from now on follows them."""
        if self.stream is None:
            return True
        if self.stream.ran < self.index:
            return False
        _merge(self.stream.dev.host_clock, self.clock)
        return True

    def run(self) -> None:
        """Run the copies before it (a stream's wait reached it: the host sees nothing)."""
        if self.stream is not None:
            self.stream.run_to(self.index)

    def synchronize(self) -> None:
        """The host waits for it: run the copies before it, and what any stream is asked to
        do from now on follows them."""
        if self.stream is not None:
            self.stream.run_to(self.index)
            _merge(self.stream.dev.host_clock, self.clock)


class EmulatedDevice:
    """The device calls `swap.StreamEngine` makes (`swap.CudaOps`'s), over CPU tensors."""
    pinned = False

    def __init__(self, lag: int | None = None):
        self.lag = lag
        self.tick = 0
        self.compute = FakeCompute(self)
        self.current = self.caller = self.compute
        self.host_clock: dict = {}       # what the host saw finish (an event's query or wait)
        self.d2h, self.h2d = FakeStream(self, "d2h"), FakeStream(self, "h2d")
        self.stats = Stats()
        self.held: list = []             # [stream, storage, queue length or None (this call)]
        self.hosts: dict = {}            # host buffer data_ptr -> [last write op, reads since]

    # -- what swap.CudaOps gives ------------------------------------------------------------
    def side_streams(self, device):
        return self.d2h, self.h2d

    def current_stream(self, device):
        return self.current

    @contextmanager
    def stream(self, s):
        prev, self.current = self.current, s
        try:
            yield
        finally:
            self.current = prev

    Event = FakeEvent

    def empty_device(self, shape, stride, dtype, device) -> torch.Tensor:
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        poison(t)
        return t

    def empty_host(self, shape, stride, dtype) -> torch.Tensor:
        t = torch.empty_strided(shape, stride, dtype=dtype, device="cpu")
        poison(t)
        self.hosts[t.untyped_storage().data_ptr()] = [None, []]
        return t

    def compute_stream(self, name: str) -> FakeCompute:
        """Another compute stream (enter it with `stream`, as torch.cuda.stream)."""
        return FakeCompute(self, name)

    def record_stream(self, t: torch.Tensor, s) -> None:
        if not isinstance(s, FakeCompute):
            self.held.append([s, t.untyped_storage(), None])

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        s = self.current
        if isinstance(s, FakeCompute):
            dst.copy_(src)
            return
        self.stats.copies += 1
        to_host = dst.untyped_storage().data_ptr() in self.hosts
        host, dev_t = (dst, src) if to_host else (src, dst)
        ref = weakref.ref(dev_t.untyped_storage())
        geometry = (dev_t.dtype, tuple(dev_t.shape), dev_t.stride(), dev_t.storage_offset())

        def run(op):
            dev_s = ref()
            why = op.why or (None if dev_s is not None else
                             "device source freed before its copy ran" if to_host else
                             "prefetch target freed before its copy ran")
            if why is not None:
                self.stats.poison(why)
                if to_host:
                    poison(host)
            elif to_host:
                host.copy_(_view(dev_s, geometry))
            else:
                _view(dev_s, geometry).copy_(host)
        _merge(s.clock, self.host_clock)       # (what the host saw finish is before)
        op = _Op(s, len(s.ops), dict(s.clock), run)
        if op.clock.get(self.caller, -1) < self.tick:
            op.why = ("copy not ordered after the compute stream's work "
                      + ("on its source" if to_host else "on its target's memory"))
        self._check_host(host, op, write=to_host)
        s.push(op)

    # -- the emulation's own ---------------------------------------------------------------
    def _check_host(self, host: torch.Tensor, op: _Op, write: bool) -> None:
        """Vector-clock race check of `op`'s access to host buffer `host`."""
        log = self.hosts[host.untyped_storage().data_ptr()]
        last, reads = log
        earlier = ([last] if last is not None else []) + (reads if write else [])
        for a in earlier:
            if a.stream is not op.stream and op.clock.get(a.stream, 0) <= a.index:
                why = "host buffer used by two copies not ordered one after the other"
                op.why = op.why or why
                a.why = a.why or why
        if write:
            log[0], log[1] = op, []
        else:
            reads.append(op)

    def begin_call(self) -> None:
        self.tick += 1
        self.caller = self.current
        self.stats.deferred += sum(len(s.ops) - s.ran for s in (self.d2h, self.h2d))

    def end_call(self) -> None:
        for h in self.held:
            if h[2] is None:
                h[2] = len(h[0].ops)
        self.release_held()

    def release_held(self) -> None:
        self.held = [h for h in self.held if h[2] is None or h[0].ran < h[2]]

    def synchronize(self) -> None:
        """Run every queued operation (torch.cuda.synchronize)."""
        for s in (self.d2h, self.h2d):
            s.run_to(len(s.ops))
        self.held = [h for h in self.held if h[2] is None]
        for s in (self.d2h, self.h2d):
            _merge(self.host_clock, s.clock)


def _view(storage, geometry) -> torch.Tensor:
    dtype, shape, stride, offset = geometry
    return torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride)


class EmulatedEngine:
    """`swap.StreamEngine` itself over an `EmulatedDevice`, each call a new moment of the
    emulated compute stream (the engine class is looked up when the device is made, so a
    changed `swap` module, as the mutation check makes, is the one that runs)."""

    def __init__(self, dev: EmulatedDevice):
        self.ops = dev
        self.engine = swap.StreamEngine(dev, swap.HostPool(alloc=dev.empty_host))
        self.pool = self.engine.pool

    def _call(self, name: str, *args):
        self.ops.begin_call()
        try:
            return getattr(self.engine, name)(*args)
        finally:
            self.ops.end_call()

    def offload(self, t, handle):
        return self._call("offload", t, handle)

    def prefetch(self, handle):
        return self._call("prefetch", handle)

    def wait_copy(self, handle):
        return self._call("wait_copy", handle)

    def give_back(self, handle):
        return self._call("give_back", handle)


def emulated_stats(dev: EmulatedDevice) -> dict:
    """What the emulator saw, as plain values: copies queued, copies still queued at each
    engine call (summed), copies that gave the sentinel and why."""
    return {"copies": dev.stats.copies, "deferred": dev.stats.deferred,
            "poisoned": dict(dev.stats.poisoned)}


#: set to "1" in a test's environment, the ranks that slackswap_testkit's pipeline_run.py and
#: tp_run.py spawn train their patched runs under the emulated device (`emulated_if_asked`)
ENV = "SLACKSWAP_EMULATED_DEVICE"


def emulated_if_asked():
    """`emulated_device()` where the environment asks for it (`ENV`), else a block that does
    nothing: for ranks in processes of their own."""
    import os
    from contextlib import nullcontext
    return emulated_device() if os.environ.get(ENV) == "1" else nullcontext()


@contextmanager
def emulated_device(lag: int | None = None):
    """Swaps of CPU tensors run `swap.StreamEngine` over an `EmulatedDevice` inside the block
    (the device is yielded; every queued copy runs at the end)."""
    dev = EmulatedDevice(lag)
    old = swap.set_engine("cpu", EmulatedEngine(dev))
    try:
        yield dev
    finally:
        dev.synchronize()
        swap.set_engine("cpu", old)
