"""Ctrl-C in the flows real clients run over a wrapped model, where the other interrupt tests do not
walk: peft's LoRA training step and ``merge_and_unload``, diffusers' UNet2DConditionModel, torchao's
int8 weight-only forward, MoE ``generate``, ``torch.compile(backend="aot_eager")``,
``ot.from_pretrained``, ``unwrap_model``, a DTensor-sharded forward, a cast of the model after
wrapping and ``load_state_dict(assign=True)`` were swept at sampled points; what lost something is tested here.

- A cast of a wrapped model (``.float()``, ``.half()``) hides each module's offloaded tensors from
  torch's own ``_apply`` while it casts the plain ones. An interrupt between two of those hidings
  left the weights hidden so far ``None`` for good: the next forward failed in ``linear`` ("weight
  must be Tensor, not NoneType"), and a second cast could not bring them back. Now the hiding is
  inside the block that shows them again, and that showing, cut short, is run once more.
- The same cast, cut short inside a ``torch.no_grad()``'s enter or exit (its own, or torch's
  ``_apply``'s), after grad went off and before the ``with`` took hold, left grad off for the rest
  of the thread (a later training step: "does not require grad"). The cast now puts the caller's
  grad mode back when anything cuts it short, as wrap and load do.
- The same cast, cut short after torch's ``_apply`` cast a module's plain tensors and before the
  room was planned again for them, was never re-planned: a second cast found them at their new size
  already. Resident weights that had grown past the room stayed resident, and the resident bytes
  could pass the whole budget. The re-planning now runs however ``_apply`` ended, once more if it
  was itself cut short (from the resident count read before it, so a second run counts nothing twice).
- ``load_state_dict(assign=True)`` into a wrapped model records the weights it replaces until its
  root's last post-hook, which an interrupt skips: the record kept each replaced weight's host master
  alive (and counted in ``offloaded_bytes``) until the next such load. The wrapping class's
  ``load_state_dict`` now ends the record however the load ends.
- Under ``set_swap_module_params_on_conversion`` the same load swaps each incoming tensor into its
  Parameter object and only the module's post-hook places it: cut short in between, a host tensor
  stayed where the wrap offloaded a weight. The load now places what it swapped in when cut short.
- ``module.weight = w`` into a wrapped model swaps an OffloadedTensor into the user's own Parameter
  object ``w``. Cut short after that swap (at the placement's last step, the resident recount), the
  slot went back to the old weight, but ``w`` stayed an OffloadedTensor whose host master the pager
  counted. The registration and placement are now one ``Undo`` record, which gives ``w`` back.
  Where ``w`` is another wrapped model's OffloadedTensor, its host master moved to this model's
  pager stayed there; the record now moves it back.
- ``copy.deepcopy`` of a wrapped model, cut short at the entry of a ``torch.no_grad()``'s exit
  in an offloaded tensor's copy, left grad off too; it puts it back the same way.

Interrupts are raised where CPython raises a signal handler's exception (``_Points``).
"""

from __future__ import annotations

import copy
import gc
import os
import sys
import weakref

import pytest
import torch

import offtensor as ot
from offtensor.model import casts
from offtensor.model.copies import state_of
from offtensor.model.moves import resident_bytes
from offtensor.pager.masters import Master

from test_interrupts_more import _Points, _points
from test_wrap import swap_on_conversion  # noqa: F401 (a fixture)

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # a generator closed by the interrupt
needs_311 = pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")
GiB = 1 << 30


def _in_casts(code) -> bool:
    return code.co_filename == casts.__file__


def _bf16_stack():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 256),
                               torch.nn.Linear(256, 64)).to(torch.bfloat16)


def _wrapped():
    """Some weights offloaded, some resident; its upcast offloads a resident one that grew."""
    model = _bf16_stack()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ot.wrap_model(model, budget_gb=0.7 * weights / GiB, device="cpu")
    return model


@needs_311
def test_an_interrupt_at_any_point_of_a_cast_of_a_wrapped_model_loses_no_weight_and_leaves_grad_on():
    """A Ctrl-C at every 2nd point of ``model.float()`` in model/casts.py (and the functions it calls
    directly), then ``.float()`` again: the weights an uninterrupted cast offloads are offloaded
    (no more resident bytes than after it), every weight is there, with the unwrapped cast's values,
    the forward (of every 10th) is the unwrapped model's and within the budget, the lock free, and grad mode on as
    before (one in a ``torch.no_grad()``'s enter or exit there had left it off)."""
    reference = _bf16_stack().float()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(x)
    whole = _wrapped().float()
    placed = [isinstance(p, ot.OffloadedTensor) for p in whole.parameters()]
    assert placed != [isinstance(p, ot.OffloadedTensor) for p in _wrapped().parameters()]  # the upcast offloads one
    total = _points(lambda: _wrapped().float(), _in_casts)
    assert total > 200
    grad_off = []
    for n in range(1, total + 1, 2):
        model = _wrapped()
        pager = state_of(model).pager
        _Points(n, _in_casts).run(model.float)
        if not torch.is_grad_enabled():
            grad_off.append(n)
            torch.set_grad_enabled(True)
        assert pager._depth() == 0, n
        lost = [name for name, module in model.named_modules() for attr, t in module._parameters.items() if t is None]
        assert not lost, f"{lost} lost after an interrupt at point {n}"
        model.float()
        assert [isinstance(p, ot.OffloadedTensor) for p in model.parameters()] == placed, n
        assert ot.stats(model).resident_bytes <= ot.stats(whole).resident_bytes, n
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert p.dtype == torch.float32 and torch.equal(p.detach().cpu(), q.detach()), (n, name)
        if n % 5 == 0 or n + 2 > total:  # (the forward of every 10th point: the test's time)
            with torch.no_grad():
                assert torch.equal(model(x), want), n
            s = ot.stats(model)
            assert s.peak_device_bytes <= s.budget_bytes, (n, s)
    assert not grad_off, f"grad mode left off after interrupts at points {grad_off}"


@needs_311
def test_an_interrupt_at_any_point_of_a_deepcopy_of_a_wrapped_model_leaves_grad_on():
    """``copy.deepcopy`` of a wrapped model (a reference or EMA copy) copies each host master under
    ``torch.no_grad()``: a Ctrl-C at the entry of its exit, before any of it ran, left grad off for
    the rest of the thread. Then a deepcopy runs whole, and the copy gives the model's outputs."""
    model = _wrapped()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.no_grad():
        want = model(x)
    in_deepcopy = lambda code: code is ot.OffloadedTensor.__deepcopy__.__code__  # noqa: E731
    total = _points(lambda: copy.deepcopy(model), in_deepcopy)
    assert total > 50
    grad_off = []
    for n in range(1, total + 1):
        _Points(n, in_deepcopy).run(lambda: copy.deepcopy(model))
        if not torch.is_grad_enabled():
            grad_off.append(n)
            torch.set_grad_enabled(True)
    assert not grad_off, f"grad mode left off after interrupts at points {grad_off}"
    with torch.no_grad():
        assert torch.equal(copy.deepcopy(model)(x), want)
        assert torch.equal(model(x), want)


def _in_model_package(code) -> bool:
    return code.co_filename.startswith(os.path.dirname(casts.__file__) + os.sep)


@needs_311
def test_an_interrupt_at_any_point_of_an_assigned_load_keeps_no_replaced_weight_alive(young_heap):
    """``load_state_dict(new, assign=True)`` into a wrapped model, a Ctrl-C at every 23rd point of
    offtensor's model package (and the functions it calls directly): each weight is its old or its
    new value, and the pager counts only the host masters of the offloaded weights the model holds.
    The load records the weights it replaces until its last post-hook, which an interrupt skips: that
    record kept every replaced weight's host master alive, counted in ``offloaded_bytes``, until
    the next such load. The forward of every 10th point is the unwrapped model's, within the budget."""
    reference = _bf16_stack()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    torch.manual_seed(1)
    new = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}

    def offloaded(model) -> int:
        return sum({p._master.id: p._master.nbytes for p in model.parameters() if isinstance(p, ot.OffloadedTensor)}.values())

    model = _wrapped()
    total = _points(lambda: model.load_state_dict(new, assign=True), _in_model_package)
    assert total > 500
    kept = []
    for n in range(1, total + 1, 23):
        model = _wrapped()
        old = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        _Points(n, _in_model_package).run(lambda: model.load_state_dict(new, assign=True))
        gc.collect()
        now = _values(model)
        assert all(torch.equal(now[k], old[k]) or torch.equal(now[k], new[k]) for k in now), n
        if state_of(model).pager.offloaded_bytes != offloaded(model):
            kept.append(n)
        if n % 10 == 1:
            with torch.no_grad():
                reference.load_state_dict(now)
                assert torch.equal(model(x), reference(x)), n
                reference.load_state_dict(old)
            s = ot.stats(model)
            assert s.peak_device_bytes <= s.budget_bytes, (n, s)
    assert not kept, f"replaced weights' host masters kept after interrupts at points {kept}"


def _values(model) -> dict:
    """The wrapped ``model``'s state dict as plain tensors."""
    return {k: (v.materialize() if isinstance(v, ot.OffloadedTensor) else v.detach()) for k, v in model.state_dict().items()}


def _runs_as(model, reference, values: dict, x, n) -> None:
    """``model`` gives ``reference``'s output with ``values`` loaded, within its budget (after point ``n``)."""
    with torch.no_grad():
        reference.load_state_dict(values)
        assert torch.equal(model(x), reference(x)), n
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes, (n, s)


@needs_311
def test_an_interrupt_in_an_assigned_load_that_swaps_places_what_it_swapped_in(swap_on_conversion, young_heap):
    """``load_state_dict(new, assign=True)`` under ``set_swap_module_params_on_conversion(True)``:
    torch swaps each incoming tensor into the Parameter object, and only the module's load post-hook
    places it. A Ctrl-C at every 46th point of the model package between the two left an incoming
    tensor where the wrap had offloaded a weight: resident beside a room planned without it (the
    next forward paged another weight in tiles, bits apart from the unwrapped model's), and on a GPU
    a host tensor in a model on the device. Now the weights are placed as an uninterrupted load
    places them, and the forward is the unwrapped model's with the values each weight holds."""
    reference = _bf16_stack()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    torch.manual_seed(1)
    new = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}
    old = {k: v.detach().clone() for k, v in reference.state_dict().items()}
    whole = _wrapped()
    whole.load_state_dict(new, assign=True)
    placed = [isinstance(p, ot.OffloadedTensor) for p in whole.parameters()]
    assert any(placed) and not all(placed)
    total = _points(lambda: _wrapped().load_state_dict(new, assign=True), _in_model_package)
    assert total > 500
    misplaced = []
    for n in range(1, total + 1, 46):
        model = _wrapped()
        _Points(n, _in_model_package).run(lambda: model.load_state_dict(new, assign=True))
        if [isinstance(p, ot.OffloadedTensor) for p in model.parameters()] != placed:
            misplaced.append(n)
            continue
        now = _values(model)
        assert all(torch.equal(now[k], old[k]) or torch.equal(now[k], new[k]) for k in now), n
        _runs_as(model, reference, now, x, n)
    assert not misplaced, f"weights left where the load swapped them in after interrupts at points {misplaced}"


class _PointsOutsideFinalizers(_Points):
    """``_Points`` outside the finalizer of the replaced weight's host master, where it dies (its
    points are ``test_interrupts_more.py``'s), and outside ``weakref.finalize``'s frames."""

    def _walked(self, frame) -> bool:
        return (frame is not None and frame.f_code is not Master._died.__code__
                and frame.f_code.co_filename != weakref.__file__ and super()._walked(frame))


@needs_311
def test_an_interrupt_at_any_point_of_a_weight_assignment_gives_the_users_tensor_back(young_heap):
    """``model[2].weight = w`` into a wrapped model (placement offloads ``w``, swapping an
    OffloadedTensor into the user's own Parameter object), a Ctrl-C at every 4th point of the model
    package: either the slot holds ``w`` or it holds the old weight, and then ``w`` is the user's
    as it was (a plain Parameter, the same values on the same device, no host master holding its
    bytes in ``offloaded_bytes``), the pager's resident count is the model's, and the forward is the
    unwrapped model's with the weight the slot holds, within the budget. A Ctrl-C at the placement's
    last step (the resident recount) rolled the slot back but left ``w`` an OffloadedTensor."""
    reference = _bf16_stack()
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    values = torch.randn(256, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def offloaded(model) -> int:
        return sum({p._master.id: p._master.nbytes for p in model.parameters() if isinstance(p, ot.OffloadedTensor)}.values())

    whole = _wrapped()
    whole[2].weight = torch.nn.Parameter(values.clone())
    assert isinstance(whole[2].weight, ot.OffloadedTensor)  # the placement offloads it
    model = _wrapped()
    total = _points(lambda: setattr(model[2], "weight", torch.nn.Parameter(values.clone())), _in_model_package)
    assert total > 100
    changed = []
    for n in range(1, total + 1, 4):
        model = _wrapped()
        pager = state_of(model).pager
        old = id(model[2].weight)  # (not the weight itself: its host master stays counted while it lives)
        w = torch.nn.Parameter(values.clone())
        _PointsOutsideFinalizers(n, _in_model_package).run(lambda: setattr(model[2], "weight", w))
        gc.collect()
        if model[2].weight is w:
            assert isinstance(w, ot.OffloadedTensor) and torch.equal(w.materialize(), values), n
        else:
            assert id(model[2].weight) == old, n
            if type(w) is not torch.nn.Parameter or w.device != values.device or not torch.equal(w, values):
                changed.append(n)
                continue
        assert pager.offloaded_bytes == offloaded(model), n
        assert pager.budget.resident_bytes == resident_bytes(model, pager.device), n
        if n % 5 == 1:
            _runs_as(model, reference, _values(model), x, n)
    assert not changed, f"the user's tensor changed by an assignment rolled back after interrupts at points {changed}"


@needs_311
def test_an_interrupt_in_an_assignment_of_another_models_weight_leaves_it_with_its_own_pager(young_heap):
    """``a[2].weight = b[2].weight``, an OffloadedTensor of another wrapped model, whose host master
    the placement moves to ``a``'s pager: a Ctrl-C at every 2nd point of the model package, the
    assignment rolled back, leaves that master with ``b``'s pager, each pager counting exactly the
    masters of its own model's weights. It had stayed on ``a``'s pager, counted there and not in ``b``'s."""
    def offloaded(model) -> int:
        return sum({p._master.id: p._master.nbytes for p in model.parameters() if isinstance(p, ot.OffloadedTensor)}.values())

    a, b = _wrapped(), _wrapped()
    total = _points(lambda: setattr(a[2], "weight", b[2].weight), _in_model_package)
    assert total > 50
    moved = []
    for n in range(1, total + 1, 2):
        a, b = _wrapped(), _wrapped()
        w = b[2].weight
        _PointsOutsideFinalizers(n, _in_model_package).run(lambda: setattr(a[2], "weight", w))
        gc.collect()
        if a[2].weight is not w:
            if w._master.pager is not state_of(b).pager:
                moved.append(n)
                continue
            assert state_of(a).pager.offloaded_bytes == offloaded(a), n
        assert state_of(b).pager.offloaded_bytes == offloaded(b) - (w._master.nbytes if a[2].weight is w else 0), n
    assert not moved, f"another model's weight left on this model's pager after interrupts at points {moved}"
