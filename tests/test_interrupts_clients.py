"""Ctrl-C in the flows real clients run over a wrapped model, where the other interrupt tests do not
walk: peft's LoRA training step and ``merge_and_unload``, diffusers' UNet2DConditionModel, torchao's
int8 weight-only forward, MoE ``generate``, ``torch.compile(backend="aot_eager")``,
``ot.from_pretrained``, ``unwrap_model``, a DTensor-sharded forward and a cast of the model after
wrapping were swept at sampled points; what lost something is tested here.

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
- ``copy.deepcopy`` of a wrapped model, cut short at the entry of a ``torch.no_grad()``'s exit
  in an offloaded tensor's copy, left grad off too; it puts it back the same way.

Interrupts are raised where CPython raises a signal handler's exception (``_Points``).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch

import offtensor as ot
from offtensor.model import casts
from offtensor.model.copies import state_of

from test_interrupts_more import _Points, _points

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
