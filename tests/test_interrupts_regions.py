"""Ctrl-C where a region of offtensor's changes state in several steps.

- The entry of ``Undo.__exit__``, where Python raises before any of its code runs: on a wrap's
  normal exit (the wrap is whole and the original tensors are freed, not kept by a record left
  active), and as a second interrupt after one inside the wrap (the wrap is rolled back all the same).
- The expert placement decided from the measured routing at a forward (its replay, the re-placement
  of the stacks): the decision is taken again at the next forward, and the placement recorded is
  the one the stacks have.
- A host master's creation, its move to another pager and its adoption by the default pager: each
  pager's ``offloaded_bytes`` counts exactly the live masters it owns.
- The adoption of a ``copy.deepcopy`` of a wrapped model: the copy is adopted whole at its next use.
- The block ``from_pretrained`` builds its model on meta in: the thread builds real weights again
  after an interrupt at any point of its enter or exit.
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
from test_interrupts_more import _Points, _points
from test_reliability import GiB, _assert_unchanged, _inputs, _nbytes, _reference, _snapshot

needs_311 = pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")


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


@needs_311
def test_a_ctrl_c_in_the_expert_placement_decision_is_decided_again_at_the_next_forward(monkeypatch):
    """An MoE model wrapped without ``routing=`` decides its expert placement at the forward after
    10 routed tokens (a replay of both placements, then the stacks re-placed). A Ctrl-C at sampled
    points of that decision (sim/expert_choice.py, model/prepare.py and what they call): the next
    decode decides, records the placement the stacks have, counts the resident bytes they hold and
    gives the plain model's logits. On main the watch was removed before the decision: cut short,
    the report said "to be decided after 10 routed tokens" for good and the model stayed in the
    default placement; and one cut short after the stacks moved left them counted as resident."""
    pytest.importorskip("transformers")
    import test_moe_placement as moe_placement

    from offtensor import config as ot_config
    from offtensor.model import prepare
    from offtensor.model.moves import resident_bytes
    from offtensor.sim import expert_choice

    monkeypatch.setattr(ot_config, "DEFAULT_PLACEMENT_PROFILE", moe_placement.SLOW_COPIES)
    monkeypatch.delenv("OFFTENSOR_PLACEMENT_PROFILE", raising=False)
    monkeypatch.setenv("OFFTENSOR_ROUTING_WARMUP", "10")
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)  # (a master's finalizer, interrupted)
    want = moe_placement._decode(moe_placement._model("cpu"), 5)
    where = lambda code: code.co_filename in (expert_choice.__file__, prepare.__file__)  # noqa: E731

    def wrapped():
        model = moe_placement._model("cpu")
        return ot.wrap_model(model, budget_gb=moe_placement._budget_gb(model), device="cpu")

    model = wrapped()
    total = _points(lambda: moe_placement._decode(model, 5), where)  # decided at the 3rd forward
    assert ot.stats(model).expert_placement["chosen"] == "all_paged"  # (so the stacks move)
    assert total > 50
    interrupted = 0
    points = sorted(random.Random(7).sample(range(1, total + 1), 2)) + [total - 2]
    for n in points:
        model = wrapped()
        interrupted += _Points(n, where).run(lambda: moe_placement._decode(model, 5)) is not None
        logits = moe_placement._decode(model, 5)
        assert all(torch.equal(a, b) for a, b in zip(logits, want)), n
        report = ot.stats(model).expert_placement
        assert "decided" in report, (n, report)
        paged = all(moe_placement._stacks(model).values())
        assert paged == (report["chosen"] == "all_paged"), (n, report)
        pager = _copies.state_of(model).pager
        assert pager.resident_bytes == resident_bytes(model, pager.device), n
        assert not any(isinstance(h, expert_choice.PlacementWatch) for h in model._forward_pre_hooks.values()), n
    # A run's points can be a few fewer than the count's (a finalizer the garbage collector runs in
    # these frames, the copy thread's timing), so the last point may not be reached in every run.
    assert interrupted >= len(points) - 2


@needs_311
def test_a_re_placement_of_the_experts_cut_short_leaves_the_old_placement_or_the_new_one(monkeypatch):
    """A Ctrl-C at every 3rd point of ``re_place_experts`` (the stacks offloaded, then the state's
    record of the placement: its config, the resident bytes counted, the prefetcher): either every
    stack is offloaded and the state says so, or the model is placed and counted as before; the
    resident bytes counted are what the resident weights hold, and the decode is right. On main an
    interrupt after the stacks moved left them counted as resident (less room to page in) under the
    old config."""
    pytest.importorskip("transformers")
    import test_moe_placement as moe_placement

    from offtensor.model import prepare
    from offtensor.model.moves import resident_bytes
    from offtensor.placement import EXPERTS_PAGED

    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)  # (a master's finalizer, interrupted)
    monkeypatch.setenv("OFFTENSOR_ROUTING_WARMUP", "0")  # (no decision of its own)
    want = moe_placement._decode(moe_placement._model("cpu"), 2)
    where = lambda code: code.co_filename == prepare.__file__  # noqa: E731

    def wrapped():
        model = moe_placement._model("cpu")
        ot.wrap_model(model, budget_gb=moe_placement._budget_gb(model), device="cpu")
        state = _copies.state_of(model)
        return model, state, lambda: prepare.re_place_experts(state, model, EXPERTS_PAGED)

    model, state, re_place = wrapped()
    before = moe_placement._stacks(model)
    assert not all(before.values())
    total = _points(re_place, where)
    assert total > 20 and all(moe_placement._stacks(model).values())
    for n in range(1, total + 1, 3):
        model, state, re_place = wrapped()
        assert _Points(n, where).run(re_place) is not None, n
        stacks = moe_placement._stacks(model)
        if state.config.policy is EXPERTS_PAGED:
            assert all(stacks.values()), n
        else:
            assert stacks == before, n
        assert state.pager.resident_bytes == resident_bytes(model, state.pager.device), n
        assert all(torch.equal(a, b) for a, b in zip(moe_placement._decode(model, 2), want)), n


@needs_311
def test_an_interrupt_anywhere_in_a_masters_accounting_counts_each_live_master_once(young_heap):
    """A Ctrl-C at each point of a host master's creation, of its move to another pager (a wrap
    adopting an offloaded tensor, or undoing that) and of its adoption by the default pager (its
    model gone): every pager's ``offloaded_bytes`` (a figure of ``ot.stats`` and the cap on its
    arena) counts exactly the live masters it owns, then and after the master is used and dies. On
    main the count and the owner changed in separate steps: an interrupt between them counted a
    master twice, or on a pager it left, or a master that never existed."""
    from offtensor.pager import Pager, masters

    where = lambda code: code.co_filename == masters.__file__  # noqa: E731
    cpu = torch.device("cpu")
    default = Pager.default(cpu)

    def check(pagers, bases, live) -> None:
        for pager, base in zip(pagers, bases):
            owned = sum(m.nbytes for m in live if m._owner[0]() is pager)
            assert pager.offloaded_bytes == base + owned

    def walk(make, act) -> int:
        """``act(master)`` cut short at each of its points, on a master ``make()`` made; the counts
        after it, after the master's next use and after it dies. (make() -> (master, pagers))"""
        interrupted, n = 0, 1
        while True:
            gc.collect()
            master, pagers = make()
            pagers = pagers + [default]
            bases = [p.offloaded_bytes - (master is not None and master._owner[0]() is p) * 4096 for p in pagers]
            made = []
            cut = _Points(n, where).run(lambda: made.append(act(master))) is not None
            gc.collect()  # (the traceback's frames, which may hold a master made)
            live = [m for m in [master, *made] if isinstance(m, masters.Master)]
            check(pagers, bases, live)
            assert all(m.pager is not None for m in live)  # (an orphan: adopted now)
            check(pagers, bases, live)
            del master, made, live
            gc.collect()
            check(pagers, bases, [])
            if not cut:
                return interrupted
            interrupted, n = interrupted + 1, n + 1

    def on_a_pager():
        pager = Pager(cpu, 1 << 20)
        return masters.Master(pager, 4096), [pager]

    pager = Pager(cpu, 1 << 20)
    assert walk(lambda: (None, [pager]), lambda _: masters.Master(pager, 4096)) > 3  # creation
    other = Pager(cpu, 1 << 20)
    assert walk(on_a_pager, lambda m: m.move_to(other)) > 3  # a move to another pager

    def orphan():
        master, pagers = on_a_pager()
        del pagers
        gc.collect()  # its pager dies
        return master, []

    assert walk(orphan, lambda m: m.pager) > 3  # adopted by the default pager


@needs_311
def test_an_interrupt_at_any_point_of_a_meta_build_block_leaves_the_thread_building_real_weights():
    """``from_pretrained`` builds the model inside ``_parameters_on_meta()``, which makes this
    thread's new parameters meta. A Ctrl-C at each point of the block's enter and exit, the exit's
    entry included (where Python raises before any of its code runs), its traceback kept as a REPL
    keeps it: the thread builds real weights again, and the next block leaves no hook behind. As a
    ``contextlib`` generator, one at its exit's entry left the generator suspended inside the block
    for as long as the traceback lived, and every model the thread built meanwhile got meta weights."""
    import contextlib

    from offtensor.loading import pretrained, scoped

    on_meta = pretrained._parameters_on_meta
    where = lambda code: code.co_filename in (pretrained.__file__, scoped.__file__, contextlib.__file__)  # noqa: E731

    def block():
        with on_meta():
            assert torch.nn.Linear(2, 2).weight.is_meta

    total = _points(block, where)
    assert total > 3
    kept = []
    for n in range(1, total + 1):
        kept.append(_Points(n, where).run(block))
        assert not torch.nn.Linear(2, 2).weight.is_meta, n
    assert all(error is not None for error in kept)
    block()
    assert not torch.nn.Linear(2, 2).weight.is_meta and on_meta.hook is None and not on_meta.blocks


@needs_311
def test_an_interrupt_at_any_point_of_a_counted_build_leaves_the_thread_uncounted():
    """``from_pretrained`` counts what its builds register (``registrations.counted``) and stops a
    build past its limit. A Ctrl-C at each point of the block's enter and exit, the exit's entry
    included, its traceback kept: the thread's later builds are not counted (a limit of 0 refuses
    any parameter inside the block, none outside), the next block, the tracebacks still kept,
    leaves no hook behind, and a later build is counted once: a hook an interrupt left registered
    before its handle was kept counted every registration again beside the next block's."""
    from offtensor.loading import registrations, scoped

    counted = registrations.counted
    where = lambda code: code.co_filename in (registrations.__file__, scoped.__file__)  # noqa: E731

    def block():
        state = registrations.Registrations({}, "ckpt")
        state.parameter_limit = 0
        with counted(state):
            with pytest.raises(ot.CheckpointError, match=r"more than 0 parameters"):
                torch.nn.Linear(2, 2)

    total = _points(block, where)
    assert total > 3
    kept = []
    for n in range(1, total + 1):
        kept.append(_Points(n, where).run(block))
        torch.nn.Linear(2, 2)  # not refused: this thread is outside every block
        block()  # (hooks an interrupted block left go at the next block's end: each run takes the same points)
        assert counted.hook is None and not counted.blocks, n
        state = registrations.Registrations({}, "ckpt")
        with counted(state):
            torch.nn.Sequential(torch.nn.Linear(2, 2))
        assert (len(state.parameters), state.modules) == (2, 1), n  # each counted once, by one hook
    assert all(error is not None for error in kept)


@needs_311
def test_a_deep_copy_adopted_anywhere_cut_short_is_adopted_whole_at_its_next_use():
    """A ``copy.deepcopy`` of a wrapped model is adopted on a pager of its own at its first use; a
    Ctrl-C at every 7th point of that adoption (model/copies.py, the masters' moves and what they call),
    then ``ot.stats`` of the copy: the copy is wrapped on its own pager, which counts exactly its
    masters, the original is wrapped as before on its pager with the same count, and both give the
    unwrapped outputs. On main an interrupt after the copied step hook was dropped left a copy that
    nothing adopted again (``ot.stats`` refused it as not wrapped)."""
    import copy

    from offtensor.model import copies
    from offtensor.pager import masters

    where = lambda code: code.co_filename in (copies.__file__, masters.__file__)  # noqa: E731
    reference = _reference()
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = reference(x)
    original = _reference()
    _wrap(original)
    pager = _copies.state_of(original).pager
    counted = pager.offloaded_bytes

    def masters_of(model) -> set:
        return {id(p._master): p._master for p in model.parameters() if isinstance(p, ot.OffloadedTensor)}

    total = _points(lambda: _copies.is_wrapped(copy.deepcopy(original)), where)
    assert total > 20
    for n in range(1, total + 1, 7):
        clone = copy.deepcopy(original)
        _Points(n, where).run(lambda: _copies.is_wrapped(clone))
        own = ot.stats(clone)
        state = _copies.state_of(clone)
        assert state.pager is not pager and state.model_ref() is clone, n
        assert state.pager.offloaded_bytes == own.offloaded_bytes == sum(
            m.nbytes for m in masters_of(clone).values()), n
        assert all(m.pager is state.pager for m in masters_of(clone).values()), n
        assert _copies.state_of(original).pager is pager and pager.offloaded_bytes == counted, n
        with torch.no_grad():
            assert torch.equal(clone(x), want) and torch.equal(original(x), want), n


@needs_311
def test_a_module_outliving_its_wrapped_model_adopted_anywhere_cut_short_takes_the_wrap_over_whole():
    """A module of a wrapped model that outlived it (the base model peft's ``merge_and_unload``
    returns, the PeftModel dropped) takes that model's wrap over at its first use; a Ctrl-C at
    every point of that adoption (model/copies.py, model/state.py), then a forward or ``ot.stats``
    of it: it is wrapped, on the dropped model's pager, with exactly one step hook, and gives the
    unwrapped outputs. (Cut short after its step hook was registered, it was taken for a deep copy
    at its next use and adopted on a new pager.)"""
    from offtensor.model import state as _state
    from offtensor.model.copies import StepHook

    where = lambda code: code.co_filename in (_copies.__file__, _state.__file__)  # noqa: E731
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = _reference()(x)

    def orphan():
        holder = torch.nn.Sequential(_reference())
        ot.wrap_model(holder, budget_gb=int(_nbytes(holder) * 0.4) / GiB, device="cpu",
                      policy={"offload": ["*layers.*"]})
        pager = _copies.state_of(holder).pager
        inner = holder[0]
        del holder
        gc.collect()
        return inner, pager

    inner, _ = orphan()
    total = _points(lambda: _copies.is_wrapped(inner), where)
    assert total > 10
    for n in range(1, total + 1):
        inner, pager = orphan()
        _Points(n, where).run(lambda: _copies.is_wrapped(inner))
        if n % 2:  # the next use a forward (its step hook, where the cut-short adoption left one)
            with torch.no_grad():
                inner(x)
        assert ot.stats(inner).offloaded_bytes > 0, n
        state = _copies.state_of(inner)
        assert state.pager is pager and state.model_ref() is inner, n
        assert sum(isinstance(h, StepHook) for h in inner._forward_pre_hooks.values()) == 1, n
        with torch.no_grad():
            assert torch.equal(inner(x), want), n
