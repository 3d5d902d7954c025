"""Ctrl-C and fork on the paths the other interrupt tests do not walk.

Interrupts are raised where CPython raises a signal handler's exception (``_Points``): entering a
function, at a loop's back edge, and when a C function returns (attributed to the instruction that
called it, as Python attributes it).

- A Ctrl-C while a routing guess is copied ahead, the traceback kept (as a REPL keeps the last
  one): the expert cache's next evictions are not limited to the guesses' spare room.
- A Ctrl-C while the expert registry is rebuilt (after an expert stack is assigned anew): the next
  step rebuilds it again, with the router hooks of a fresh wrap, once each.
- A Ctrl-C at any point of an unwrap's unregistration: the model is still wrapped (and
  ``unwrap_model`` finishes it) or fully unwrapped: plain tensors, its own classes, no hooks.
- ``fork()`` in strict mode (``OFFTENSOR_STRICT=1``, the strict copy engine's worker renewed in the
  child), and while another thread adopts an orphaned weight: the child's forward finishes, right.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import opcode
import os
import signal
import sys
import threading
import time

import pytest
import torch

import offtensor as ot
from offtensor.model import copies as _copies
from offtensor.pager import Pager
from offtensor.tensor import OffloadedTensor

from test_interrupts import _moe as _interrupts_moe
from test_interrupts_atomic import _wait_child
from test_reliability import GiB, _assert_unchanged, _inputs, _nbytes, _reference, _snapshot

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
needs_311 = pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")

_BACK_EDGES = {opcode.opmap[name] for name in ("JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT") if name in opcode.opmap}


class _Points:
    """A tracer raising ``KeyboardInterrupt`` at the ``n``-th point where Python raises a signal's
    exception (a function's entry, a loop's back edge, the return of a C function called: it
    surfaces at the call, inside whatever ``try`` or ``with`` holds it), in frames whose code passes
    ``where`` and in the Python functions they call directly (``contextlib``'s ``__enter__``...).
    n < 0 only counts."""

    def __init__(self, n, where):
        self.n, self.count, self.where = n, 0, where

    def _point(self):
        self.count += 1
        if self.count == self.n:
            sys.settrace(None)
            sys.setprofile(None)
            raise KeyboardInterrupt(f"injected at point {self.n}")

    def _walked(self, frame) -> bool:
        return frame is not None and (self.where(frame.f_code) or
                                      (frame.f_back is not None and self.where(frame.f_back.f_code)))

    def __call__(self, frame, event, arg):
        if not self._walked(frame):
            return None
        frame.f_trace_opcodes, frame.f_trace_lines = True, False
        self._point()
        return self._opcode

    def _opcode(self, frame, event, arg):
        if event == "opcode" and frame.f_code.co_code[frame.f_lasti] in _BACK_EDGES:
            self._point()
        return self._opcode

    def _profile(self, frame, event, arg):
        if event == "c_return" and self._walked(frame):
            self._point()

    def run(self, fn):
        """``fn()`` under the tracer: the KeyboardInterrupt it raised, or None."""
        sys.settrace(self)
        sys.setprofile(self._profile)
        try:
            fn()
        except KeyboardInterrupt as error:
            return error
        finally:
            sys.settrace(None)
            sys.setprofile(None)
        return None


def _points(fn, where) -> int:
    counter = _Points(-1, where)
    counter.run(fn)
    return counter.count


def _whole_or_written(w, before, after, run, where, step=1, each=None) -> int:
    """Interrupt ``run`` (which writes ``w``, offloaded or plain) at every ``step``-th of its points,
    ``w`` set to ``before`` first: each time it is ``before`` or ``after``, never part written;
    ``each(n)`` checks more after point ``n``. Returns the points counted."""
    points = _points(run, where)
    torn = []
    for n in range(1, points + 1, step):
        with torch.no_grad():
            w.copy_(before)
        _Points(n, where).run(run)
        now = (w.materialize() if isinstance(w, OffloadedTensor) else w.detach().clone()).to(before.device)
        if not (torch.equal(now, before) or torch.equal(now, after)):
            torn.append(n)
        if each is not None:
            each(n)
    assert not torn, f"part written after interrupts at points {torn[:10]}"
    return points


def _moe(monkeypatch, fraction):
    """The reference MoE model of test_interrupts, wrapped at ``fraction`` of its bytes, with every
    routing guess copied ahead (the gate a guess must pass opened), warm."""
    from offtensor.moe import guesses

    model, reference, (ids,) = _interrupts_moe(monkeypatch)
    monkeypatch.setattr(guesses, "SPECULATE_PRECISION", 0.0)
    monkeypatch.setattr(guesses, "SPECULATE_PRECISION_IDLE", 0.0)
    monkeypatch.setattr(guesses, "SPECULATE_EVIDENCE", 0.0)
    model = copy.deepcopy(reference)
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    ot.wrap_model(model, budget_gb=fraction * weights / GiB, device="cpu")
    for _ in range(3):
        model.generate(ids, 4)
    assert ot.stats(model).guesses["copied_experts"] > 0
    return model, reference, ids


@needs_311
def test_an_interrupt_where_a_guess_is_copied_ahead_leaves_eviction_free_to_make_room(monkeypatch):
    """A Ctrl-C at every 2nd point of the speculator's ``_issue`` (where a guess is copied ahead inside
    the eviction's spare-room-only block), its traceback kept, then decode steps that copy no guess:
    they run and decode as the plain model. On main the block was a ``contextlib`` generator: an
    interrupt in its ``__enter__``, after the mode was set, left it set while the traceback lived,
    and the next in-line page of an expert failed with a BudgetError."""
    from offtensor.moe import speculation

    model, reference, ids = _moe(monkeypatch, 0.35)
    want = reference.generate(ids, 4)
    in_issue = lambda code: code is speculation.RoutingSpeculator._issue.__code__  # noqa: E731
    total = _points(lambda: model.generate(ids, 4), in_issue)
    assert total > 20
    kept = []  # the tracebacks a REPL would keep (only the last, there)
    for n in range(1, total + 1, 2):
        monkeypatch.setattr(speculation, "SPECULATE_COPY", True)
        kept.append(_Points(n, in_issue).run(lambda: model.generate(ids, 4)))
        monkeypatch.setattr(speculation, "SPECULATE_COPY", False)
        assert torch.equal(model.generate(ids, 4), want), f"after an interrupt at point {n}"
    assert any(kept)


def _speculator_hooks(model) -> list:
    from offtensor.moe.hooks import _SpeculatorHook

    return [h for m in model.modules() for hooks in (m._forward_pre_hooks, m._forward_hooks)
            for h in hooks.values() if isinstance(h, _SpeculatorHook)]


@needs_311
def test_an_expert_refresh_cut_short_is_run_again_at_the_next_step(monkeypatch):
    """An expert stack assigned anew makes the next step rebuild the registry (detach, attach); a
    Ctrl-C at every 18th point of that rebuild (``State.refresh_experts``, moe/hooks.py and what they
    call): the next decode gives the plain model's tokens with every router hooked once, as after
    the wrap. On main the registry was marked fresh before the rebuild: cut short, the routers'
    hooks were gone (no guesses) until the next change of a stack."""
    from offtensor.model.state import State
    from offtensor.moe import hooks as moe_hooks

    model, reference, ids = _moe(monkeypatch, 0.5)
    want = reference.generate(ids, 3)
    hooked = sorted(map(type, _speculator_hooks(model)), key=str)
    assert hooked
    where = lambda code: code is State.refresh_experts.__code__ or code.co_filename == moe_hooks.__file__  # noqa: E731

    def restack():
        experts = model.layers[1].mlp.experts
        experts.w1 = torch.nn.Parameter(reference.layers[1].mlp.experts.w1.detach().clone())

    restack()
    total = _points(lambda: model.generate(ids, 3), where)
    assert total > 100
    interrupted = 0
    for n in range(1, total + 1, 18):
        restack()
        interrupted += _Points(n, where).run(lambda: model.generate(ids, 3)) is not None
        assert torch.equal(model.generate(ids, 3), want), n
        assert sorted(map(type, _speculator_hooks(model)), key=str) == hooked, n
        speculator = _copies.state_of(model).pager.experts.speculator
        assert all(h.speculator_ref() is speculator for h in _speculator_hooks(model)), n
    assert interrupted > total // 18 - 3  # (a rebuild's points vary by a few)


def _wrap(model):
    budget = int(_nbytes(model) * 0.4)
    return ot.wrap_model(model, budget_gb=budget / GiB, device="cpu", policy={"offload": ["layers.*"]})


def _in_child(run) -> int:
    """Fork; the child runs ``run()`` (True: right) with 10 s to do it. Its exit status: 0 right,
    1 wrong, 2 raised, -1 hung."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        try:
            os._exit(0 if run() else 1)
        except BaseException:
            os._exit(2)
    return _wait_child(pid)


@needs_311
def test_an_unwrap_interrupted_at_any_point_of_its_unregistration_is_finished_by_the_next():
    """A Ctrl-C at every 2nd point of the modules' unregistration (model/copies.py, assignment.py,
    state.py and what they call): the model is still wrapped, with the right outputs, and a second
    ``unwrap_model`` finishes; or it is unwrapped as a plain model is. On main the model itself left
    first: cut short after it, the model was not wrapped, so could not be unwrapped (nor wrapped:
    "already wrapped" where its member record stayed), while its other modules kept the wrapping
    class and its step hook, which adopted it as a copy at its next forward."""
    here = os.path.dirname(ot.__file__)
    files = {os.path.join(here, "model", name) for name in ("copies.py", "assignment.py", "state.py")}
    where = lambda code: code.co_filename in files  # noqa: E731
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = _reference()(x)

    def warm():
        model = _reference()
        before = _snapshot(model)
        _wrap(model)
        with torch.no_grad():
            model(x)
        return model, before

    model, _ = warm()
    total = _points(lambda: ot.unwrap_model(model), where)
    assert total > 100
    interrupted = 0
    for n in range(1, total + 1, 2):
        model, before = warm()
        interrupted += _Points(n, where).run(lambda: ot.unwrap_model(model)) is not None
        if _copies.is_wrapped(model):
            with torch.no_grad():
                assert torch.equal(model(x), want), n
            ot.unwrap_model(model)
        tensors, _ = before  # the same objects and values, now plain again (on the emulated device: cpu)
        before = ({name: (t, cls, None, values) for name, (t, cls, _, values) in tensors.items()}, before[1])
        _assert_unchanged(model, before)
        assert not any(m._forward_pre_hooks or m._state_dict_hooks for m in model.modules()), n
        _wrap(model)
        with torch.no_grad():
            assert torch.equal(model(x), want), n
    assert interrupted > total // 2 - 3


@needs_311
def test_an_unwrap_through_a_shallow_copy_interrupted_anywhere_is_finished_through_either_name():
    """``ot.unwrap_model`` of a ``copy.copy`` of a wrapped model, a Ctrl-C at each point of the
    unwrap (model/prepare.py, copies.py, assignment.py, state.py and what they call): both names are
    still wrapped, sharing one wrap, with the right outputs, and a second unwrap through the copy
    finishes; or both are plain. The copy is found through the original's member it carries, which
    the original keeps until it leaves last: found only through the step hook (which goes first),
    a cut-short unwrap left the copy not wrapped and adopted it as a deep copy at its next forward,
    taking the original's modules away from its half-finished wrap."""
    here = os.path.dirname(ot.__file__)
    files = {os.path.join(here, "model", name) for name in ("prepare.py", "copies.py", "assignment.py", "state.py")}
    where = lambda code: code.co_filename in files  # noqa: E731
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = _reference()(x)

    def warm():
        model = _reference()
        _wrap(model)
        twin = copy.copy(model)
        with torch.no_grad():
            twin(x)
        return model, twin

    model, twin = warm()
    total = _points(lambda: ot.unwrap_model(twin), where)
    assert total > 100
    interrupted = 0
    for n in range(1, total + 1, 3):
        model, twin = warm()
        interrupted += _Points(n, where).run(lambda: ot.unwrap_model(twin)) is not None
        assert _copies.is_wrapped(twin) == _copies.is_wrapped(model), n
        if _copies.is_wrapped(twin):
            assert _copies.state_of(twin) is _copies.state_of(model), n
            with torch.no_grad():
                assert torch.equal(twin(x), want) and torch.equal(model(x), want), n
            assert _copies.state_of(twin) is _copies.state_of(model), n
            ot.unwrap_model(twin)
        assert not any(isinstance(p, OffloadedTensor) for p in model.parameters()), n
        assert not any(m._forward_pre_hooks or m._state_dict_hooks for m in model.modules()), n
        with torch.no_grad():
            assert torch.equal(twin(x), want) and torch.equal(model(x), want), n
    assert interrupted > total // 3 - 5


@needs_fork
def test_a_forked_child_of_a_strict_model_runs_its_forward(monkeypatch):
    """On main the strict copy engine's worker got a condition over a new lock in the child while
    its sections kept taking the old one: the child's first copy raised "cannot notify on
    un-acquired lock"."""
    monkeypatch.setenv("OFFTENSOR_STRICT", "1")
    model, reference = _reference(), _reference()
    _wrap(model)
    assert ot.stats(model).page_ins == 0 and model.layers[0].weight._master.pager.strict
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = reference(x)
        assert torch.equal(model(x), want)  # the strict worker runs in the parent

        def forward():
            return torch.equal(model(x), want)

        assert _in_child(forward) == 0
        assert torch.equal(model(x), want)


@needs_fork
def test_a_fork_while_a_thread_adopts_an_orphaned_weight_leaves_the_child_free_to_use_one():
    """A state-dict value outlives its model: its first use charges it to the default pager, under
    ``Master._adopting``. A thread doing so waits there for the default pager's lock (held by
    another op); forked then, the child on main found ``_adopting`` held for good and hung."""
    model = _reference()
    _wrap(model)
    state = model.state_dict()
    w0, w1 = state["layers.0.weight"], state["layers.1.weight"]
    want = w1.detach().clone() * 2
    del model, state
    gc.collect()
    default = Pager.default(torch.device("cpu"))
    adopting = threading.Thread(target=lambda: w0 + 1, daemon=True)
    with default.lock:  # an op of another thread on the default pager
        adopting.start()
        time.sleep(0.2)  # the thread now holds _adopting, waiting for the lock
        status = _in_child(lambda: torch.equal(w1 * 2, want))
    adopting.join(10)
    assert status == 0
    assert torch.equal(w1 * 2, want)


class _PointsPastExitEntry(_Points):
    """``_Points`` without the entry of ``HostLoan.__exit__``: Python raises there before any of its
    code runs (CPython calls it as a function), so the loan is given back at the next touch of the
    model instead, which ``test_interrupts_exits.py`` checks."""

    def __call__(self, frame, event, arg):
        if frame.f_code.co_qualname == "HostLoan.__exit__" and self._walked(frame):
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
            return self._opcode
        return super().__call__(frame, event, arg)


@needs_311
def test_an_interrupt_at_any_point_of_on_host_gives_every_weight_and_the_lock_back():
    """A Ctrl-C at each point of ``ot.on_host``'s enter and exit (model/host.py and what it calls),
    its traceback kept: every slot holds its own weight again (a wrapper subclass its own object
    over its offloaded leaves), nothing is marked lent, the pager's lock is free for another
    thread, and the next forward and ``on_host`` run. On main the block was a ``contextlib``
    generator holding the lock across its ``yield``: an interrupt while it lent (or gave back) left
    slots lent to the stand-ins, and one just after its ``yield`` (in ``contextlib``'s
    ``__enter__``) left the lock held by the suspended generator for as long as the traceback lived."""
    from test_interrupts import _lock_is_free
    from test_subclass_leaves import HIDDEN, _offloaded_two_tensor_model

    from offtensor.model import host

    # (contextlib's frames: where the block's enter and exit ran on main)
    where = lambda code: code.co_filename in (host.__file__, contextlib.__file__)  # noqa: E731
    model, param = _offloaded_two_tensor_model("cpu")
    registered = [(m, name, t) for m in model.modules() for name, t in m.named_parameters(recurse=False)]
    state = _copies.state_of(model)
    x = torch.randn(3, HIDDEN)
    with torch.no_grad():
        want = model(x)

    def block():
        with torch.no_grad(), ot.on_host(model):
            model[0].weight.mul_(1)  # a transform writing through its stand-in (the same values)

    total = _points(block, where)
    assert total > 20
    kept = []  # the tracebacks a REPL would keep (only the last, there)
    for n in range(1, total + 1):
        kept.append(_PointsPastExitEntry(n, where).run(block))
        assert all(m._parameters[name] is t for m, name, t in registered), n
        assert isinstance(param.a, OffloadedTensor) and isinstance(param.b, OffloadedTensor), n
        assert state.lent_slots == frozenset(), n
        assert state.pager.lock._recursion_count() == 0 and _lock_is_free(state.pager), n
        with torch.no_grad():
            out = model(x)
        assert torch.equal(out.a, want.a) and torch.equal(out.b, want.b), n
    assert sum(error is not None for error in kept) > total - 5
    block()
    assert all(m._parameters[name] is t for m, name, t in registered)


def _refresh_points(model, reference, ids, step: int):
    """Yield after a Ctrl-C at every ``step``-th point of an expert registry's refresh (after an
    expert stack is assigned anew: ``State.refresh_experts``, moe/hooks.py, the budget's accounts
    and what they call), its traceback kept, and a decode step that runs the refresh again."""
    from offtensor.model.state import State
    from offtensor.moe import hooks as moe_hooks
    from offtensor.moe import predictor
    from offtensor.pager import budget, room

    files = {moe_hooks.__file__, predictor.__file__, budget.__file__, room.__file__}
    where = lambda code: code is State.refresh_experts.__code__ or code.co_filename in files  # noqa: E731

    def restack():
        experts = model.layers[1].mlp.experts
        experts.w1 = torch.nn.Parameter(reference.layers[1].mlp.experts.w1.detach().clone())

    want = reference.generate(ids, 2)
    restack()
    total = _points(lambda: model.generate(ids, 2), where)
    assert total > 50
    kept = []
    for n in range(1, total + 1, step):
        restack()
        kept.append(_Points(n, where).run(lambda: model.generate(ids, 2)))
        assert torch.equal(model.generate(ids, 2), want), n  # no BudgetError: the refresh ran again
        yield n
    # (Not every point: one in a finalizer, the replaced stack's master dying, is lost to Python.)
    assert sum(error is not None for error in kept) > total // step // 2


@needs_311
def test_an_expert_pool_refresh_cut_short_anywhere_gives_the_budget_back_exactly_once(monkeypatch):
    """``expert_pool=True``: the pools' bytes are held from the budget. After a Ctrl-C at every
    18th point of a refresh (detach, attach), the next step's refresh leaves the budget minus exactly
    the new pools' bytes. On main an interrupt between the detach dropping the pools and giving
    their bytes back lost them for good (the budget shrank by the pools' bytes per Ctrl-C, until
    the pools no longer fitted: a BudgetError)."""
    from offtensor.models import DeepSeekConfig, DeepSeekForCausalLM

    config = DeepSeekConfig(
        vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128, first_k_dense_replace=1,
    )
    reference = DeepSeekForCausalLM.empty(config).init_weights(seed=0).eval()
    model = copy.deepcopy(reference)
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    ot.wrap_model(model, budget_gb=0.5 * weights / GiB, device="cpu", expert_pool=True)
    pager = _copies.state_of(model).pager
    full = pager.budget_bytes + pager.expert_pool.nbytes
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)  # (pytest's keeps the tracebacks)
    for n in _refresh_points(model, reference, ids, 18):
        assert pager.expert_pool is not None and pager.budget_bytes + pager.expert_pool.nbytes == full, n


@needs_311
def test_a_refresh_cut_short_anywhere_keeps_the_learned_lookahead_and_its_bytes(monkeypatch):
    """An installed learned look-ahead is installed again for the stacks registered anew. After a
    Ctrl-C at every 15th point of that refresh, the next step's refresh leaves it installed (every map
    on its router) and the budget minus exactly its bytes. On main a refresh cut short after the
    detach ran again without it (the look-ahead was gone for good), and one cut short between the
    detach giving back the maps' bytes and forgetting them gave them back twice."""
    from offtensor.moe.predictor import LOOKAHEAD_ACCOUNT, LookaheadPredictor, install

    model, reference, ids = _moe(monkeypatch, 0.5)
    pager = _copies.state_of(model).pager
    full = pager.budget_bytes
    g = torch.Generator().manual_seed(0)
    maps = LookaheadPredictor()
    for i in range(2):  # the first two of the three MoE layers guess the next
        maps.weights[i], maps.biases[i] = torch.randn(16, 64, generator=g), torch.zeros(16)
    install(pager, maps)
    nbytes = maps.installed_bytes(4)
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    assert pager.budget_bytes == full - nbytes
    for n in _refresh_points(model, reference, ids, 15):
        routers = [r for r in pager.experts.speculator.routers if r.stacks]
        assert [r.lookahead is not None for r in routers] == [True, True, False], n
        assert pager.experts.lookahead[0] is maps and pager.held_outside(LOOKAHEAD_ACCOUNT) == nbytes, n
        assert pager.budget_bytes == full - nbytes, n


@needs_311
def test_an_unwrap_interrupted_while_it_moves_the_weights_leaves_the_model_wrapped_and_whole(monkeypatch):
    """A Ctrl-C at every 2nd point of an unwrap's moves (model/moves.py, torch's ``swap_tensors``,
    ``prepare.unwrap``): the model is still wrapped with the right outputs, and a second
    ``unwrap_model`` gives plain Parameters with them; or the first finished. On main an interrupt
    inside ``swap_tensors`` (which exchanges class, attributes and C++ tensor one by one) left a
    Parameter of the plain class over the offloaded tensor, which neither a forward nor a second
    unwrap could use (torch raised: "Attempted to access the data pointer on an invalid python
    storage", or an internal assert of its dispatch)."""
    import torch.utils

    from offtensor.model import moves, prepare

    files = {moves.__file__, torch.utils.__file__}
    where = lambda code: code.co_filename in files or code is prepare.unwrap.__code__  # noqa: E731
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)  # (a master's finalizer, interrupted)
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = _reference()(x)

    def warm():
        model = _reference()
        _wrap(model)
        with torch.no_grad():
            model(x)
        return model

    model = warm()
    total = _points(lambda: ot.unwrap_model(model), where)
    assert total > 100
    for n in range(1, total + 1, 2):
        model = warm()
        params = list(model.parameters())
        _Points(n, where).run(lambda: ot.unwrap_model(model))
        if _copies.is_wrapped(model):
            with torch.no_grad():
                assert torch.equal(model(x), want), n
            ot.unwrap_model(model)
        assert list(model.parameters()) == params and all(type(p) is torch.nn.Parameter for p in params), n
        with torch.no_grad():
            assert torch.equal(model(x), want), n


class _PointsPastEntry(_Points):
    """``_Points`` without the entry of the function whose code is ``entry``: Python raises there
    before any of its code runs."""

    def __init__(self, n, where, entry):
        super().__init__(n, where)
        self.entry = entry

    def __call__(self, frame, event, arg):
        if frame.f_code is self.entry and self._walked(frame):
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
            return self._opcode
        return super().__call__(frame, event, arg)


@needs_311
def test_an_interrupt_where_a_master_dies_leaves_the_offloaded_bytes_right(monkeypatch, young_heap):
    """A weight of a wrapped model replaced (its old host master dies, and its finalizer drops the
    master's cached copies and its bytes from the pager's count), a Ctrl-C at each point of that
    finalizer past its entry (which Python then ignores): the pager counts exactly the live
    masters' bytes, and the forward is right. On main the count came after the drop of the copies:
    an interrupt there left the dead master's bytes counted for good; and so did one in
    ``weakref.finalize``'s call before it called the finalizer (a weak reference's callback now)."""
    import weakref

    from offtensor.pager import room
    from offtensor.pager.masters import Master

    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    # (room.py: the drop of the copies, and the room the re-placement makes; weakref.finalize's call,
    # which ran the finalizer on main)
    finalizing = (Master._died.__code__, weakref.finalize.__call__.__code__)
    where = lambda code: code in finalizing or code.co_filename == room.__file__  # noqa: E731
    reference = _reference()
    x = _inputs("cpu", 1)[0]

    def offloaded(model) -> int:
        masters = {p._master.id: p._master.nbytes for p in model.parameters() if isinstance(p, OffloadedTensor)}
        return sum(masters.values())

    def replace(model):
        with torch.no_grad():
            model(x)  # the weight's copy is cached
        layer = model.layers[0]
        layer.weight = torch.nn.Parameter(reference.layers[0].weight.detach().clone())

    model = _reference()
    _wrap(model)
    assert isinstance(model.layers[0].weight, OffloadedTensor)
    total = _points(lambda: replace(model), where)
    assert total > 3
    for n in range(1, total + 1):
        model = _reference()
        _wrap(model)
        pager = _copies.state_of(model).pager
        _PointsPastEntry(n, where, Master._died.__code__).run(lambda: replace(model))
        gc.collect()
        assert pager.offloaded_bytes == offloaded(model), n
        with torch.no_grad():
            assert torch.equal(model(x), reference(x)), n
