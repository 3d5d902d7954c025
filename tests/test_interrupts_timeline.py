"""Ctrl-C inside ``ot.timeline``'s enter and exit and inside ``Recorder.kernels`` (the block a grouped
GEMM's handler records each expert's kernel in): the thread's dispatch mode stack, torch's mode
flags, the pagers' recorder, the model's hooks and the expert policy's methods are as before the
block, at once, or, after one at the very entry of the exit, from the thread's next forward of the
model or next ``ot.timeline``; the next recording records what a clean one does. Ctrl-C anywhere
in ``ot.plan``, which wraps its meta model to record it, leaves that model unwrapped as it was."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
from torch.utils import _python_dispatch

import offtensor as ot
from offtensor.model import copies as _copies
from offtensor.pager import Pager
from offtensor.sim import policy_clock, recorder, recording
from offtensor.sim.policy_clock import POLICY, PolicyClock

from test_interrupts import _moe
from test_interrupts_exits import _AtEntryOf
from test_interrupts_more import _Points, _PointsPastEntry, _points

needs_311 = pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")


def _policy():
    return {(cls, name): cls.__dict__[name] for cls, names, _ in POLICY for name in names}


def _as_before(model, policy) -> bool:
    pager = _copies.state_of(model).pager
    return (torch._C._len_torch_dispatch_stack() == 0 and not _python_dispatch._is_in_torch_dispatch_mode
            and pager.recorder is None and pager.observers.get("recorder") is None and getattr(pager.observers, "quiet", None) is None
            and not {"page", "upload", "copy_out", "prefetch"} & set(vars(pager))
            and not any(isinstance(getattr(h, "__self__", None), recording.timeline) for h in model._forward_pre_hooks.values())
            and PolicyClock.installed is None
            and _policy() == policy[0] and Pager.page is policy[2])


def _model_policy(model):
    PolicyClock()  # (calibrated once per process, before any point is counted)
    return _policy(), None, Pager.page


def _model(monkeypatch):
    model, _, (ids,) = _moe(monkeypatch)
    policy = _model_policy(model)
    with torch.no_grad():
        want = model(ids)
    return model, ids, want, policy


# Ops every forward of the model runs the same number of times, whatever its expert cache holds
# (the routed experts' ops and the routing guesses' vary with it).
_FIXED = ("embedding", "rsqrt", "bmm", "cos", "sin")


def _recorded(model, ids, names=_FIXED) -> dict:
    """The counts of ``names`` ops in a recording of one forward: each op recorded once."""
    with torch.no_grad(), ot.timeline(model) as tl:
        model(ids)
    return {name: sum(r.name == name for r in tl.records) for name in names}


@needs_311
def test_an_interrupt_at_any_point_of_a_timelines_enter_or_exit_leaves_everything_as_before(monkeypatch):
    """A Ctrl-C at every 2nd point of ``ot.timeline``'s enter and exit (recording.py, the policy clock's
    install and remove, and what they call), past the exit's entry, its traceback kept: at once, no
    recorder on the mode stack, torch's mode flags as before, no recorder on the pager, no hook left
    on the model, the expert policy's methods and the pager's its own; the forward gives the same
    output and the next recording holds what a clean one holds. Before, a point after the mode was
    pushed in the enter (or before it was popped in the exit) left it on the stack, recording every
    later op of the thread, and the pager's entry points patched."""
    model, ids, want, policy = _model(monkeypatch)
    clean = _recorded(model, ids)
    where = lambda code: code.co_filename in (recording.__file__, policy_clock.__file__)  # noqa: E731

    def block():
        with torch.no_grad(), ot.timeline(model):
            pass

    total = _points(block, where)
    assert total > 40
    kept = []
    for n in range(1, total + 1, 2):
        kept.append(_PointsPastEntry(n, where, recording.timeline.__exit__.__code__).run(block))
        assert _as_before(model, policy), n
        with torch.no_grad():
            assert torch.equal(model(ids), want), n
    assert sum(error is not None for error in kept) > 0.95 * len(kept)  # (not those in a finalizer, which Python ignores)
    assert _recorded(model, ids) == clean and _as_before(model, policy)


@needs_311
@pytest.mark.parametrize("touch", ["forward", "timeline"])
def test_a_ctrl_c_at_the_entry_of_timelines_exit_is_taken_back_at_the_next_forward_or_timeline(monkeypatch, touch):
    """A Ctrl-C at the entry of ``timeline.__exit__``, where Python raises before any of its code runs,
    its traceback kept (as a REPL keeps the last one): once the frame that entered it has ended, the
    thread's next forward of the model (not recorded) or next ``ot.timeline`` takes the recording
    back: mode stack, flags, pager, hooks and policy as before, and the next recording is clean.
    Before, the recorder stayed on the mode stack for good, every later op recorded, the pager
    patched and the policy clock installed (no later recording could time the policy)."""
    model, ids, want, policy = _model(monkeypatch)
    clean = _recorded(model, ids)
    holder = {}

    def block():
        with torch.no_grad(), ot.timeline(model) as tl:
            holder["tl"] = tl
            model(ids)

    assert _AtEntryOf(recording.timeline.__exit__.__code__).run(block) is not None
    assert torch._C._len_torch_dispatch_stack() == 1  # still recording: the frame ended without the exit
    records = len(holder["tl"].records)
    if touch == "forward":
        with torch.no_grad():
            assert torch.equal(model(ids), want)
        assert len(holder["tl"].records) == records and _as_before(model, policy)
        assert _recorded(model, ids) == clean
    else:
        assert _recorded(model, ids) == clean and len(holder["tl"].records) == records
    assert _as_before(model, policy)


@needs_311
def test_an_interrupt_at_any_point_of_a_kernels_block_leaves_one_recorder_on_the_stack():
    """A Ctrl-C at each point of ``Recorder.kernels``' block (recorder.py's ``_Kernels`` and the stack
    calls it makes; a transformers Qwen3-MoE, whose grouped GEMM records each expert's kernel in
    one), the exit's entry included, caught inside the recording: the mode stack holds this
    recorder once, as before the op, so the next forward records each op once; the recording's exit
    leaves the stack empty. As a ``contextlib`` generator over ``with self``, one at its exit's
    entry left the recorder pushed twice, every later op recorded twice, and once more after the exit."""
    pytest.importorskip("transformers")
    from test_moe_predictor import _qwen3, _wrap_quarter

    model = _wrap_quarter(_qwen3())
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(1))
    policy = _model_policy(model)
    clean = _recorded(model, ids, ("embedding", "rsqrt", "_grouped_mm"))
    where = lambda code: code.co_qualname.startswith("_Kernels.") or code is recorder.pop_to.__code__  # noqa: E731

    def forward():
        with torch.no_grad():
            model(ids)

    counter = _Points(-1, where)
    with torch.no_grad(), ot.timeline(model):
        counter.run(forward)
    total = counter.count
    assert total > 20
    for n in range(1, 31):  # (each expert's block has the same points: the first blocks' cover them)
        with torch.no_grad(), ot.timeline(model) as tl:
            assert _Points(n, where).run(forward) is not None, n
            assert torch._C._len_torch_dispatch_stack() == 1, n
            model(ids)
        assert _as_before(model, policy), n
        assert sum(r.name == "embedding" for r in tl.records) == 2, n  # each forward's once
    assert _recorded(model, ids, ("embedding", "rsqrt", "_grouped_mm")) == clean


def _meta_stack():
    with torch.device("meta"):
        return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                   torch.nn.Linear(64, 64))


@needs_311
def test_an_interrupt_at_any_point_of_a_plan_leaves_the_model_as_it_was():
    """``ot.plan`` of a model on meta wraps it on a meta pager and unwraps it when the plan ends, so
    the model is as it was. A Ctrl-C at every 60th point of offtensor's model package and of
    sim/plan.py (the wrap, the placement, the unwrap, and the functions they call directly): every
    slot holds its own Parameter again, every module has its own class and no wrap, and the next
    plan replays as an uninterrupted one. Cut short in its unwrap (the moves, the registration's
    undo), the plan had left the model wrapped: OffloadedTensors in its slots."""
    from offtensor.model import prepare
    from offtensor.model.state import wrapped_state
    from offtensor.sim import plan as sim_plan

    package = prepare.__file__.rpartition("/")[0] + "/"
    where = lambda code: code.co_filename.startswith(package) or code.co_filename == sim_plan.__file__  # noqa: E731
    model = _meta_stack()
    registered = [(m, name, t) for m in model.modules() for name, t in m._parameters.items()]
    classes = [(m, type(m)) for m in model.modules()]
    x = torch.empty(4, 64, device="meta")
    budget = 0.7 * sum(p.numel() * p.element_size() for p in model.parameters()) / (1 << 30)
    run = lambda: ot.plan(model, budget_gb=budget, example_inputs=(x,), steps=1, warmup=0)  # noqa: E731
    want = run().replay()
    total = _points(run, where)
    assert total > 1000
    left_wrapped = []
    for n in range(1, total + 1, 60):
        _Points(n, where).run(run)
        if wrapped_state(model) is not None or any(type(m) is not cls for m, cls in classes):
            left_wrapped.append(n)
            ot.unwrap_model(model)
        assert all(m._parameters[name] is t and type(t) is torch.nn.Parameter for m, name, t in registered), n
    assert not left_wrapped, f"the model left wrapped after interrupts at points {left_wrapped}"
    assert run().replay() == want
