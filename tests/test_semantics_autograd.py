"""OffloadedTensor semantics, the table's autograd rows (docs/design.md, "The tensor and its
semantics"): gradients flow to inputs through frozen offloaded weights, backward pages again
instead of keeping copies, and a trainable offloaded parameter gets its gradient and an optimizer
step writes through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor

from test_semantics import counters, fresh_pager, host_values, nbytes


# ------------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------------


def test_gradients_flow_to_inputs_through_frozen_offloaded_weights(device):
    torch.manual_seed(0)
    weight, bias, other = torch.randn(5, 3), torch.randn(5), torch.randn(5, 5)
    frozen = [ot.offload(t, device=device) for t in (weight, bias, other)]
    plain = [t.to(device) for t in (weight, bias, other)]
    inputs = torch.randn(2, 3, device=device)

    def forward(w, b, o, x):
        hidden = F.linear(x, w, b).relu()
        return (hidden @ o.t()).softmax(-1)[:, 0].sum() + (hidden * o[1:3, :]).sum()

    x_off = inputs.clone().requires_grad_()
    forward(*frozen, x_off).backward()
    x_ref = inputs.clone().requires_grad_()
    forward(*plain, x_ref).backward()
    torch.testing.assert_close(x_off.grad, x_ref.grad)
    assert all(f.grad is None for f in frozen)


def _saved_tensors(grad_fn, seen=None):
    """Every tensor the autograd graph below ``grad_fn`` saved for backward."""
    seen = set() if seen is None else seen
    if grad_fn is None or grad_fn in seen:
        return []
    seen.add(grad_fn)
    found = []
    for name in dir(grad_fn):
        if name.startswith("_saved_"):
            value = getattr(grad_fn, name)
            if isinstance(value, torch.Tensor):
                found.append(value)
    for next_fn, _ in grad_fn.next_functions:
        found += _saved_tensors(next_fn, seen)
    return found


def test_backward_pages_again_instead_of_keeping_copies(device):
    weight = torch.randn(6, 4)
    pager = fresh_pager(device)
    frozen = ot.offload(weight, pager=pager)
    inputs = torch.randn(3, 4, device=device, requires_grad=True)
    before = counters(pager)
    out = F.linear(inputs, frozen).tanh().sum()
    forward_bytes = counters(pager)[1] - before[1]
    assert forward_bytes == nbytes(weight)
    # The graph holds the OffloadedTensor (a view of the host master), never a device copy of it.
    saved_weights = [t for t in _saved_tensors(out.grad_fn) if t.numel() == weight.numel()]
    assert saved_weights and all(isinstance(t, OffloadedTensor) for t in saved_weights)
    assert pager.paged_bytes == 0
    out.backward()
    assert counters(pager)[1] - before[1] == 2 * nbytes(weight)
    expected = inputs.detach().clone().requires_grad_()
    F.linear(expected, weight.to(device)).tanh().sum().backward()
    torch.testing.assert_close(inputs.grad, expected.grad)


@pytest.mark.parametrize(
    "optimizer_name, options",
    [
        ("SGD", {"lr": 0.1}),
        ("SGD", {"lr": 0.1, "momentum": 0.9, "foreach": True}),
        ("AdamW", {"lr": 0.05}),
        ("AdamW", {"lr": 0.05, "foreach": True}),
    ],
    ids=["sgd", "sgd-momentum-foreach", "adamw", "adamw-foreach"],
)
def test_trainable_offloaded_parameter_gets_grad_and_optimizer_writes_through(device, optimizer_name, options):
    torch.manual_seed(0)
    weight, bias = torch.randn(4, 3), torch.randn(4)
    plain = [nn.Parameter(weight.to(device)), nn.Parameter(bias.to(device))]
    offloaded = [nn.Parameter(ot.offload(weight, device=device)), nn.Parameter(ot.offload(bias, device=device))]
    aliases = [offloaded[0].t(), offloaded[1][1:]]  # e.g. a tied view elsewhere in a model
    optimizers = [getattr(torch.optim, optimizer_name)(ps, **options) for ps in (plain, offloaded)]
    for _ in range(3):
        inputs = torch.randn(2, 3, device=device)
        for params, optimizer in zip((plain, offloaded), optimizers):
            optimizer.zero_grad()
            F.linear(inputs, *params).pow(2).sum().backward()
            optimizer.step()
        for p, q in zip(plain, offloaded):
            assert type(q.grad) is torch.Tensor and q.grad.device == q.device
            torch.testing.assert_close(q.grad, p.grad)
    for p, q in zip(plain, offloaded):
        assert isinstance(q, OffloadedTensor) and isinstance(q, nn.Parameter)
        torch.testing.assert_close(host_values(q), p.detach().cpu())
    torch.testing.assert_close(host_values(aliases[0]), plain[0].detach().cpu().t())
    torch.testing.assert_close(host_values(aliases[1]), plain[1].detach().cpu()[1:])
