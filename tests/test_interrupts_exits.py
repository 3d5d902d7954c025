"""Ctrl-C at the entry of a ``with`` block's exit, where Python raises before any of the exit's
code runs, in the blocks users enter.

- ``ot.on_host``: the loan is bound to the frame that entered it; once that frame has ended, the
  next touch of the model in that thread (its forward, ``ot.stats``, another ``on_host``,
  ``unwrap_model``, an assignment) gives every weight back and the lock with them.
- ``ops.planned_routing`` (``ot.plan`` with measured routing): the routing holds only while the
  frame that entered the block runs, so later plans in the thread draw their routing again.
"""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch

import offtensor as ot
from offtensor.model import copies as _copies
from offtensor.model import host
from offtensor.tensor import OffloadedTensor

from test_interrupts import _lock_is_free
from test_interrupts_more import _Points, _points
from test_subclass_leaves import HIDDEN, _offloaded_two_tensor_model

needs_311 = pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")


class _AtEntryOf:
    """A tracer raising KeyboardInterrupt once, at the entry of the function whose code is ``code``
    (a trace function that raises is unset by Python)."""

    def __init__(self, code):
        self.code, self.hit = code, False

    def __call__(self, frame, event, arg):
        if event == "call" and frame.f_code is self.code and not self.hit:
            self.hit = True
            raise KeyboardInterrupt("at the entry of an exit")
        return None

    def run(self, fn):
        sys.settrace(self)
        try:
            fn()
        except KeyboardInterrupt as error:
            return error
        finally:
            sys.settrace(None)
        return None


def _lent_model():
    model, param = _offloaded_two_tensor_model("cpu")
    registered = [(m, name, t) for m in model.modules() for name, t in m.named_parameters(recurse=False)]
    return model, param, registered


def _given_back(model, param, registered) -> bool:
    state = _copies.wrapped_state(model)
    return (all(m._parameters[name] is t for m, name, t in registered) and isinstance(param.a, OffloadedTensor)
            and isinstance(param.b, OffloadedTensor) and state.lent_slots == frozenset() and getattr(state, "loans", ()) == ()
            and state.pager.lock._recursion_count() == 0 and _lock_is_free(state.pager))


def _forward(model, x):
    with torch.no_grad():
        return model(x)


def _on_host(model):
    with ot.on_host(model):
        pass


def _assign(model):
    model[0].scale = torch.ones(1)  # (a plain tensor attribute: placed, as every assignment is)


@needs_311
@pytest.mark.parametrize("touch", [
    _forward, lambda model, x: ot.stats(model), lambda model, x: _on_host(model),
    lambda model, x: _assign(model), lambda model, x: ot.unwrap_model(model),
], ids=["forward", "stats", "on_host", "assignment", "unwrap"])
def test_a_ctrl_c_at_the_entry_of_on_hosts_exit_is_given_back_at_the_next_touch(touch):
    """A Ctrl-C at the entry of ``HostLoan.__exit__``, its traceback kept (as a REPL keeps the last
    one): the next touch of the model gives every weight back, its wrapper subclass over its own
    offloaded leaves, and the pager's lock, so another thread takes it; the forward after gives the
    same outputs. On main the slots stayed lent to the host stand-ins and the lock held by this
    thread, so another thread's forward waited forever."""
    model, param, registered = _lent_model()
    x = torch.randn(3, HIDDEN)
    want = _forward(model, x)
    state = _copies.state_of(model)

    def block():
        with torch.no_grad(), ot.on_host(model):
            model[0].weight.mul_(1)

    kept = _AtEntryOf(host.HostLoan.__exit__.__code__).run(block)
    assert kept is not None
    assert model[0].weight is not param and state.pager.lock._recursion_count() == 1  # still lent
    touch(model, x)
    if _copies.is_wrapped(model):
        assert _given_back(model, param, registered)
    else:  # unwrapped: every weight plain again, over the values written through the stand-ins
        assert all(m._parameters[name] is t for m, name, t in registered) and state.loans == ()
        assert not isinstance(param.a, OffloadedTensor) and state.pager.lock._recursion_count() == 0
    out = _forward(model, x)
    assert torch.equal(out.a, want.a) and torch.equal(out.b, want.b)


@needs_311
def test_an_interrupt_at_any_point_of_on_host_its_exits_entry_included_gives_everything_back():
    """A Ctrl-C at each point of ``ot.on_host``'s enter and exit (model/host.py and what it calls),
    the exit's entry included, its traceback kept; then ``ot.stats`` (a touch of the model): every
    slot holds its own weight again, nothing is lent or recorded as a loan, the pager's lock is
    free for another thread, and the next forward and ``on_host`` run."""
    where = lambda code: code.co_filename in (host.__file__, contextlib.__file__)  # noqa: E731
    model, param, registered = _lent_model()
    x = torch.randn(3, HIDDEN)
    want = _forward(model, x)

    def block():
        with torch.no_grad(), ot.on_host(model):
            model[0].weight.mul_(1)

    total = _points(block, where)
    assert total > 20
    kept, at_exit_entry = [], 0
    for n in range(1, total + 1):
        kept.append(_Points(n, where).run(block))
        at_exit_entry += model[0].weight is not param  # (still lent: cut short at the exit's entry)
        ot.stats(model)
        assert _given_back(model, param, registered), n
        out = _forward(model, x)
        assert torch.equal(out.a, want.a) and torch.equal(out.b, want.b), n
    assert at_exit_entry >= 1 and sum(error is not None for error in kept) > total - 5
    block()
    assert _given_back(model, param, registered)


def test_a_loan_held_across_a_generators_yield_is_not_taken_for_ended():
    """A loan entered in a generator, whose frame leaves the stack at each ``yield``: a touch of the
    model meanwhile (``ot.stats``) leaves it lent, and closing the generator gives it back."""
    model, param, registered = _lent_model()

    def lending():
        with ot.on_host(model):
            yield model[0].weight

    gen = lending()
    lent = next(gen)
    ot.stats(model)
    assert model[0].weight is lent and lent is not param
    gen.close()
    assert _given_back(model, param, registered)


@needs_311
def test_an_interrupt_at_any_point_of_a_planned_routing_block_leaves_later_plans_uniform(monkeypatch):
    """A Ctrl-C at each point of a ``planned_routing`` block's enter and exit, the exit's entry
    included, its traceback kept: a meta grouped GEMM's routing read after it (``planned_ends``) is
    drawn again, not the block's. As a ``contextlib`` generator, one at its exit's entry left the
    generator suspended inside the block, and every later plan of the thread routed as that one."""
    from offtensor.ops import planned

    monkeypatch.setattr(planned, "_planned_ends", lambda experts, rows: ["drawn"])
    where = lambda code: code.co_filename in (planned.__file__, contextlib.__file__)  # noqa: E731

    def block():
        with planned.planned_routing(lambda experts, rows: ["measured"]):
            assert planned.planned_ends(2, 2) == ["measured"]

    total = _points(block, where)
    assert total > 5
    kept = []
    for n in range(1, total + 1):
        kept.append(_Points(n, where).run(block))
        assert planned.planned_ends(2, 2) == ["drawn"], n
    assert all(error is not None for error in kept)
    block()
    assert planned.planned_ends(2, 2) == ["drawn"]


def test_a_planned_routing_block_in_a_generator_holds_across_its_yield(monkeypatch):
    """A ``planned_routing`` block entered in a generator, whose frame leaves the stack at each
    ``yield``: the routing holds while the generator is suspended, and goes when it is closed."""
    from offtensor.ops import planned

    monkeypatch.setattr(planned, "_planned_ends", lambda experts, rows: ["drawn"])

    def routed():
        with planned.planned_routing(lambda experts, rows: ["measured"]):
            yield

    gen = routed()
    next(gen)
    assert planned.planned_ends(2, 2) == ["measured"]
    gen.close()
    assert planned.planned_ends(2, 2) == ["drawn"]
