"""torch's global module registration hooks, acting only for a thread inside a block and only while
the frame that entered that block runs: how from_pretrained builds parameters on meta, and counts
what a build registers, without changing ``nn.Module`` or any other thread's builds."""

from __future__ import annotations

import sys
import threading

from torch.nn.modules import module as module_mod

from .. import forking

# What each kind of hook is registered with (torch's public functions).
_REGISTER = {"parameter": module_mod.register_module_parameter_registration_hook,
             "module": module_mod.register_module_module_registration_hook}


class ScopedHooks:
    """``with hooks(state):`` makes this thread's registrations (``acts``: "parameter" or "module" ->
    act) call ``act(state, module, name, value)``; one returning a value replaces the registered
    one, as torch's hooks do. The hooks are registered only while some thread is inside a block;
    concurrent blocks each see their own state."""

    def __init__(self, **acts):
        self.acts = acts
        self.lock = threading.Lock()
        self.blocks = {}  # thread id -> [(the frame that entered a block there, its state)], innermost last
        self.hook = None  # torch's handles, while some thread is inside a block
        forking.track(self)  # a forked child renews the lock (after_fork_in_child)

    def after_fork_in_child(self) -> None:
        """A forked child has the forking thread only: the lock is free unless that thread held it
        (another thread inside ``enter`` or ``leave`` at the fork held it for good), and the blocks of
        threads gone are dropped. Hooks registered for them act for no thread and go at the end of
        the child's next block."""
        forking.renew_lock(self.lock)
        ident = threading.get_ident()
        self.blocks = {ident: self.blocks[ident]} if ident in self.blocks else {}

    def __call__(self, state=None) -> "_Block":
        return _Block(self, state)

    def current(self):
        """This thread's innermost block: ``(state,)``, or ``()`` outside any. A block is live while
        the frame that entered it is on the thread's stack; one whose exit never ran (a Ctrl-C at
        the exit's entry, where Python raises before any of its code runs) ends with that frame, and
        is dropped here."""
        blocks = self.blocks.get(threading.get_ident())
        while blocks:
            frame = blocks[-1][0]
            f = sys._getframe(1)
            while f is not None and f is not frame:
                f = f.f_back
            if f is not None:
                return (blocks[-1][1],)
            blocks.pop()
        return ()

    def enter(self, frame, state) -> None:
        """``frame`` enters a block: the hooks are registered, then the frame recorded, under the lock
        that ``leave`` drops the hooks under (so no thread is left inside a block without them)."""
        with self.lock:
            if self.hook is None:
                # The hooks act only while their list is ``self.hook``: one an interrupt left
                # registered without its handle stored acts for no one, never twice beside another.
                handles = []
                for kind, act in self.acts.items():
                    handles.append(_REGISTER[kind](self._hook(act, handles)))
                self.hook = handles
            self.blocks.setdefault(threading.get_ident(), []).append((frame, state))  # now the thread is inside

    def leave(self, frame) -> None:
        """``frame``'s block ends; the hooks go once no thread is inside one. Hooks left by an
        interrupted block act for no thread (``current`` is empty) and go at a later block's end."""
        ident = threading.get_ident()
        blocks = self.blocks.get(ident)
        if blocks and blocks[-1][0] is frame:
            blocks.pop()
        self.current()  # drops this thread's blocks whose frames have ended
        with self.lock:
            if not self.blocks.get(ident):
                self.blocks.pop(ident, None)
            if not any(self.blocks.values()) and self.hook is not None:
                handles, self.hook = self.hook, None
                for handle in handles:
                    handle.remove()

    def _hook(self, act, handles: list):
        def hook(module, name, value):
            inside = self.current() if handles is self.hook else ()
            return act(inside[0], module, name, value) if inside else None
        return hook


class _Block:
    """One ``with hooks(state):`` block. A class, not a ``contextlib`` generator (whose suspended
    frame a kept traceback holds), and bound to the frame that entered it: the thread is inside the
    block while that frame runs, so even an exit an interrupt skipped ends the block."""

    __slots__ = ("owner", "state", "frame")

    def __init__(self, owner: ScopedHooks, state):
        self.owner, self.state, self.frame = owner, state, None

    def __enter__(self):
        self.frame = sys._getframe(1)
        self.owner.enter(self.frame, self.state)
        return self.state

    def __exit__(self, *exc) -> None:
        frame, self.frame = self.frame, None
        self.owner.leave(frame)
