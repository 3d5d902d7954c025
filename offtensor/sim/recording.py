"""``ot.timeline``: the ``with`` block that records a run. It installs a ``Recorder`` on the
thread's dispatch mode stack, as every pager's ``recorder`` and, for an MoE model, a ``PolicyClock``,
and takes them all away again, also after a Ctrl-C at any point of its enter or exit."""

from __future__ import annotations

import inspect
import sys
import threading
from typing import Optional

import torch
from torch import nn
from torch.utils import _python_dispatch

from ..model.state import pager_of
from .policy_clock import PolicyClock
from .recorder import Recorder, pop_to
from .timeline import Timeline

ATTEMPTS = 4  # undoes that raise before ``__exit__`` gives up and raises the first error
_open = threading.local()  # .recordings: this thread's recordings entered and not yet undone


def _recordings() -> list:
    recordings = getattr(_open, "recordings", None)
    if recordings is None:
        recordings = _open.recordings = []
    return recordings


class timeline:
    """``with ot.timeline(model) as tl: model(x)``: record every op and copy of the runs inside.
    Each forward of ``model`` is one step. ``measure=True`` on a GPU also keeps CUDA-event times of
    the ops (``Record.measured_ms``), to put beside the prediction.

    ``model=None`` records whatever runs inside (a step function, say); then ``pagers`` names the
    pagers whose copies to record and the caller marks steps with ``tl.next_step()``.

    A class bound to the frame that entered it. ``__enter__`` either installs everything or, cut
    short anywhere, takes back what it installed; ``__exit__`` takes everything back, again where
    an interrupt cut that short (every step can run twice). Python can still raise at the very
    entry of ``__exit__``, before any of its code: then the recording holds until the frame that
    entered it has ended and the thread next runs a forward of ``model`` (the recording's own
    forward pre-hook) or enters another ``ot.timeline``, which take it all back first. A recording
    entered in a generator or coroutine, whose frame may be suspended rather than ended, is left
    to its exit."""

    def __init__(self, model: Optional[nn.Module] = None, profile=None, measure: bool = False, pagers=None):
        self.model = model
        self.tl = Timeline(profile)
        self.recorder = Recorder(self.tl, measure)
        self._pagers = list(pagers) if pagers is not None else None
        self._started = False
        self._hook = self._new_step  # the one object registered, found again by identity
        self._frame = self._thread = self._clock = self._flags = None
        self._depth = 0  # the dispatch mode stack's depth before the push

    def __enter__(self) -> Timeline:
        settle()
        self._frame, self._thread = sys._getframe(1), threading.get_ident()
        try:
            _recordings().append(self)
            if self._pagers is None:
                self._pagers = _pagers_of(self.model) if self.model is not None else []
            if any(getattr(p, "experts", None) is not None for p in self._pagers):
                self._clock = clock = PolicyClock()  # (recorded first: the undo removes what install did)
                if clock.install():
                    self.recorder.clock = clock
            for pager in self._pagers:
                pager.recorder = self.recorder
                _rebind_observers(pager)  # their bound methods of the policy: the timed ones
            if self.model is not None:
                self.model.register_forward_pre_hook(self._hook)
            self._push()
            return self.tl  # (no point between this return and the block where Python raises)
        except BaseException:
            self._undo()
            raise

    def __exit__(self, *exc) -> bool:
        # Every step inside the ``try``: one that an interrupt cuts short runs again (each can).
        pending, attempts = None, 0
        while True:
            try:
                if attempts < ATTEMPTS:
                    self._undo()
                break
            except BaseException as error:
                pending = error if pending is None else pending
                attempts += 1
        if pending is not None:
            try:
                raise pending
            finally:
                pending = None  # no cycle through this frame
        self.recorder.finish()
        return False

    def _new_step(self, module, args) -> None:
        if self.ended():
            self._undo()  # a Ctrl-C skipped this recording's exit: this forward is not recorded
            return
        if self._started:
            self.tl.next_step()
        self._started = True

    def _push(self) -> None:
        """The recorder onto this thread's dispatch mode stack, with the flags torch's mode ``__enter__``
        sets (read back by ``_undo``)."""
        flags = (_python_dispatch._is_in_torch_dispatch_mode, _python_dispatch._is_in_non_infra_torch_dispatch_mode,
                 _python_dispatch._is_in_any_mode_without_ignore_compile_internals)
        self._depth, self._flags = torch._C._len_torch_dispatch_stack(), flags
        _python_dispatch._is_in_torch_dispatch_mode = True
        _python_dispatch._is_in_non_infra_torch_dispatch_mode = True
        _python_dispatch._is_in_any_mode_without_ignore_compile_internals = True
        _python_dispatch.set_is_in_mode_without_ignore_compile_internals(True)
        torch._C._push_on_torch_dispatch_stack(self.recorder)

    def _undo(self) -> None:
        """Take back whatever was installed, in any state an interrupt left it: the mode, the flags, the
        hook, the clock, the pagers' recorder. Every step can run again."""
        _remove_mode(self.recorder)
        flags = self._flags
        if flags is not None and torch._C._len_torch_dispatch_stack() <= self._depth:
            _python_dispatch._is_in_torch_dispatch_mode = flags[0]
            _python_dispatch._is_in_non_infra_torch_dispatch_mode = flags[1]
            _python_dispatch._is_in_any_mode_without_ignore_compile_internals = flags[2]
            _python_dispatch.set_is_in_mode_without_ignore_compile_internals(flags[2])
        if self.model is not None:
            hooks = self.model._forward_pre_hooks
            for key in [k for k, hook in hooks.items() if hook is self._hook]:
                hooks.pop(key, None)
        if self._clock is not None:
            self._clock.remove()
            self.recorder.clock = None
        for pager in self._pagers or ():
            if pager.recorder is self.recorder or pager.observers.get("recorder") is self.recorder:
                pager.recorder = None
                _rebind_observers(pager)
        recordings = _recordings()
        if self in recordings:
            recordings.remove(self)
        self._frame = None

    def ended(self) -> bool:
        """Whether the frame that entered this recording has ended without its exit (an interrupt
        at the exit's entry): asked in the recording thread only."""
        frame = self._frame
        if frame is None or self._thread != threading.get_ident() or frame.f_code.co_flags & _SUSPENDABLE:
            return False
        f = sys._getframe(1)
        while f is not None:
            if f is frame:
                return False
            f = f.f_back
        return True


def settle() -> None:
    """Take back this thread's recordings whose frames ended without their exit."""
    for recording in list(_recordings()):
        if recording.ended():
            recording._undo()


def _remove_mode(mode) -> None:
    """Every push of ``mode`` off this thread's dispatch mode stack, the modes above it kept in order
    (a mode entered after the recording and still open when it is taken back late: rare, and not
    itself proof against a second interrupt)."""
    pop_to(mode, 0)
    n = torch._C._len_torch_dispatch_stack()
    for i in range(n - 1, -1, -1):
        if torch._C._get_dispatch_stack_at(i) is not mode:
            continue
        # A mode entered after this one and still on the stack: taken off, this one dropped, put back.
        above = [torch._C._get_dispatch_stack_at(j) for j in range(i + 1, n)]
        for _ in above:
            torch._C._pop_torch_dispatch_stack(None)
        torch._C._pop_torch_dispatch_stack(None)
        for m in above:
            torch._C._push_on_torch_dispatch_stack(m)
        return _remove_mode(mode)
    return None


# A generator's or coroutine's frame leaves the stack at each ``yield`` or ``await`` and comes back.
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE


def _pagers_of(model: nn.Module):
    pagers = []
    wrapped = pager_of(model)
    if wrapped is not None:
        pagers.append(wrapped)
    for t in list(model.parameters()) + list(model.buffers()):
        master = getattr(t, "_master", None)
        pager = master.pager if master is not None else None
        if pager is not None and all(pager is not p for p in pagers):
            pagers.append(pager)
    return pagers


def _rebind_observers(pager) -> None:
    """The pager's observer calls made again from the expert policy's current methods (bound
    methods are taken when the observers are set: a clock's wrappers come and go with a recording)."""
    observers = getattr(pager, "observers", None)
    if observers is not None and observers.get("experts") is not None:
        observers.set("experts", observers.get("experts"))
