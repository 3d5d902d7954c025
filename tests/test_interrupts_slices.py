"""Ctrl-C inside an in-place op run in slices (a weight larger than the budget's free room).

- An interrupt at any point of ``w.mul_(2)`` or ``torch._foreach_add_([w], ...)`` in slices leaves
  the weight as it was or as written, never half written: each slice is written back as it is
  computed, and an exception between two puts the weight's saved values back (``pieces.py``).
- The pager's lock is free afterwards and the next op runs. Before, a Ctrl-C on the way into the
  undo of the whole op's page (whose ``BudgetError`` is routine there: it is what sends the op to
  slices) left the thread holding the lock, and every later page of the weight was refused.
- A second interrupt inside the put-back is survived: it is finished once more.
- An interrupt at any point of a linear run in tiles of such a weight (``__torch_function__``'s
  path, not an aten op's) leaves the lock free: one on the very call into a tile's ``release``
  left the record holding it, where ``torch_dispatch`` would have released it.

Interrupts are raised where CPython raises a signal handler's exception (``_Points``).
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from offtensor.ops import pieces

from test_interrupts_more import _Points, _points, _whole_or_written
from test_whole_on_host import _weight, _wrapped

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # a generator closed by the interrupt
needs_311 = pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")

IN_PLACE = {
    "mul_": lambda w: w.mul_(2),
    "_foreach_add_": lambda w: torch._foreach_add_([w], [torch.full((64, 128), 0.25, device=w.device)], alpha=0.5),
}


def _ours(code) -> bool:
    return "offtensor" in code.co_filename


def _case(name):
    model = _wrapped("cpu")
    before = _weight()
    after = before.clone()
    IN_PLACE[name](after)

    def run():
        with torch.no_grad():
            IN_PLACE[name](model.w)

    return model, before, after, run


def _reset(model, before):
    with torch.no_grad():
        model.w.copy_(before)


@needs_311
@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_an_interrupt_at_any_point_of_an_in_place_op_in_slices_leaves_the_weight_whole_or_written(name):
    model, before, after, run = _case(name)
    pager = model.w._master.pager

    def lock_free(n):
        assert pager._depth() == 0, f"the lock is still held after an interrupt at point {n}"

    points = _whole_or_written(model.w, before, after, run, _ours, 2 if name == "mul_" else 5, lock_free)
    assert points > 200  # the slices' loop, each slice's page and write-back
    _reset(model, before)
    run()
    assert torch.equal(model.w.materialize(), after)
    assert pager.stats.peak_device_bytes <= pager.budget_bytes


@needs_311
def test_a_second_interrupt_inside_the_put_back_is_survived(monkeypatch):
    """An interrupt late in the slices' loop, then a second one at each of the put-back's first
    points: the weight is as it was, and the next op runs."""
    model, before, after, run = _case("mul_")
    points = _points(run, _ours)
    original = pieces._put_back
    second = {"n": 0, "calls": 0, "hit": 0}

    def interrupted_put_back(saved):
        second["calls"] += 1
        if second["calls"] > 1:  # the retry runs whole
            return original(saved)
        # Counted in the writes the put-back calls, not in its own loop.
        tracer = _Points(second["n"], lambda code: code is not original.__code__ and _ours(code))
        if tracer.run(lambda: original(saved)) is not None:
            second["hit"] += 1
            raise KeyboardInterrupt("the second")

    monkeypatch.setattr(pieces, "_put_back", interrupted_put_back)
    for m in range(1, 40, 3):
        second["n"], second["calls"] = m, 0
        _reset(model, before)
        _Points(int(points * 0.7), _ours).run(run)
        assert model.w._master.pager._depth() == 0
        assert torch.equal(model.w.materialize(), before), m
    assert second["hit"] > 3  # (what the test is about: the put-back was cut short)
    monkeypatch.setattr(pieces, "_put_back", original)
    _reset(model, before)
    run()
    assert torch.equal(model.w.materialize(), after)


@needs_311
def test_an_interrupt_at_any_point_of_a_linear_in_tiles_leaves_the_lock_free_and_the_next_forward_right():
    model = _wrapped("cpu")
    pager = model.w._master.pager
    x = torch.randn(3, 128)
    want = F.linear(x, _weight())

    def run():
        with torch.no_grad():
            return F.linear(x, model.w)

    points = _points(run, _ours)
    for n in range(1, points + 1, 2):
        _Points(n, _ours).run(run)
        assert pager._depth() == 0, f"the lock is still held after an interrupt at point {n}"
    assert torch.equal(run(), want)
    assert pager.stats.peak_device_bytes <= pager.budget_bytes


def test_an_in_place_op_in_slices_without_host_memory_for_its_copy_runs_and_warns_naming_the_weight(monkeypatch):
    """The host copy is an allocation as large as the weight: where the host has no memory for it,
    the op still runs, right, and warns that an interrupt could leave the weight part written."""
    model, before, after, run = _case("mul_")

    def out_of_memory(t):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(pieces, "_host_copy", out_of_memory)
    with pytest.warns(RuntimeWarning, match=r"'w'.*32768 bytes.*without a host copy"):
        run()
    assert torch.equal(model.w.materialize(), after)


@needs_311
def test_an_interrupt_at_any_point_of_a_plain_tensor_written_in_slices_leaves_it_whole_or_written():
    """``ema.add_(w)``: the written tensor is a plain one on the device, the weight it reads larger
    than the room. Its values before the op are copied to the host (no device memory) and put
    back; before, an interrupt between two slices left the average part updated."""
    model = _wrapped("cpu")
    pager = model.w._master.pager
    ema = torch.zeros(64, 128)
    before, after = ema.clone(), ema.clone().add_(_weight(), alpha=0.5)

    def run():
        with torch.no_grad():
            ema.add_(model.w, alpha=0.5)

    def lock_free(n):
        assert pager._depth() == 0, f"the lock is still held after an interrupt at point {n}"

    assert _whole_or_written(ema, before, after, run, _ours, 3, lock_free) > 100
    ema.copy_(before)
    run()
    assert torch.equal(ema, after)
