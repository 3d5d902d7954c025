"""Issuing and waiting for copies, per kind of device: the only place a GPU and the emulated device
differ.

A copy's completion token is a ``torch.cuda.Event`` on a GPU and a copy-engine ticket (an int) on
the emulated device; on a GPU the last use of a cached copy is a mark (``marks.py``), which
resolves to an event when something must wait for it. Everything else in the pager (waiting,
eviction, slot reuse, host lifetimes, accounting) only asks ``done``, ``block`` and
``order_after`` about tokens and calls the copy methods below, so the same code runs on both
kinds and what the CPU suite proves holds on the GPU.

- ``EmulatedDevice`` (``device="cpu"``): copies run on the extension's C++ worker thread
  (``_ext.CopyEngine``; ``_ext.StrictCopyEngine`` in strict mode: late, out of order, into
  poisoned buffers). Ops run when they are called, so "a stream waits" means the host waits.
- ``CudaDevice``: copies ahead of use on one dedicated copy stream per pager, copies an op waits for
  in line on the op's own stream, with events where work crosses streams.
- ``MetaDevice`` (``ot.plan``): meta tensors have no bytes, so every copy is done when issued.

One owner for copies on a side stream: this module. The loader (loading/read.py) stages resident
weights through ``load_copy`` / ``block`` here too, rather than through the extension's CUDA copy
engine: the pager needs events that compose with torch's streams and are legal during CUDA graph
capture, which torch's stream copies give, and the loader needs only "copy, then wait", a subset.
The extension's copy engine stays the emulated device's worker thread.

``pins_host_memory(device)`` is the one decision whether host masters and staging buffers for a
device are pinned.
"""

from __future__ import annotations

import os

import torch

from .. import _ext
from ..config import int_from_env
from .marks import RECORD_EVERY, Joined, Mark, Marks, Track

# The current stream's raw handle without building a Stream object (a C call returning an int);
# None where this torch has no such call (a CPU build, or a version without it): then the
# current stream is looked up through ``torch.cuda.current_stream``, as before.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def mark_every_from_env() -> int:
    """``OFFTENSOR_MARK_EVERY``, else ``marks.RECORD_EVERY`` (8): marked ops per periodic last-use
    event on a GPU. For measuring the trade: 1 records an event after every op that read a cached
    copy, as offtensor did before marks."""
    return int_from_env("OFFTENSOR_MARK_EVERY", RECORD_EVERY, 1, "ops")


def _record_event(stream, event=None):
    """``event`` (None: a new one) recorded on ``stream`` now: ``Marks``' one way to make events."""
    if event is None:
        event = torch.cuda.Event()
    event.record(stream)
    return event


def _query_event(event) -> bool:
    return event.query()

# On the emulated device, copies this small that the caller waits for are done inline.
SMALL_COPY_BYTES = 1 << 20


def pins_host_memory(device) -> bool:
    """Whether host memory that feeds ``device`` is pinned: on a GPU, so copies are asynchronous DMAs
    (a pageable source makes each one a blocking copy through a staging buffer); never on the
    emulated device, whose "device memory" is host memory already."""
    return torch.device(device).type == "cuda"


def strict_from_env() -> bool:
    """``OFFTENSOR_STRICT=1``: emulated-device pagers use the strict copy engine (late, out-of-order
    copies into poisoned buffers; see ``_ext.StrictCopyEngine``)."""
    return os.environ.get("OFFTENSOR_STRICT", "").strip().lower() not in ("", "0", "false", "no")


DEVICES_TO_USE = 'use "cuda" (a GPU), "cuda:N" or "cpu" (the emulated device)'


def resolve_device(device) -> torch.device:
    """``None`` -> the current CUDA device when there is one, else the emulated device (cpu)."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        if isinstance(device, str):
            # torch's own answer lists its twenty device types, of which offtensor takes two.
            raise ValueError(f"offtensor: device={device!r} is not a device; {DEVICES_TO_USE}") from None
        raise ValueError(f"offtensor: {device!r} is not a device: {e}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type != "cuda":
        raise ValueError(f"offtensor: device={str(device)!r} is not supported; {DEVICES_TO_USE}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = torch.cuda.current_device() if device.index is None and count else device.index or 0
    if index >= count:
        raise ValueError(
            f"offtensor: device {device} does not exist: this machine has {count} CUDA device(s). "
            f"Use device='cpu' for the emulated device."
        )
    return torch.device("cuda", index)


def device_total_bytes(device: torch.device) -> "int | None":
    """All the memory of ``device`` (a GPU's total, the emulated device's: the machine's RAM), or
    None where it is not known (meta)."""
    try:
        if device.type == "cuda":
            return torch.cuda.mem_get_info(device)[1]
        if device.type == "cpu":
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (RuntimeError, ValueError, OSError):
        return None
    return None


def free_device_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def for_device(device: torch.device, strict: bool) -> "EmulatedDevice":
    """The device operations for ``device``'s kind (``strict`` applies to the emulated device only)."""
    if device.type == "cuda":
        return CudaDevice(device)
    if device.type == "meta":
        return MetaDevice(device)
    return EmulatedDevice(device, strict)


def upload_small(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small CPU tensor on ``device`` without a host sync: a pinned staging copy and a
    non-blocking upload (torch's pinned allocator keeps the staging block until the copy is done)."""
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


_NOTHING_AFTER = (None, None)


class EmulatedDevice:
    """The emulated device: copies on the extension's worker thread, tokens are its tickets.

    Owned by one pager; its slot pool, arena and lifetime records hold this object, not the pager, so the
    pager's finalizer can run."""

    gpu = False
    # Whether ``after_op`` has anything to say: the pager's release, which runs after every op,
    # skips the call where it would return (None, None).
    tracks_last_use = False
    __slots__ = ("device", "strict", "engine", "copy_stream", "stream")

    def __init__(self, device: torch.device, strict: bool = False):
        self.device = device
        self.strict = strict
        self.engine = self._engine(strict)
        self.copy_stream = None  # GPU only: the stream copies ahead of use run on
        self.stream = None  # GPU only: the compute stream of the op being paged, looked up once per op

    @staticmethod
    def _engine(strict: bool):
        return _ext.StrictCopyEngine() if strict else _ext.CopyEngine()

    # ------------------------------------------------------------------ tokens

    def done(self, token) -> bool:
        return token is None or self.engine.query(token)

    def block(self, token) -> None:
        """The host waits for ``token``."""
        if token is not None:
            self.engine.wait(token)

    def order_after(self, token, stream=None) -> None:
        """Work enqueued next (on ``stream``, on a GPU) runs after ``token``; here ops run as they
        are called, so the host waits."""
        if token is not None:
            self.engine.wait(token)

    def settle(self, token) -> None:
        """A dying pager's wait for a cached copy's last use: tickets are settled by the lifetime
        records, which wait for every copy still reading a host source."""

    def drain(self) -> None:
        """Block until every copy submitted so far has run, tracked or not: the recount frees the
        ranges of copies a cut-short step lost track of (``pager/safety.py``), which a copy still
        to run must not write after another copy reused them."""
        if self.strict:
            _ext.StrictCopyEngine.drain()
            return
        # The worker copies in submission order: a copy submitted now is done after every earlier one.
        self.engine.wait(self.engine.submit(torch.empty(1, dtype=torch.uint8), torch.zeros(1, dtype=torch.uint8)))

    def block_stream(self, stream) -> None:
        raise AssertionError("the emulated device has no streams")  # only GPU records carry one

    def new_event(self, stream):
        raise AssertionError("the emulated device has no events")

    def op_stream(self):
        """The stream the op being paged runs on: none here."""
        return None

    def after_op(self, entries):
        """For ``release``: (the op's stream, forgotten for the next op; the token after which the
        op no longer reads ``entries``). Neither exists here: the op has run."""
        return _NOTHING_AFTER

    # ------------------------------------------------------------------ memory

    def allocate(self, nbytes: int) -> torch.Tensor:
        # Never an inference tensor, though the first copy may come under inference_mode: the arena
        # outlives it, and strict mode writes its poison into it in any mode.
        with torch.inference_mode(False):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def reuse_token(self, token, last_stream, stream):
        """What work on ``stream`` must wait for before reusing memory given back with ``token``
        (``last_stream``: its last use's stream, GPU only): the token itself here."""
        return token

    def before_free(self, token, last_stream) -> None:
        """Memory given back with ``token`` goes back to the allocator: the host waits for it first."""
        if token is not None:
            self.engine.wait(token)

    def release_cached(self) -> None:
        """An arena was let go: nothing to give back here (the CPU allocator frees it)."""

    def gather_rows(self, host: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """``host[rows]`` in host memory, ready to upload."""
        return host.index_select(0, rows)

    def memory_figures(self):
        """(max allocated, max reserved) bytes of the device's allocator; None here."""
        return None

    # ------------------------------------------------------------------ copies

    def copy_ahead(self, buf: torch.Tensor, src: torch.Tensor):
        """Start copying ``src`` into ``buf`` off the op's path (a cached page or a prefetch)."""
        return self.engine.submit(buf, src)

    def copy_in_line(self, buf: torch.Tensor, src: torch.Tensor, nbytes: int, lifetimes):
        """Copy ``src`` into ``buf`` for the op about to run; the ready token (None: complete)."""
        if nbytes < SMALL_COPY_BYTES and not self.strict:
            buf.copy_(src)  # handing a copy we wait for anyway to the worker thread costs more than it
            return None
        ready = self.engine.submit(buf, src)
        lifetimes.keep(src, ready)
        return ready

    def copy_out(self, buf: torch.Tensor, src: torch.Tensor, lifetimes) -> None:
        """Copy ``src`` into ``buf``, a device tensor the caller owns and reads next."""
        ticket = self.engine.submit(buf, src)
        lifetimes.keep(src, ticket)
        self.engine.wait(ticket)  # no streams here: the caller's next op reads buf
        lifetimes.collect()  # the source may be the last reference to its master

    def wait_ready(self, entry, lifetimes) -> None:
        """The op about to run reads ``entry``'s copy, whose ready token is set."""
        self.engine.wait(entry.ready)
        entry.ready = None
        if lifetimes:
            lifetimes.collect()  # a waited-for source need not outlive its op

    def transient_free_after(self, entry):
        """The token after which a transient copy's slot is free for reuse."""
        return entry.ready

    def load_copy(self, dst: torch.Tensor, src: torch.Tensor):
        """The loader's staged copy of ``src`` (host) into ``dst``, memory the caller allocated."""
        return self.engine.submit(dst, src)

    def copy_within(self, dst: torch.Tensor, src: torch.Tensor, after):
        """Copy device memory ``src`` into ``dst`` (a cached copy moving within the arena) once the
        tokens ``after`` have completed (here the host waits for them); the copy's token."""
        for token in after:
            if token is not None:
                self.engine.wait(token)
        return self.engine.submit(dst, src)

    # ------------------------------------------------------------------ CUDA graphs

    def capturing(self) -> bool:
        return False

    def check_capturable(self, host: torch.Tensor) -> None:
        """A captured graph copies straight from ``host``: refuse memory it cannot DMA from."""


class _NoCopies:
    """The meta device's copy engine: a meta tensor has no bytes, so a copy is done when submitted."""

    def submit(self, dst, src):
        return 0

    def query(self, ticket):
        return True

    def wait(self, ticket):
        return None


class MetaDevice(EmulatedDevice):
    """Planning on meta (``ot.plan``): the real pager on tensors without bytes."""

    __slots__ = ()

    def __init__(self, device: torch.device, strict: bool = False):
        super().__init__(device, False)

    @staticmethod
    def _engine(strict: bool):
        return _NoCopies()


class CudaDevice(EmulatedDevice):
    """A GPU: copy-ready tokens are ``torch.cuda.Event``s, last-use tokens are ``marks.Mark``s (an
    event recorded only every few ops or when a consumer needs one); copies ahead of use on the
    pager's copy stream.

    Host cost is the point of most of what follows: a cache hit runs ``op_stream``/``after_op`` on
    every op, so the current stream is looked up by its raw handle (one C call, an int) and the
    ``torch.cuda.Stream`` first seen for that handle is reused, rather than a new Stream object per
    lookup; and the op's last use is a mark, not an event."""

    gpu = True
    tracks_last_use = True
    __slots__ = ("index", "marks", "_op_track")

    def __init__(self, device: torch.device, strict: bool = False):
        self.device = device
        self.index = device.index if device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" else 0)
        self.strict = False
        self.engine = None
        self.copy_stream = torch.cuda.Stream(device=device)
        self.stream = None
        self.marks = Marks(_record_event, _query_event, every=mark_every_from_env())
        self._op_track = None  # the op being paged: its stream's track, looked up once per op

    # ------------------------------------------------------------------ streams

    def _current(self) -> Track:
        """The track of this device's current stream (a ``torch.cuda.stream(s)`` the caller entered
        included: the lookup is of the current stream, every time)."""
        # One handle, one stream: torch's pool streams live as long as the process, and an external
        # stream's object is its handle. (A stream destroyed and another made at its address would
        # share its track: a caller who does that while copies it read are cached gets ordering
        # after the new stream's work instead.)
        raw = _raw_stream
        if raw is not None:
            track = self.marks.tracks.get(raw(self.index))
            if track is not None:
                return track
        stream = torch.cuda.current_stream(self.device)
        return self.marks.track(stream.cuda_stream, stream)

    def op_stream(self):
        track = self._op_track
        if track is None:
            track = self._op_track = self._current()
        return track.stream

    def after_op(self, entries):
        """(the op's stream, a mark for the op when it read a cached copy: that copy's last use,
        which eviction orders after). Transient copies need none: their slots are reused in the
        op stream's order (``reuse_token``) and their host sources are released in batches
        (``HostLifetimes``)."""
        track, self._op_track = self._op_track, None
        if track is None:
            track = self._current()
        for entry in entries:
            if entry.key is not None:
                return track.stream, self.marks.mark(track)
        return track.stream, None

    def _copy_on(self, stream, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst.copy_(src)`` enqueued on ``stream``. What ``with torch.cuda.stream(stream)`` does,
        without its context object and its Stream lookups, where that is the same thing: the
        current device is this pager's (``set_stream`` would also switch the device) and the
        caller's stream comes from the track cache."""
        if _raw_stream is None or _current_device() != self.index:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            return
        caller = self._current().stream
        try:
            torch.cuda.set_stream(stream)
            dst.copy_(src, non_blocking=True)
        finally:
            torch.cuda.set_stream(caller)

    # ------------------------------------------------------------------ tokens

    def _event(self, token):
        """The event behind ``token``, an event or a mark (``Marks.event``); None if complete."""
        if type(token) is Mark:
            return self.marks.event(token)
        return token

    def done(self, token) -> bool:
        if token is None:
            return True
        if type(token) is Mark:
            return self.marks.done(token)  # never records: "not known done" is the safe answer
        if type(token) is Joined:
            return all(self.marks.done(mark) for mark in token.marks)
        return token.query()

    def block(self, token) -> None:
        if type(token) is Joined:
            for mark in token.marks:
                self.block(mark)
            return
        event = self._event(token) if token is not None else None
        if event is not None:
            event.synchronize()
            if type(token) is Mark:
                self.marks.synchronized(token)

    def order_after(self, token, stream=None) -> None:
        if token is None:
            return
        stream = stream or self.op_stream()
        if type(token) is Joined:
            for mark in token.marks:
                self.order_after(mark, stream)
            return
        if type(token) is Mark:
            mine = token.track.stream
            if stream is mine or stream == mine:
                return  # the reader ran on this very stream: its order is enough, no event
            token = self.marks.event(token)
            if token is None:
                return
        stream.wait_event(token)

    def settle(self, token) -> None:
        self.block(token)

    def drain(self) -> None:
        torch.cuda.synchronize(self.device)  # the copy stream's copies and every op queued
        self.marks.all_done()

    def block_stream(self, stream) -> None:
        stream.synchronize()  # a transient copy without an event of its own: its stream

    def new_event(self, stream):
        event = torch.cuda.Event()
        event.record(stream)
        return event

    # ------------------------------------------------------------------ memory

    def allocate(self, nbytes: int) -> torch.Tensor:
        # From the copy stream's pool of the caching allocator (an arena, once; an overflow slot):
        # never a pool that a graph capture on the compute stream owns. Reuse of the arena's ranges
        # is ordered by the pager's own events, not by the allocator.
        with torch.cuda.stream(self.copy_stream), torch.inference_mode(False):
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def reuse_token(self, token, last_stream, stream):
        """Memory last used by transient copies on a compute stream has no event: on that same
        stream, order is enough; another stream gets an event recorded now, after everything
        enqueued there, the last use included. So events are made only where memory crosses
        streams, not per op. A mark is returned as it is: ``order_after`` resolves it."""
        if token is None and last_stream is not None and last_stream != stream:
            token = self.new_event(last_stream)
        return token

    def before_free(self, token, last_stream) -> None:
        """The allocator may hand the block to the next copy-stream allocation at once: that stream
        waits for its last use first."""
        self.order_after(self.reuse_token(token, last_stream, self.copy_stream), self.copy_stream)

    def release_cached(self) -> None:
        """An arena was let go (a resize, ``clear``): its block goes back to the driver rather than
        staying reserved in the allocator's cache for the copy stream, where neither resident
        weights nor an arena of another size could use it. Rare: the arena is re-made only when the
        room changes."""
        torch.cuda.empty_cache()

    def gather_rows(self, host: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        # Gathered straight into pinned memory, so the upload is an asynchronous DMA (a pageable
        # source would make it a blocking copy); the pager keeps the buffer until the copy is done.
        gathered = torch.empty((rows.numel(),) + tuple(host.shape[1:]), dtype=host.dtype, pin_memory=True)
        torch.index_select(host, 0, rows, out=gathered)
        return gathered

    def memory_figures(self):
        # The whole device's, since the caching allocator does not tell one pager's blocks from
        # anyone else's.
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)

    # ------------------------------------------------------------------ copies

    def copy_ahead(self, buf: torch.Tensor, src: torch.Tensor):
        # A new event per copy, not one from a pool: a copy's ready event is shared by its cache
        # entry, its host lifetime record and, once evicted unread, a free range of the arena, so
        # none of them knows when the others let go; an event recorded again while one still held
        # it would make that holder wait for a later copy.
        stream = self.copy_stream
        self._copy_on(stream, buf, src)
        ready = torch.cuda.Event()
        ready.record(stream)
        return ready

    def copy_in_line(self, buf: torch.Tensor, src: torch.Tensor, nbytes: int, lifetimes):
        buf.copy_(src, non_blocking=True)  # on the compute stream, before the op that reads it
        lifetimes.keep(src, None, self.op_stream())
        return None

    def copy_out(self, buf: torch.Tensor, src: torch.Tensor, lifetimes) -> None:
        stream = self._current().stream
        buf.copy_(src, non_blocking=True)
        lifetimes.keep(src, self.new_event(stream))

    def wait_ready(self, entry, lifetimes) -> None:
        if entry.ready.query():
            entry.ready = None  # completed: later hits skip the wait
        else:
            self.op_stream().wait_event(entry.ready)

    def transient_free_after(self, entry):
        return None  # ordered by the op's stream (give's last_stream)

    def copy_within(self, dst: torch.Tensor, src: torch.Tensor, after):
        """On the copy stream, after the tokens ``after`` (the copy that filled ``src``, the mark
        of its last reader): a device-to-device copy at memory bandwidth, far cheaper than paging
        the weights again from the host."""
        stream = self.copy_stream
        for token in after:
            self.order_after(token, stream)
        self._copy_on(stream, dst, src)
        moved = torch.cuda.Event()
        moved.record(stream)
        return moved

    def load_copy(self, dst: torch.Tensor, src: torch.Tensor):
        # The copy stream first waits for the work queued on the caller's stream (the last reader
        # of a block the allocator handed ``dst``), as the extension's engine did.
        self.copy_stream.wait_stream(self._current().stream)
        return self.copy_ahead(dst, src)

    # ------------------------------------------------------------------ CUDA graphs

    def capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def check_capturable(self, host: torch.Tensor) -> None:
        if not host.is_pinned():
            raise RuntimeError(
                f"offtensor: cannot capture a CUDA graph that pages a {tuple(host.shape)} {host.dtype} weight from "
                f"pageable host memory; offload it with the default (pinned) allocation"
            )
