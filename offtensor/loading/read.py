"""Reading the checked pieces into their destinations: a new host master (offloaded) or device
buffer (resident) per storage group, filled by a pool of threads.

An offloaded weight goes from the file into its exact-size host master in one pass (``os.preadv``
into the master's memory, which is allocated without a first touch: the read is what faults each
page in, once), and a resident weight goes from the file to the device through a reused staging
buffer, the copy of one chunk overlapping the read of the next. Several threads read at once;
``preadv`` releases the GIL.
"""

from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Optional

import torch

from .. import _ext
from .. import placement
from ..pager import Pager, format_bytes, master_for, pins_host_memory
from ..pager.device import for_device
from ..model.groups import StorageGroup
from ..tensor import OffloadedTensor
from ..safetensors_files import CheckpointError, FileTensor, identity, open_unchanged, pread_into
from .names import Piece

# One read or one staged copy moves at most this much, so threads share big tensors and the
# staging buffers stay small.
CHUNK_BYTES = 32 << 20
STAGING_SLOTS = 2
# Loads at least this large show a progress bar when OffloadConfig.progress is None (the default).
PROGRESS_MIN_BYTES = 256 << 20


# ---------------------------------------------------------------------------- progress


def _off_this_thread(call):
    """``call()``, run on a short-lived thread and waited for. tqdm takes its class-wide lock (one for every bar) inside a bar's creation and
    close, in two steps: a ``KeyboardInterrupt`` landing on this thread between them left the lock
    held, and the next load's readers blocked on it for good, updating their bar. On another
    thread the call always finishes and releases the lock; an interrupt lands in the wait, and
    goes on once the call is done."""
    box = []

    def target():
        try:
            box.append((True, call()))
        except BaseException as e:  # raised again on the caller's thread
            box.append((False, e))

    thread = threading.Thread(target=target, name="offtensor-progress", daemon=True)
    thread.start()
    try:
        thread.join()
    except BaseException:
        thread.join()  # the call finishes either way; a second interrupt here only stops the wait
        raise
    done, value = box.pop()  # an exception's traceback holds ``box``: emptied, no cycle
    if not done:
        raise value
    return value


class Progress:
    """Bytes read so far, shown with tqdm when the load is large enough (thread-safe)."""

    def __init__(self, total: int, enabled: Optional[bool], what: str):
        """``enabled``: True, False, or None for loads of ``PROGRESS_MIN_BYTES`` or more."""
        self.total, self.start = total, time.perf_counter()
        if enabled is None:
            enabled = total >= PROGRESS_MIN_BYTES
        self.enabled = enabled
        self.bar = None
        self.lock = threading.Lock()
        if enabled:
            from .._optional import optional_import

            tqdm_auto = optional_import("tqdm.auto", "progress bars")
            if tqdm_auto is None:
                return  # a one-line summary is printed at the end instead
            tqdm = tqdm_auto.tqdm
            # unit_scale with base 1000 turns B/s into MB/s and GB/s, the units the README uses.
            made = []
            try:
                self.bar = _off_this_thread(lambda: made.append(tqdm(
                    total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=what, leave=False,
                    dynamic_ncols=True)) or made[0])
            except BaseException:  # interrupted once the bar was made: it too goes through close, elsewhere
                if made:
                    _off_this_thread(made.pop().close)
                raise

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            with self.lock:
                self.bar.update(nbytes)

    def close(self, ok: bool) -> None:
        if self.bar is not None:
            _off_this_thread(self.bar.close)
        if self.enabled and ok:
            seconds = max(time.perf_counter() - self.start, 1e-9)
            print(f"offtensor: loaded {format_bytes(self.total)} in {seconds:.2f} s "
                  f"({self.total / seconds / 1e9:.2f} GB/s)", file=sys.stderr)


# ---------------------------------------------------------------------------- reading


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view of the same memory."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _stages_resident(device: torch.device) -> bool:
    """Whether resident weights go through the staging buffers. On the emulated device the device's
    memory is host memory, so a read lands in it directly; tests force staging there to run the GPU
    path's pipeline (same slots, same copy engine, same waits)."""
    return device.type != "cpu"


class Reader:
    """Reads pieces into their destinations with a pool of threads. Offloaded destinations (CPU,
    contiguous) are read into directly; device destinations go through ``STAGING_SLOTS`` reused
    (pinned on a GPU) staging buffers, each chunk's copy overlapping the next chunk's read."""

    def __init__(self, device: torch.device, threads: int, progress: Progress):
        self.device, self.threads, self.progress = device, threads, progress
        self.staged = _stages_resident(device)
        self.fds: dict = {}
        self.identities: dict = {}  # file -> its identity when its header was read
        self.jobs: list = []
        # Staged copies go through the pager's device layer, the one owner of copies on a side stream
        # (pager/device.py says why): a copy, then a wait before the staging buffer is reused.
        self.copies = for_device(device, strict=False)
        self.slots: Optional[queue.Queue] = None
        self.submit_lock = threading.Lock()
        self.pin_lock = threading.Lock()
        self.pending_pins: dict = {}  # id(raw) -> [chunks left, raw]
        self.stopped = False  # the load failed or was interrupted: queued jobs do nothing
        self.pool = None  # the worker pool while it may have workers: shut down before files close

    def fd(self, source: FileTensor) -> int:
        if source.file not in self.fds:  # still a regular file (never a FIFO), and the one checked
            self.identities[source.file] = source.identity
            self.fds[source.file] = open_unchanged(source)
        return self.fds[source.file]

    def check_unchanged(self) -> None:
        """Every file read is as its header found it: a file rewritten in place while its bytes were
        read (its modification time moved) may have given some weights old bytes and some new."""
        for file, fd in self.fds.items():
            if self.identities[file] is not None and identity(fd) != self.identities[file]:
                raise CheckpointError(f"offtensor: {file!r} changed while it was read (it was rewritten while "
                                      f"loading): the weights read from it may mix old and new bytes; nothing "
                                      f"was loaded; load it again once it is complete")

    def add(self, piece: Piece, dest: torch.Tensor, offloaded: bool, pin_after: Optional[torch.Tensor] = None) -> None:
        """Schedule ``piece`` into ``dest``, its region of a host master (``offloaded``) or of a
        device tensor. ``pin_after``: the master's allocation, pinned once all its pieces are in."""
        s, what = piece.source, piece.describe
        self.fd(s)  # opened here, on one thread, so the jobs only look it up
        if not dest.is_contiguous() or dest.dtype != s.dtype:
            self._expect(pin_after, 1)
            self.jobs.append(lambda: self._read_converted(s, dest, what, pin_after))
        elif not offloaded and self.staged:
            self._add_staged(s, _as_bytes(dest), what)
        else:
            target = _as_bytes(dest)
            chunks = range(0, s.nbytes, CHUNK_BYTES)
            self._expect(pin_after, len(chunks))
            for lo in chunks:
                hi = min(lo + CHUNK_BYTES, s.nbytes)
                self.jobs.append(self._direct_job(s, target[lo:hi], lo, what, pin_after))

    def _expect(self, raw: Optional[torch.Tensor], jobs: int) -> None:
        if raw is not None:
            self.pending_pins.setdefault(id(raw), [0, raw])[0] += jobs

    def _direct_job(self, s, target, lo, what, pin_after):
        def job():
            pread_into(self.fd(s), s.begin + lo, target, what)
            self.progress.update(target.numel())
            if pin_after is not None:
                self._chunk_done(pin_after)
        return job

    def _chunk_done(self, raw: torch.Tensor) -> None:
        with self.pin_lock:
            entry = self.pending_pins[id(raw)]
            entry[0] -= 1
            last = entry[0] == 0
        if last:
            _ext.pin_host(raw)  # filled: registering now only locks the pages, it does not fault them

    def _add_staged(self, s: FileTensor, target: torch.Tensor, what) -> None:
        if self.slots is None:
            self.slots = queue.Queue()
            pin = pins_host_memory(self.device)
            for _ in range(STAGING_SLOTS):
                self.slots.put((_ext.alloc_host(CHUNK_BYTES, pin=pin), None))
        for lo in range(0, s.nbytes, CHUNK_BYTES):
            hi = min(lo + CHUNK_BYTES, s.nbytes)
            self.jobs.append(self._staged_job(s, target[lo:hi], lo, what))

    def _staged_job(self, s, target, lo, what):
        def job():
            buf, ticket = self.slots.get()
            try:
                if ticket is not None:
                    self.copies.block(ticket)  # the slot's previous copy has left it
                    ticket = None
                chunk = buf[: target.numel()]
                pread_into(self.fd(s), s.begin + lo, chunk, what)
                with self.submit_lock:
                    ticket = self.copies.load_copy(target, chunk)
            finally:
                self.slots.put((buf, ticket))
            self.progress.update(target.numel())
        return job

    def _read_converted(self, s: FileTensor, dest: torch.Tensor, what, pin_after) -> None:
        """A destination that is strided, of another dtype, or not on the CPU: read into a temporary
        of the file's layout, then one ``copy_`` converts and places it."""
        raw = _ext.alloc_host(s.nbytes, pin=False, touch=False)
        for lo in range(0, s.nbytes, CHUNK_BYTES):
            hi = min(lo + CHUNK_BYTES, s.nbytes)
            pread_into(self.fd(s), s.begin + lo, raw[lo:hi], what)
            self.progress.update(hi - lo)
        values = raw.view(s.dtype).view(s.shape) if s.nbytes else torch.empty(s.shape, dtype=s.dtype)
        with torch.no_grad():
            dest.copy_(values)
        if pin_after is not None:
            self._chunk_done(pin_after)

    def run(self) -> None:
        try:
            if self.threads <= 1 or len(self.jobs) <= 1:
                for job in self.jobs:
                    job()
            else:
                self._run_pool()
            self.drain()
            self.check_unchanged()
        except RuntimeError as error:
            raise _interrupt_behind(error)
        finally:
            self.discard()

    def _run_pool(self) -> None:
        """The jobs on ``threads`` threads. However the wait ends (a failed job, an interrupt of
        this thread), the jobs not started yet are cancelled and those running are waited for
        before this returns, even through a second interrupt: the files they read are closed and
        their destinations freed after this, never under a running read."""
        pool = self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix=f"offtensor-load-{next(_POOLS)}")
        try:
            futures = [pool.submit(self._job, job) for job in self.jobs]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in done if f.exception() is not None), None)
            if failed is not None:
                raise failed.exception()
        finally:
            self.stop_workers()

    def stop_workers(self) -> None:
        """Queued jobs do nothing and running ones are waited for. Run where the pool's wait ends
        and again by ``discard``: an interrupt landing before the first call's shutdown began (in
        a ``finally``, before its ``try``) cannot leave workers reading files that are then closed."""
        self.stopped = True  # a job that a worker has not started yet does nothing
        pool = self.pool
        if pool is not None:
            _shut_down(pool)
            self.pool = None

    def _job(self, job) -> None:
        if not self.stopped:
            job()

    def discard(self) -> None:
        """Close the files and drop the jobs. Each job's closure holds this reader and a view of its
        destination (a cycle): dropped here, a failed load frees the memory it allocated at once
        rather than at the next garbage collection. A descriptor leaves the table before it is
        closed: an interrupt in between leaks it, a second ``discard`` never closes it twice (in a
        threaded program that would close another file's descriptor)."""
        self.stop_workers()
        fds = self.fds
        while fds:
            fd = fds.popitem()[1]
            os.close(fd)
        self.identities.clear()
        self.jobs.clear()
        self.pending_pins.clear()

    def drain(self) -> None:
        """Waits for every staged copy, so the staging buffers and the device tensors are settled."""
        if self.slots is None:
            return
        held = [self.slots.get() for _ in range(STAGING_SLOTS)]
        for buf, ticket in held:
            if ticket is not None:
                self.copies.block(ticket)
        for buf, _ in held:
            self.slots.put((buf, None))



_POOLS = itertools.count()  # each load's pool names its threads apart from another load's


def _join_started(thread: threading.Thread, patience: float = 5.0) -> None:
    """Join a worker whose ``start`` may have been cut short before the new thread said it runs
    (``join`` then refuses): wait for it to say so first."""
    deadline = time.monotonic() + patience
    while True:
        try:
            thread.join()
            return
        except RuntimeError:  # "cannot join thread before it is started": it is about to be
            if time.monotonic() > deadline:
                return
            time.sleep(0.001)


def _interrupt_behind(error: RuntimeError) -> BaseException:
    """The Ctrl-C behind a "release unlocked lock". ``threading.Condition.wait`` (under a worker's
    ``start``, a future's wait, a queue's ``get``) releases its lock a few bytecodes before its
    ``try``: an interrupt landing there leaves the caller's ``with`` releasing a lock it no longer
    holds, and the KeyboardInterrupt surfaces only as that error's context. The user pressed
    Ctrl-C, so that is what the load raises; any other error is raised as it is."""
    interrupt = error.__context__
    if isinstance(interrupt, KeyboardInterrupt) and "unlocked lock" in str(error):
        interrupt.__suppress_context__ = True
        return interrupt
    return error


def _shut_down(pool: ThreadPoolExecutor) -> None:
    """``pool.shutdown`` cancelling what has not started and waiting for what has, finished even
    if this thread is interrupted meanwhile (the interrupt is raised after). A worker whose
    ``start`` an interrupt cut short is running but not among the pool's threads, which
    ``shutdown`` joins: it is found by the pool's thread names and joined too (it leaves on the
    shutdown's sentinel, having found every job cancelled or stopped)."""
    pending = None
    while True:
        try:
            pool.shutdown(wait=True, cancel_futures=True)
            prefix = pool._thread_name_prefix + "_"
            for thread in threading.enumerate():
                if thread.name.startswith(prefix) and thread is not threading.current_thread():
                    _join_started(thread)
            break
        except BaseException as error:  # a second Ctrl-C: the workers still have to stop
            pending = error if pending is None else pending
    if pending is not None:
        try:
            raise pending
        finally:
            pending = None  # not a cycle through this frame: what it holds goes with the traceback


def read(groups, chosen: dict, placed: placement.ModelPlacement, pager: Pager, reader: "Reader") -> dict:
    """Read every chosen piece into a new destination; id(member) -> its destination tensor, for
    every member of the groups read (aliases read under another name included)."""
    device = pager.device
    pin_late = pins_host_memory(device) and _ext.can_pin_after_fill()
    targets = {}
    try:
        _schedule(groups, chosen, placed, pager, reader, pin_late, targets)
        with torch.no_grad():
            reader.run()
    except BaseException:
        reader.discard()  # a failed allocation or read: the files opened and the jobs scheduled go,
        targets.clear()  # and what was allocated is freed now, not when the traceback is
        raise
    return targets


def _schedule(groups, chosen: dict, placed: placement.ModelPlacement, pager: Pager, reader: "Reader",
              pin_late: bool, targets: dict) -> None:
    """``read``'s first half: allocate each group's destinations into ``targets`` and schedule
    its pieces on ``reader``."""
    device = pager.device
    for group in groups:
        if not any(id(m) in chosen for m in group):
            continue
        is_offloaded = placed.offloads(group)
        dests, raw = _destinations(group, pager if is_offloaded else None, device, pin_late)
        targets.update(dests)  # every alias of the storage, read under its name or not
        for member in group:
            if id(member) not in chosen:
                continue  # an alias whose values arrive through another member's name
            dest = dests[id(member)]
            host = dest._host if isinstance(dest, OffloadedTensor) else dest
            for piece in chosen[id(member)][1]:
                reader.add(piece, piece.region(host), is_offloaded, raw if is_offloaded and pin_late else None)


def _destinations(group: StorageGroup, pager: Optional[Pager], device: torch.device, pin_late: bool):
    """(id(member) -> the tensor its values are loaded into, the raw host allocation or None):
    views of one new host master (offloaded) or of one device buffer (resident), laid out like the
    group's storage so aliases stay aliases. A master's memory is not touched before the read."""
    first = group[0].tensor
    dense = len(group) == 1
    if dense:
        numel = first.numel()
        layouts = {id(first): (tuple(first.shape), None, 0)}  # the file's values are contiguous
    else:
        lo, hi = group.element_range()
        numel = hi - lo
        layouts = {id(m.tensor): (tuple(m.tensor.shape), m.tensor.stride(), m.tensor.storage_offset() - lo)
                   for m in group}
    raw = None
    if pager is not None:
        pin_now = pins_host_memory(pager.device) and not pin_late
        raw = _ext.alloc_host(numel * first.element_size(), pin=pin_now, touch=False)
        flat = raw.view(first.dtype) if numel else torch.empty(0, dtype=first.dtype)
    elif device.type == "cpu":
        # The emulated device's memory: allocated like a master, so the read is its first touch too.
        raw_resident = _ext.alloc_host(numel * first.element_size(), pin=False, touch=False)
        flat = raw_resident.view(first.dtype) if numel else torch.empty(0, dtype=first.dtype)
    else:
        flat = torch.empty(numel, dtype=first.dtype, device=device)
    out = {}
    master = master_for(flat, pager) if pager is not None else None
    if master is not None:
        master.name = next((n for m in group for n in m.names), None)
    for member in group:
        shape, stride, offset = layouts[id(member.tensor)]
        view = flat.view(shape) if stride is None else flat.as_strided(shape, stride, offset)
        out[id(member)] = OffloadedTensor(view, master) if master is not None else view
    return out, raw
