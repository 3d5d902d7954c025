"""Last-use marks: when the device is done with a cached copy, without an event per op.

An op that reads a cached copy gets a *mark* (``Mark``): the stream the op was enqueued on and that
stream's count of marked ops so far. Making one costs no CUDA call. Real events are recorded on the
stream (a) every ``RECORD_EVERY`` marks, and (b) when a consumer needs a mark that no event covers
yet: a range about to be reused, a slot going back to the allocator, a move within the arena, a
dying pager's wait.

The rule that makes this safe: an event recorded on a stream *after* a mark was made on it (its
sequence number >= the mark's) completes after the op the mark stands for, since a stream runs its
work in the order it was enqueued. A mark therefore resolves to the earliest event recorded on its
stream at or after it: with periodic recording that event is at most ``RECORD_EVERY - 1`` marked ops
later, so a copy waiting for the last reader of a range read long ago waits for about that reader,
not for everything the host has queued since (which would undo look-ahead). A mark no event covers
yet resolves to an event recorded now. ``done`` answers from events already recorded and never
records: "not known to be done" is the safe answer.

Streams are told apart by a key (the raw ``cudaStream_t``; two Python objects for one CUDA stream
share one key and so one order). Pure bookkeeping: recording and querying events are callables
given to ``Marks``, so this module runs with fakes and is tested without CUDA
(``tests/test_cuda_marks.py``).
"""

from __future__ import annotations

from bisect import bisect_left

# Periodic events: one per this many marked ops on a stream. The trade: each marked op pays
# 1/RECORD_EVERY of an event's record (an event + record cost the host several microseconds on the
# H200; a hit costs ~25 in all), and a reuse of a range waits for at most RECORD_EVERY - 1 marked ops
# after its last reader. Eight is about one transformer layer's linears (q, k, v, o, gate, up, down),
# while look-ahead prefetches one or more layers ahead, and a range evicted by LRU was read long
# before: the wait it adds is a few kernels. ``Marks(every=...)`` lets a benchmark try others.
RECORD_EVERY = 8
# Events kept per stream. Dropping the oldest is always safe: the marks it covered resolve to a
# later event, which completes later still (a wait a little longer than needed, never shorter).
KEEP_EVENTS = 64


class Mark:
    """The last use of a cached copy: the op enqueued on ``track``'s stream as its ``seq``-th marked
    op. One per op, shared by the copies the op read."""

    __slots__ = ("track", "seq")

    def __init__(self, track: "Track", seq: int):
        self.track = track
        self.seq = seq


class Joined:
    """The last uses of a cached copy that ops on more than one stream read: the latest mark of each
    stream (a mark on one stream says nothing about another's work). Rare: only where the caller
    switches streams between ops reading one copy. ``track`` None: never any stream's own."""

    __slots__ = ("marks",)
    track = None

    def __init__(self, marks: tuple):
        self.marks = marks


class Track:
    """One stream's marks: ``seq`` marks made so far; ``seqs``/``events`` the events recorded after
    mark ``seqs[i]`` (ascending), not yet known complete; ``recorded`` the last mark an event covers;
    ``done`` the last mark known complete."""

    __slots__ = ("key", "stream", "seq", "recorded", "done", "seqs", "events")

    def __init__(self, key, stream):
        self.key = key
        self.stream = stream
        self.seq = self.recorded = self.done = 0
        self.seqs: list = []
        self.events: list = []


class Marks:
    """The marks of one device. ``record(stream, event)`` records ``event`` (None: a new one) on
    ``stream`` now and returns it; ``query(event)`` answers whether it has completed.

    Events are held here only: whoever resolves a mark (``event``) uses the event at once (a stream
    waits for it, the host synchronizes) and keeps no reference, so an event known complete is
    recycled for the next record."""

    __slots__ = ("_record", "_query", "every", "keep", "tracks", "_free", "recorded")

    def __init__(self, record, query, every: int = RECORD_EVERY, keep: int = KEEP_EVENTS):
        if every < 1 or keep < 1:
            raise ValueError(f"offtensor: Marks needs every >= 1 and keep >= 1, got every={every}, keep={keep}")
        self._record = record
        self._query = query
        self.every = every
        self.keep = keep
        self.tracks: dict = {}  # stream key -> Track
        self._free: list = []  # events known complete, no longer covering a mark: recorded again next
        self.recorded = 0  # events recorded, for tests and benchmarks

    def track(self, key, stream) -> Track:
        """The track of the stream ``key`` (``stream``: its stream object, kept from the first call)."""
        track = self.tracks.get(key)
        if track is None:
            track = self.tracks[key] = Track(key, stream)
        return track

    def mark(self, track: Track) -> Mark:
        """A mark for the op just enqueued on ``track``'s stream; every ``every``-th one records an event."""
        seq = track.seq = track.seq + 1
        if seq - track.recorded >= self.every:
            self._record_now(track)
        return Mark(track, seq)

    def event(self, mark: Mark):
        """An event that completes after ``mark``'s op: the earliest recorded at or after it, else one
        recorded now. None if the mark is known complete. Use it at once; do not keep it."""
        track, seq = mark.track, mark.seq
        if seq <= track.done:
            return None
        if seq > track.recorded:
            return self._record_now(track)
        return track.events[bisect_left(track.seqs, seq)]

    def done(self, mark: Mark) -> bool:
        """Whether ``mark``'s op is known complete, from the events recorded so far (never records)."""
        track, seq = mark.track, mark.seq
        if seq <= track.done:
            return True
        if seq > track.recorded:
            return False
        i = bisect_left(track.seqs, seq)
        if not self._query(track.events[i]):
            return False
        self._complete(track, i)
        return True

    def synchronized(self, mark: Mark) -> None:
        """The host has waited for ``event(mark)``: what it covered is complete."""
        track = mark.track
        if track.recorded >= mark.seq > track.done:
            self._complete(track, bisect_left(track.seqs, mark.seq))

    def all_done(self) -> None:
        """The whole device has been synchronized: every mark made so far is complete."""
        for track in self.tracks.values():
            track.done = track.recorded = track.seq
            self._recycle(track.events)
            track.seqs, track.events = [], []

    def join(self, before, mark: Mark):
        """The last use of a copy whose last use was ``before`` (a mark or ``Joined`` of another
        stream than ``mark``'s) and that the op of ``mark`` read next: ``mark`` and whichever of
        ``before``'s marks on other streams are not known complete."""
        kept = [m for m in (before.marks if type(before) is Joined else (before,))
                if m.track is not mark.track and not self.done(m)]
        return Joined(tuple(kept) + (mark,)) if kept else mark

    def _record_now(self, track: Track):
        free = self._free
        event = self._record(track.stream, free.pop() if free else None)
        self.recorded += 1
        track.recorded = track.seq
        seqs, events = track.seqs, track.events
        seqs.append(track.seq)
        events.append(event)
        if len(events) > self.keep:  # the oldest goes; its marks resolve to the next event (later: safe)
            del seqs[0], events[0]
        return event

    def _complete(self, track: Track, i: int) -> None:
        """``track.events[i]`` has completed, and so every event before it on the same stream."""
        track.done = track.seqs[i]
        self._recycle(track.events[: i + 1])
        del track.seqs[: i + 1], track.events[: i + 1]

    def _recycle(self, events: list) -> None:
        room = self.keep - len(self._free)
        if room > 0:
            self._free.extend(events[:room])
