"""The expert policy's own host time in a recorded run (``PolicyClock``): what a replay's host lane
adds to the profile's per-page and per-copy figures with ``replay(..., policy_host=True)``.

The profile's host figures were measured on a pager without the expert policy. The policy runs on
the host too, in Python: the victim search among the cached experts, the bookkeeping of every expert
paged and of each layer's announce (``ExpertStacks``), the routing guesses (``RoutingSpeculator``).
While a timeline records, their calls are timed by wall clock on the recording machine, each less
the time of what runs inside it that is charged elsewhere (the pager's own paging and copies, which
the profile's figures stand for, and the ops, which are records of their own) and less the clock's
own wrapping of it and of the timed calls inside it (``PolicyClock.calibrate``), and the time is
given to the next record (``take``).
"""

from __future__ import annotations

import functools
import gc
import threading
import time

from ..moe import speculation
from ..moe.speculation import RoutingSpeculator
from ..moe.stacks import ExpertStacks
from ..pager.pager import Pager

# The policy's entry points, every call from the pager, the router hooks or a step, by part. (The
# speculator's ``used``, which ``accessed`` calls for every expert paged, is a dict's setdefault, a
# call into C: its time is ``accessed``'s.)
POLICY = (
    (ExpertStacks, ("victim", "order"), "victim"),
    (ExpertStacks, ("accessed", "paging", "announce", "copied", "evicted", "step", "expect"), "bookkeeping"),
    (RoutingSpeculator, ("guess_first", "router_ran", "router_output", "issue_ready", "predictions_ready",
                         "expected_ready", "routing_known", "step"), "guesses"),
)
# Device work the policy issues, charged elsewhere: the look-ahead's kernels (on a GPU launches on
# the compute stream; where the host runs them, as on the emulated device, their run is no host
# work of a GPU's policy).
# The pager's own entry points, which the policy calls too (a guess's prefetch): the profile's page
# and copy figures stand for them.
DEVICE_WORK = ((speculation, ("lookahead_scores",)), (Pager, ("page", "upload", "copy_out", "prefetch")))


# (inside, outside): the clock's own cost per timed call, seconds (``PolicyClock.calibrate``), measured
# once per process.
_OVERHEADS: list = []


class PolicyClock:
    """Wall-clock host time of the expert policy not yet given to a record (``take``), and in all
    by part (``parts``, seconds; ``calls``), besides the excluded parts named and the garbage
    collector's pauses (``gc``), which are no policy time. One clock is installed at a time
    (``install``: the policy's methods wrapped on their classes)."""

    installed = None

    def __init__(self, by_method: bool = False):
        self.by_method = by_method  # parts named "<part>.<method>": a profile of the policy's entry points
        self.pending = 0.0  # seconds of policy time since the last take
        self.parts = {}  # part -> seconds of policy time since install
        self.calls = {}  # part -> its timed calls since install
        self._inner = []  # per open timed call: seconds of the timed calls inside it
        self._saved = []
        self.thread = threading.get_ident()  # whose calls are timed: the thread that records
        self._collecting = None  # start of the garbage collection under way
        # The clock's own cost per timed call, seconds, charged to no one: its wrapping inside the
        # call's span, and outside it, in the span of the timed call it runs inside (``calibrate``).
        if not _OVERHEADS:
            _OVERHEADS.extend(self.calibrate())
        self._inside, self._outside = _OVERHEADS

    def install(self) -> bool:
        """Wrap the policy's entry points; False (nothing done) where another clock is installed."""
        if PolicyClock.installed is not None:
            return False
        for cls, names, part in POLICY:
            for name in names:
                self._wrap(cls, (name,), f"{part}.{name}" if self.by_method else part)
        for owner, names in DEVICE_WORK:
            self.exclude(owner, names)
        gc.callbacks.append(self._collection)
        PolicyClock.installed = self
        return True

    def _collection(self, phase: str, info: dict) -> None:
        """Python's cyclic garbage collector ran (``gc.callbacks``): a pause that lands in whichever
        call allocates when a generation fills, the policy's or not. It is a part of its own (``gc``:
        every collection on the recording thread while installed, seconds and collections), and the
        timed call it ran inside is charged less it (which call pays is chance, not the call's cost)."""
        if threading.get_ident() != self.thread:
            return
        if phase == "start":
            self._collecting = time.perf_counter()
            return
        if self._collecting is None:
            return
        spent, self._collecting = time.perf_counter() - self._collecting, None
        self.parts["gc"] = self.parts.get("gc", 0.0) + spent
        self.calls["gc"] = self.calls.get("gc", 0) + 1
        if self._inner:
            self._inner[-1] += spent

    def exclude(self, cls, names, part=None) -> None:
        """Time these methods of ``cls`` (or functions of a module) as work charged elsewhere: not policy time
        (``pending``), though counted in ``parts`` as ``part`` where one is named."""
        self._wrap(cls, names, ("excluded", part))

    def _wrap(self, cls, names, part) -> None:
        for name in names:
            # A method this clock already times (the pager's entry points, excluded at install) is
            # timed once, as the part named last: wrapped twice, the inner timing would be taken
            # off the outer one, and a part named for it would read only the wrapper's own cost.
            fn = next((saved for owner, method, saved in self._saved if owner is cls and method == name), None)
            if fn is None:
                fn = cls.__dict__[name]
                self._saved.append((cls, name, fn))
            setattr(cls, name, self._timed(fn, part))

    def remove(self) -> None:
        for cls, name, fn in reversed(self._saved):
            setattr(cls, name, fn)
        self._saved = []
        if self._collection in gc.callbacks:
            gc.callbacks.remove(self._collection)
        if PolicyClock.installed is self:
            PolicyClock.installed = None

    def excluded(self, fn):
        """``fn`` timed as work charged elsewhere: the policy call it runs inside is charged less it."""
        return self._timed(fn, None)

    def take(self) -> float:
        """Milliseconds of policy time since the last take."""
        out, self.pending = self.pending, 0.0
        return out * 1e3

    def open(self) -> float:
        """A timed call starts (``close`` ends it): its start."""
        self._inner.append(0.0)
        return time.perf_counter()

    def close(self, t0: float, part=None) -> None:
        """The call opened at ``t0`` ends: for a ``part`` of the policy, its time less the timed
        calls inside it is the policy's; either way the call it ran inside is charged less all of it."""
        spent = time.perf_counter() - t0
        nested = self._inner.pop()
        own = max(spent - nested - self._inside, 0.0)  # less the timed calls inside and the clock's own wrapping
        if isinstance(part, tuple):  # excluded from the policy's time, kept apart as its part
            part = part[1]
        elif part is not None:
            self.pending += own
        if part is not None:
            self.parts[part] = self.parts.get(part, 0.0) + own
            self.calls[part] = self.calls.get(part, 0) + 1
        if self._inner:
            self._inner[-1] += spent + self._outside

    def calibrate(self, calls: int = 2000, repeats: int = 5) -> tuple:
        """(inside, outside): seconds of the clock's own wrapping of a timed call that fall inside
        the call's span and outside it (in the span of the timed call it runs inside), measured on
        ``calls`` timed calls of a no-op inside one timed call, less as many plain calls, the
        fastest of ``repeats`` runs. Uncorrected, a timed call is charged some 0.16 us of the
        clock's work and its caller 0.85 us more on this project's CPU machine, against 0.05 us
        for the plain call: 5-6 % of a decode step's measured policy time."""
        def noop():
            pass

        def plain():
            for _ in range(calls):
                noop()

        probe = PolicyClock.__new__(PolicyClock)  # (not installed: its own parts, no overheads)
        probe.pending, probe.parts, probe.calls, probe._inner = 0.0, {}, {}, []
        probe.thread, probe._inside, probe._outside = threading.get_ident(), 0.0, 0.0
        leaf = probe._timed(noop, "leaf")

        def loop():
            for _ in range(calls):
                leaf()

        outer = probe._timed(loop, "outer")
        inside = outside = float("inf")
        for _ in range(repeats):
            probe.parts = {}
            outer()
            t0 = time.perf_counter()
            plain()
            each = (time.perf_counter() - t0) / calls
            inside = min(inside, probe.parts["leaf"] / calls - each)
            outside = min(outside, probe.parts["outer"] / calls - each)
        return max(inside, 0.0), max(outside, 0.0)

    def _timed(self, fn, part):
        clock = self

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if threading.get_ident() != clock.thread:  # (the recording's thread only, as its ops)
                return fn(*args, **kwargs)
            t0 = clock.open()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.close(t0, part)
        return timed
