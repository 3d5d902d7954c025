"""Ctrl-C where a region of offtensor's changes state in several steps.

- The entry of ``Undo.__exit__``, where Python raises before any of its code runs: on a wrap's
  normal exit (the wrap is whole and the original tensors are freed, not kept by a record left
  active), and as a second interrupt after one inside the wrap (the wrap is rolled back all the same).
"""

from __future__ import annotations

import gc
import random
import sys

import pytest
import torch

import offtensor as ot
from offtensor.model import copies as _copies
from offtensor.model.moves import Undo

from test_interrupts_atomic import _InterruptAt, _opcodes, _traced
from test_reliability import GiB, _assert_unchanged, _inputs, _nbytes, _reference, _snapshot

def _wrap(model):
    return ot.wrap_model(model, budget_gb=int(_nbytes(model) * 0.4) / GiB, device="cpu",
                         policy={"offload": ["layers.*"]})


class _AtExitEntry:
    """A tracer raising KeyboardInterrupt at the entry of ``Undo.__exit__`` on a normal exit (the
    block done). (A trace function that raises is unset by Python, so this one raises once.)"""

    def __call__(self, frame, event, arg):
        if frame.f_code is Undo.__exit__.__code__ and frame.f_locals["kind"] is None:
            raise KeyboardInterrupt("at the entry of Undo.__exit__")
        return None


def _storages(model) -> list:
    from torch.multiprocessing.reductions import StorageWeakRef

    return [StorageWeakRef(p.untyped_storage()) for p in model.parameters()]


def test_an_interrupt_at_the_entry_of_a_wraps_undo_exit_keeps_no_original_tensor():
    """The wrap has done every step, then a Ctrl-C at the entry of its ``Undo.__exit__``, its
    traceback kept (as a REPL keeps the last one): the model is wrapped and whole, no record is
    left active and the original weights are freed. On main the record stayed active, holding the
    original tensors (a host model's weights twice over) and every later step's note."""
    model = _reference()
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = model(x)
    originals = _storages(model)
    sys.settrace(_AtExitEntry())
    try:
        _wrap(model)
    except KeyboardInterrupt as error:
        kept = error  # noqa: F841 (the traceback a REPL keeps)
    finally:
        sys.settrace(None)
    assert _copies.is_wrapped(model)
    assert getattr(Undo._active, "record", None) is None
    gc.collect()
    assert all(ref.expired() for ref in originals), "the original weights are still held"
    with torch.no_grad():
        assert torch.equal(model(x), want)


def test_a_second_interrupt_at_the_entry_of_a_wraps_undo_exit_still_rolls_it_back(monkeypatch):
    """A Ctrl-C at 60 sampled opcodes of a wrap, then a second at the entry of ``Undo.__exit__``,
    which it calls with the first (``__exit__`` raising before its own code runs): the model is
    exactly as it was, not wrapped, no record active, and the next wrap works. On main that second
    interrupt skipped the roll-back: the model was left half wrapped (OffloadedTensors on a model
    not registered as wrapped) and the record active."""
    original = Undo.__exit__

    def interrupted_at_entry(self, kind, error, tb):
        if kind is not None:
            raise KeyboardInterrupt("at the entry of Undo.__exit__")
        return original(self, kind, error, tb)

    x = _inputs("cpu", 1)[0]
    total = _opcodes(lambda: _wrap(_reference()))
    rolled_back, left_active = 0, []
    for n in sorted(random.Random(5).sample(range(1, total + 1), 60)):
        model = _reference()
        with torch.no_grad():
            want = model(x)
        before = _snapshot(model)
        monkeypatch.setattr(Undo, "__exit__", interrupted_at_entry)
        _traced(_InterruptAt(n), lambda: _wrap(model))
        monkeypatch.setattr(Undo, "__exit__", original)
        if not _copies.is_wrapped(model):
            _assert_unchanged(model, before)
            rolled_back += 1
        left_active.append(getattr(Undo._active, "record", None) is not None)
        if not _copies.is_wrapped(model):
            _wrap(model)
        with torch.no_grad():
            assert torch.equal(model(x), want), n
    assert rolled_back > 30 and not any(left_active)

