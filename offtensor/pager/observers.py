"""Who the pager tells what it does: one ordered list of observers instead of a check per call site.

Three roles, told in this order: ``experts`` (``moe.ExpertStacks``: per-stack counters and the
routed-expert eviction), ``prefetcher`` (``prefetch.Prefetcher``: the access order and copies
ahead), ``recorder`` (``timeline.Recorder``: copies, uses and frees of a recorded run). Each role
keeps its own method names; ``Observers`` turns them into per-event tuples of callables, rebuilt
when a role changes, so a pager without observers pays one empty loop per event.

Events (the pager's call sites):

- ``paging(master_id)``: a cached page of ``master_id`` is about to be looked up;
- ``accessed(pager, master, key, entry, hit)``: an op holds ``entry`` for ``key`` (found, maybe as
  a larger copy containing it, or just copied);
- ``reading(entry)``: the op about to run reads this copy (cached or transient);
- ``copied(pager, entry, nbytes, stream, prefetch)``: a copy was issued on ``stream``
  ("copy": ahead of use; "compute": in line);
- ``released(entries)``: the op that read these copies has been enqueued;
- ``evicted(entry)`` / ``freed(entry)``: a cached copy was evicted / dropped;
- ``new_step()``: a forward of the wrapped model begins (the prefetcher is told first).

Besides the events, ``quiet`` is the recorder's ``quietly`` (or None): the pager runs the work that
issues its own ATen ops (a copy, an allocation, a wait for a copy) through it, so the recording
takes them for the pager's copies, not for ops of the model. Only those paths read it: a cache hit
on a completed copy does not.
"""

from __future__ import annotations

ROLES = ("experts", "prefetcher", "recorder")
# A new step closes the prefetcher's pass before the expert cache decays its frequencies and
# issues its guesses, as the pager always did.
_STEP_ORDER = ("prefetcher", "experts", "recorder")


def _experts_events(stacks) -> dict:
    def accessed(pager, master, key, entry, hit):
        stacks.accessed(entry.key, hit)

    def copied(pager, entry, nbytes, stream, prefetch):
        if entry.key is not None:
            stacks.copied(entry.key, nbytes, prefetch)

    def evicted(entry):
        stacks.evicted(entry.key)

    return {"paging": stacks.paging, "accessed": accessed, "copied": copied, "evicted": evicted,
            "new_step": stacks.step}


def _prefetcher_events(prefetcher) -> dict:
    def accessed(pager, master, key, entry, hit):
        prefetcher.accessed(pager, master, key)

    events = {"accessed": accessed}
    step = getattr(prefetcher, "step", None)  # a test's stand-in may have none
    if step is not None:
        events["new_step"] = step
    return events


def _recorder_events(recorder) -> dict:
    return {"reading": recorder.used, "copied": recorder.copied, "released": recorder.released,
            "freed": recorder.freed}


_EVENTS_OF = {"experts": _experts_events, "prefetcher": _prefetcher_events, "recorder": _recorder_events}


class Observers:
    """The observers of one pager, by role, and per event the callables to run in role order."""

    __slots__ = ("_by_role", "quiet", "paging", "accessed", "reading", "copied", "released", "evicted", "freed",
                 "new_step")

    def __init__(self):
        self._by_role = {}
        self._rebuild()

    def get(self, role: str):
        return self._by_role.get(role)

    def set(self, role: str, observer) -> None:
        """Make ``observer`` the one of ``role`` (None removes it)."""
        if role not in _EVENTS_OF:
            raise ValueError(f"offtensor: a pager has no observer role {role!r}; roles: {ROLES}")
        if observer is None:
            self._by_role.pop(role, None)
        else:
            self._by_role[role] = observer
        self._rebuild()

    def _rebuild(self) -> None:
        calls = {event: [] for event in self.__slots__[2:]}
        steps = {}
        for role in ROLES:
            observer = self._by_role.get(role)
            if observer is not None:
                for event, call in _EVENTS_OF[role](observer).items():
                    if event == "new_step":
                        steps[role] = call
                    else:
                        calls[event].append(call)
        calls["new_step"] = [steps[role] for role in _STEP_ORDER if role in steps]
        for event, found in calls.items():
            setattr(self, event, tuple(found))
        recorder = self._by_role.get("recorder")
        self.quiet = recorder.quietly if recorder is not None else None


def _quietly(quiet, fn, *args):
    """``fn(*args)``, through the recorder's ``quietly`` while a timeline records (``Observers.quiet``):
    called on the paths that copy, allocate or wait, never on a hit on a completed copy."""
    return fn(*args) if quiet is None else quiet(fn, *args)
