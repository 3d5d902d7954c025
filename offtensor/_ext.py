"""The native extension, offtensor._C, behind a Python API that works with or without it.

The extension provides exact-size page-aligned (pinned) host memory and an asynchronous copy
engine; its ops live in ``torch.ops.offtensor`` and their fake kernels are registered here. When it
cannot be loaded, or ``OFFTENSOR_NO_NATIVE=1`` is set, one warning says so and the same functions
run on plain PyTorch, only slower. The rest of offtensor uses only the names below:

- ``NATIVE``, ``CUDA_COMPILED``, ``cuda_device_count()``, ``native_function(name)`` (a plain function of
  the extension's module, or None)
- ``alloc_host(nbytes, pin=..., touch=...)``, ``pin_host(tensor)`` and ``live_host_bytes()``
- ``CopyEngine``: ``submit``, ``query``, ``wait``, ``stream_wait``. The pager's device layer
  (``pager/device.py``) uses it as the emulated device's worker thread; copies on a GPU side stream,
  the pager's and the loader's, are that layer's own (torch streams and events), so its CUDA path
  serves only the extension's tests and tools
- ``StrictCopyEngine`` (same interface): the strict emulated device, ``strict_failures()``
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib
import os
import random
import threading
import time
import warnings
import weakref

import torch

from . import forking

__all__ = ["NATIVE", "CUDA_COMPILED", "cuda_device_count", "native_function", "alloc_host", "pin_host",
           "live_host_bytes", "CopyEngine", "StrictCopyEngine", "strict_failures"]

_BUILD_HINT = "pip install --no-build-isolation -e ."


def _load_native() -> str | None:
    """Loads the extension; returns why it is unavailable, or None when it loaded."""
    if os.environ.get("OFFTENSOR_NO_NATIVE", "").strip().lower() not in ("", "0", "false", "no"):
        return "OFFTENSOR_NO_NATIVE is set"
    name = f"{__package__}._C"
    try:
        importlib.import_module(name)  # registers torch.ops.offtensor
    except ModuleNotFoundError as error:
        if error.name != name:
            raise
        return "offtensor._C is not built for this Python"
    except (ImportError, OSError) as error:  # e.g. built against another torch
        return f"importing offtensor._C failed: {error}"
    return None


_why_not_native = _load_native()
NATIVE: bool = _why_not_native is None
if not NATIVE:
    warnings.warn(
        f"offtensor: the native extension is missing ({_why_not_native}). To use it, build it in the offtensor "
        f"checkout with `{_BUILD_HINT}` (against the torch already installed) and leave OFFTENSOR_NO_NATIVE "
        "unset. Until then slower pure-PyTorch paths are used: host memory comes from torch (pinned blocks rounded up "
        "to a power of two) and copies on the emulated device are synchronous.",
        RuntimeWarning,
        stacklevel=2,
    )

CUDA_COMPILED: bool = NATIVE and torch.ops.offtensor.cuda_compiled()


def native_function(name: str):
    """The extension module's plain function ``name`` (not an op: one the interpreter's loops call
    directly), or None without the extension or in one built before it."""
    return getattr(importlib.import_module(f"{__package__}._C"), name, None) if NATIVE else None


def cuda_device_count() -> int:
    """GPUs the extension can use; torch's count when the extension has no CUDA part. Never raises:
    a machine without a driver has 0."""
    if CUDA_COMPILED:
        return torch.ops.offtensor.cuda_device_count()
    return torch.cuda.device_count()


if NATIVE:

    @torch.library.register_fake("offtensor::alloc_host")
    def _alloc_host_fake(nbytes, pin, touch=True):
        return torch.empty(nbytes, dtype=torch.uint8, device="cpu")

    @torch.library.register_fake("offtensor::pin_host")
    def _pin_host_fake(host):
        return False

    @torch.library.register_fake("offtensor::copy_async")
    def _copy_async_fake(dst, src, ticket, wait_stream):
        return None

    # Join the copy worker while Python can still release the tensors it holds.
    atexit.register(torch.ops.offtensor.copy_shutdown)


# ------------------------------------------------------------------------------------------------
# Host memory
# ------------------------------------------------------------------------------------------------

_fallback_live_bytes = 0
_fallback_lock = threading.Lock()
_warned_unpinnable = False
_warned_register_failed = False


def _fallback_freed(nbytes: int) -> None:
    global _fallback_live_bytes
    with _fallback_lock:
        _fallback_live_bytes -= nbytes


def alloc_host(nbytes: int, *, pin: bool, touch: bool = True) -> torch.Tensor:
    """A 1-D uint8 CPU tensor of exactly ``nbytes`` bytes, page-aligned, pinned when ``pin`` and a
    GPU is present. Natively the memory is an mmap rounded only to the OS page (allocators that
    round to powers of two can double what large weights cost) and is returned to the OS when the
    last tensor or view using it dies. ``touch=False`` skips faulting the pages in up front (and the
    huge-page advice, whose first faults on fresh memory can stall on compaction), for a caller that
    writes every byte next (a file read): each page is then faulted once, by that write."""
    global _warned_unpinnable, _warned_register_failed, _fallback_live_bytes
    if nbytes < 0:
        raise ValueError(f"offtensor: cannot allocate {nbytes} bytes of host memory")
    wants_torch_pinning = pin and not CUDA_COMPILED and torch.cuda.is_available()
    if NATIVE and not wants_torch_pinning:
        if pin:
            _torch_sees_pinning()
        try:
            return torch.ops.offtensor.alloc_host(nbytes, pin, touch)
        except RuntimeError as error:
            # cudaHostRegister can fail (a locked-memory limit, a container without the right
            # capabilities) where torch's own pinned allocator, cudaHostAlloc, still works.
            if not (pin and "cudaHostRegister" in str(error) and torch.cuda.is_available()):
                raise
            if not _warned_register_failed:
                _warned_register_failed = True
                warnings.warn(
                    f"offtensor: pinning {nbytes} bytes of host memory with cudaHostRegister failed ({error}); "
                    "host masters now come from torch's pinned allocator, which rounds each block up to a power "
                    "of two. Check `ulimit -l` to get exact-size pinned memory back.",
                    RuntimeWarning,
                    stacklevel=2,
                )
    elif NATIVE:
        if not _warned_unpinnable:
            _warned_unpinnable = True
            warnings.warn(
                "offtensor: the native extension was built without CUDA, so pinned host memory comes from torch, "
                "which rounds each block up to a power of two. Rebuild with nvcc available "
                f"(`{_BUILD_HINT}`) for exact-size pinned memory.",
                RuntimeWarning,
                stacklevel=2,
            )
    tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
    with _fallback_lock:
        _fallback_live_bytes += nbytes
    # The storage's Python object lives exactly as long as the storage, views included.
    weakref.finalize(tensor.untyped_storage(), _fallback_freed, nbytes)
    return tensor


def can_pin_after_fill() -> bool:
    """Whether ``pin_host`` can pin an ``alloc_host(pin=False)`` allocation in place on this machine."""
    return CUDA_COMPILED and cuda_device_count() > 0


def pin_host(host: torch.Tensor) -> bool:
    """Pins the whole ``alloc_host(..., pin=False)`` allocation behind ``host`` in place, typically
    once it has been filled (registering filled pages only locks them). Returns whether it is pinned:
    False without a GPU, or when the extension cannot register memory (``can_pin_after_fill``)."""
    if not can_pin_after_fill():
        return False
    base = host.untyped_storage().data_ptr()
    if host.device.type != "cpu" or base % _PAGE_BYTES:
        # Refused here, before the extension: its refusal names the same things.
        raise RuntimeError(
            f"offtensor.pin_host: the storage of {host.untyped_storage().nbytes()} bytes at {base:#x} on {host.device} "
            "is not a page-aligned host allocation, so it is not an alloc_host allocation")
    _torch_sees_pinning()
    return torch.ops.offtensor.pin_host(host)


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _torch_sees_pinning() -> None:
    """Initialises torch's CUDA state before the extension pins memory. torch answers
    ``Tensor.is_pinned()`` with False until it has initialised CUDA itself, whatever the driver
    says, and torch's pinned-memory checks (a copy during CUDA graph capture, ``non_blocking``
    copies) read that answer. Pinning with torch's own allocator initialises CUDA the same way."""
    if cuda_device_count() > 0:
        torch.cuda.init()


def live_host_bytes() -> int:
    """Bytes (as requested, not rounded) of all ``alloc_host`` allocations that are still alive."""
    native = torch.ops.offtensor.live_host_bytes() if NATIVE else 0
    return native + _fallback_live_bytes


# ------------------------------------------------------------------------------------------------
# Copies
# ------------------------------------------------------------------------------------------------

# One ticket sequence for the whole process, so tickets from every path and engine compare.
_ticket_lock = threading.Lock()
_last_ticket = 0
# Copies that torch runs because the extension cannot: ticket -> _TorchCopy.
_torch_copies: dict[int, "_TorchCopy"] = {}
_side_streams: dict[torch.device, "torch.cuda.Stream"] = {}


def _next_ticket() -> int:
    global _last_ticket
    with _ticket_lock:
        _last_ticket += 1
        return _last_ticket


class _TorchCopy:
    """An in-flight ``copy_`` on a side stream; holds both tensors until the copy is done."""

    __slots__ = ("done", "dst", "src")

    def __init__(self, done: "torch.cuda.Event", dst: torch.Tensor, src: torch.Tensor):
        self.done, self.dst, self.src = done, dst, src


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _check_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The checks the native op makes, for the paths that do not reach it."""
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError(f"offtensor.copy_async: dst and src must be contiguous, got dst {tuple(dst.shape)} with "
                         f"strides {dst.stride()} and src {tuple(src.shape)} with strides {src.stride()}")
    if dst.nbytes != src.nbytes:
        raise ValueError(f"offtensor.copy_async: dst holds {dst.nbytes} bytes but src holds {src.nbytes} bytes")
    if dst.device == src.device and dst.nbytes > 0:
        d, s, n = dst.data_ptr(), src.data_ptr(), dst.nbytes
        if d < s + n and s < d + n:
            raise ValueError(f"offtensor.copy_async: dst and src overlap ({n} bytes at {d:#x} and {s:#x})")


class CopyEngine:
    """Asynchronous copies of a tensor's bytes into another tensor, identified by tickets.

    ``submit`` returns at once with a ticket (increasing across the whole process); ``query`` says
    whether that copy is done, ``wait`` blocks until it is and raises any error it hit. Until then
    the engine keeps both tensors alive, and neither may be read or written.

    - CPU tensors (the emulated device): natively a C++ worker thread copies while Python runs on;
      without the extension the copy happens inside ``submit``.
    - A CUDA tensor: natively a dedicated copy stream, which first waits for the work already on
      the current stream; ``stream_wait`` then orders a compute stream after the copy. Without the
      extension's CUDA part, ``copy_(non_blocking=True)`` on a side stream does the same.

    Engines are cheap: all share one process-wide worker and ticket sequence.
    """

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        """Enqueues copying ``src``'s bytes into ``dst`` (both contiguous, same nbytes)."""
        ticket = _next_ticket()
        gpu = dst.device if dst.is_cuda else src.device if src.is_cuda else None
        if NATIVE and (gpu is None or _native_gpu_copies()):
            stream = torch.cuda.current_stream(gpu).cuda_stream if gpu is not None else 0
            torch.ops.offtensor.copy_async(dst, src, ticket, stream)
            return ticket
        _check_copy(dst, src)
        if gpu is None:
            _as_bytes(dst).copy_(_as_bytes(src))  # finished before the ticket is handed out
        else:
            _torch_copy(ticket, gpu, dst, src)
        return ticket

    def query(self, ticket: int) -> bool:
        """Whether the copy for ``ticket`` has finished; raises if it failed."""
        _check_ticket(ticket)
        pending = _torch_copies.get(ticket)
        if pending is not None:
            if not pending.done.query():
                return False
            _torch_copies.pop(ticket, None)
            return True
        return torch.ops.offtensor.copy_query(ticket) if NATIVE else True

    def wait(self, ticket: int) -> None:
        """Blocks until the copy for ``ticket`` has finished; raises if it failed."""
        _check_ticket(ticket)
        pending = _torch_copies.get(ticket)
        if pending is not None:
            pending.done.synchronize()
            _torch_copies.pop(ticket, None)
        elif NATIVE:
            torch.ops.offtensor.copy_wait(ticket)

    def stream_wait(self, ticket: int, stream: int) -> None:
        """Makes the CUDA stream with handle ``stream`` (``torch.cuda.current_stream().cuda_stream``)
        wait for the copy without blocking the host. For copies on the emulated device, waits."""
        _check_ticket(ticket)
        pending = _torch_copies.get(ticket)
        if pending is not None:
            torch.cuda.ExternalStream(stream).wait_event(pending.done)
        elif NATIVE:
            torch.ops.offtensor.copy_stream_wait(ticket, stream)


_gpu_copies_native: bool | None = None


def _native_gpu_copies() -> bool:
    # Asked only once a GPU tensor shows up: asking the driver at import would initialise CUDA early.
    global _gpu_copies_native
    if _gpu_copies_native is None:
        _gpu_copies_native = CUDA_COMPILED and cuda_device_count() > 0
    return _gpu_copies_native


def _check_ticket(ticket: int) -> None:
    if not 0 < ticket <= _last_ticket:
        raise ValueError(f"offtensor: ticket {ticket} was never returned by CopyEngine.submit "
                         f"(tickets issued so far: 1..{_last_ticket})")


def _torch_copy(ticket: int, device: torch.device, dst: torch.Tensor, src: torch.Tensor) -> None:
    # Drop finished copies oldest first, so callers that never query do not grow the table.
    for old, copy in list(_torch_copies.items()):
        if not copy.done.query():
            break
        _torch_copies.pop(old, None)
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # e.g. the last reader of dst's old bytes
    with torch.cuda.stream(stream):
        _as_bytes(dst).copy_(_as_bytes(src), non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
    _torch_copies[ticket] = _TorchCopy(done, dst, src)


# ------------------------------------------------------------------------------------------------
# The strict emulated device
# ------------------------------------------------------------------------------------------------

# Messages of copies whose host source died before they ran, in this process (strict engine only).
_strict_failures: list[str] = []


def strict_failures() -> list[str]:
    """What the strict engine caught so far: copies whose host source was freed before they ran."""
    return list(_strict_failures)


class _StrictJob:
    __slots__ = ("ticket", "dst", "source", "byte_offset", "nbytes", "error", "done")

    def __init__(self, ticket, dst, source, byte_offset, nbytes):
        self.ticket, self.dst, self.source = ticket, dst, source
        self.byte_offset, self.nbytes = byte_offset, nbytes
        self.error = None
        self.done = False


class _StrictWorker:
    """One process-wide thread that runs strict copies late and out of order."""

    def __init__(self):
        # Sections take the lock itself (``with worker.lock``), not the Condition: a Condition's
        # __enter__/__exit__ are Python calls, where a Ctrl-C could strike after the lock is taken
        # and leave it held; the C lock's own ``with`` cannot be cut between acquire and release.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.queue: "collections.deque[_StrictJob]" = collections.deque()
        self.jobs: dict[int, _StrictJob] = {}
        self.held = 0  # > 0 while a test holds every copy back (StrictCopyEngine.held)
        self.urgent: set[int] = set()  # tickets someone waits for: they run even while held
        self.delay_s = float(os.environ.get("OFFTENSOR_STRICT_DELAY_MS", "0.2")) / 1e3
        self.thread = None

    def start(self):
        if self.thread is None or not self.thread.is_alive():
            self.thread = threading.Thread(target=self.run, name="offtensor-strict-copies", daemon=True)
            self.thread.start()

    def after_fork_in_child(self):
        """The worker thread does not exist in a forked child: a new condition and thread, and
        every copy not finished at the fork queued again, in ticket order (a copy overwrites its
        whole destination, so running one again is right). The condition is made over the
        worker's own lock, renewed: sections take ``self.lock`` and notify ``self.cond``, so a
        condition over a lock of its own refused every notify ("un-acquired lock")."""
        forking.renew_lock(self.lock)
        self.cond = threading.Condition(self.lock)
        self.thread = None
        self.urgent = set()
        self.queue = collections.deque(sorted((j for j in self.jobs.values() if not j.done), key=lambda j: j.ticket))
        if self.queue:
            self.start()

    def run(self):
        rng = random.Random(0x0FF7E)
        while True:
            with self.lock:
                while True:
                    if self.held:
                        job = next((j for j in self.queue if j.ticket in self.urgent), None)
                    elif self.queue:
                        # Out of order: any of the oldest few queued copies may go first.
                        job = self.queue[rng.randrange(min(len(self.queue), 4))]
                    else:
                        job = None
                    if job is not None:
                        break
                    self.cond.wait()
                self.queue.remove(job)
            time.sleep(rng.uniform(0, self.delay_s))  # late: the caller has long moved on
            storage = job.source()
            if storage is None:
                job.error = (f"offtensor strict device: the host source of copy {job.ticket} ({job.nbytes} bytes) was "
                             "freed before the copy ran; on a GPU the DMA would have read freed (unregistered, "
                             "unmapped) memory. Keep the source alive until the copy's event or ticket completes.")
                _strict_failures.append(job.error)
            else:
                src = torch.empty(0, dtype=torch.uint8).set_(storage, job.byte_offset, (job.nbytes,))
                _as_bytes(job.dst).copy_(src)
                del src, storage
            with self.lock:
                job.done = True
                job.dst = None
                self.urgent.discard(job.ticket)
                if job.error is None:
                    self.jobs.pop(job.ticket, None)  # a ticket no longer listed reads as done
                self.cond.notify_all()


_strict_worker = _StrictWorker()


def _renew_after_fork() -> None:
    """A forked child (``offtensor.forking``): the process-wide locks free, the strict worker
    renewed. The native worker renews itself (``pthread_atfork`` in csrc/copy_engine.h)."""
    for lock in (_fallback_lock, _ticket_lock):
        forking.renew_lock(lock)
    _strict_worker.after_fork_in_child()


forking.at_fork_in_child(_renew_after_fork)


class StrictCopyEngine:
    """The emulated device's strict mode (``OFFTENSOR_STRICT=1``): ``CopyEngine``'s interface, but
    each copy runs late (a random delay of up to ``OFFTENSOR_STRICT_DELAY_MS``, default 0.2 ms),
    out of order, on a Python thread, into a destination poisoned (all bytes 0xFF: NaN, -1) when
    the copy is submitted. Unlike the native engine it holds only a weak reference to the source's
    storage, as a DMA engine holds nothing: a copy whose source was freed before it ran fails
    (``wait`` and ``query`` raise, ``strict_failures()`` lists it) instead of passing because the
    engine kept the memory alive. A missing wait reads poison; a premature free is reported.
    """

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> int:
        _check_copy(dst, src)
        if dst.is_cuda or src.is_cuda:
            raise ValueError("offtensor: StrictCopyEngine emulates a device with CPU tensors; got a CUDA tensor")
        ticket = _next_ticket()
        _as_bytes(dst).fill_(0xFF)
        storage = src.untyped_storage()
        job = _StrictJob(ticket, dst, weakref.ref(storage), src.storage_offset() * src.element_size(), src.nbytes)
        worker = _strict_worker
        with worker.lock:
            worker.jobs[ticket] = job
            worker.queue.append(job)
            worker.start()
            worker.cond.notify_all()
        return ticket

    def _finish(self, job: _StrictJob) -> bool:
        if not job.done:
            return False
        _strict_worker.jobs.pop(job.ticket, None)
        if job.error is not None:
            raise RuntimeError(job.error)
        return True

    def query(self, ticket: int) -> bool:
        _check_ticket(ticket)
        job = _strict_worker.jobs.get(ticket)
        return True if job is None else self._finish(job)

    def wait(self, ticket: int) -> None:
        _check_ticket(ticket)
        worker = _strict_worker
        job = worker.jobs.get(ticket)
        if job is None:
            return
        with worker.lock:
            if not job.done:
                worker.urgent.add(ticket)
                worker.cond.notify_all()
                while not job.done:
                    worker.cond.wait()
        self._finish(job)

    def stream_wait(self, ticket: int, stream: int) -> None:
        self.wait(ticket)

    @staticmethod
    @contextlib.contextmanager
    def held():
        """Tests: no copy runs until the block ends, except one that someone waits for."""
        worker = _strict_worker
        with worker.lock:
            worker.held += 1
        try:
            yield
        finally:
            with worker.lock:
                worker.held -= 1
                worker.cond.notify_all()

    @staticmethod
    def drain() -> None:
        """Block until every strict copy submitted so far has run."""
        worker = _strict_worker
        with worker.lock:
            for job in list(worker.jobs.values()):
                worker.urgent.add(job.ticket)
            worker.cond.notify_all()
            while any(not j.done for j in worker.jobs.values()):
                worker.cond.wait()
