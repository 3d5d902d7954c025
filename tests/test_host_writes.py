"""Ops that write, on the host masters, where no slice of an offloaded tensor larger than the
budget's free room fits: an op that also writes some of its arguments (a training batch norm's
offloaded running statistics), each written back in one copy; an op whose only writes are its
out= arguments (``torch.mm(x, w.T, out=logits)``, as ``linear_cross_entropy``'s chunked backward
runs it); and a draw (``torch.multinomial``), which runs only where the host's generator is the
device's. Before, each raised ``BudgetError`` at a budget wrap had accepted."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot

aten = torch.ops.aten


@pytest.mark.parametrize("op", ["_native_batch_norm_legit", "_batch_norm_with_update"])
def test_a_training_batch_norm_of_an_offloaded_input_writes_its_offloaded_running_statistics(op, device):
    """A batch norm in training writes its running statistics in place and returns new tensors.
    With its input larger than the room and the statistics offloaded, no slice covers it and the
    last resort took only ops that write nothing: ``BudgetError``. On the host masters now, each
    statistic written back: torch's output and statistics, within the budget."""
    from offtensor.pager import Pager

    g = torch.Generator().manual_seed(0)
    x, weight, bias = torch.randn(2, 64, 3, 3, generator=g), torch.randn(64, generator=g), torch.randn(64, generator=g)
    mean, var = torch.randn(64, generator=g), torch.rand(64, generator=g) + 0.5
    pager = Pager(torch.device(device), budget_bytes=200)
    ox, omean, ovar = (ot.offload(t.clone(), device, pager=pager) for t in (x, mean, var))
    if op == "_native_batch_norm_legit":
        got = aten._native_batch_norm_legit(ox, weight.to(device), bias.to(device), omean, ovar, True, 0.3, 1e-5)
        want = aten._native_batch_norm_legit(x, weight, bias, mean, var, True, 0.3, 1e-5)
    else:
        got = aten._batch_norm_with_update(ox, weight.to(device), bias.to(device), omean, ovar, 0.3, 1e-5)
        want = aten._batch_norm_with_update(x, weight, bias, mean, var, 0.3, 1e-5)
    close = torch.equal if device == "cpu" else (lambda a, b: torch.allclose(a, b, atol=1e-5))
    assert all(close(a.cpu(), b) for a, b in zip(got, want) if a.numel())
    assert close(omean.materialize().cpu(), mean) and close(ovar.materialize().cpu(), var)
    assert pager.stats.host_ops == 1 and pager.stats.peak_device_bytes <= 200


def test_an_out_op_with_a_weight_larger_than_the_room_runs_on_the_host_into_its_out(device):
    """``torch.mm(x, w.T, out=logits)``, as ``linear_cross_entropy``'s chunked backward computes its
    logits: with ``w`` larger than the room, the out= form had no slices and no host form (only
    the out= forms of the ops named on the host had one): ``BudgetError``. Now any op whose only
    writes are its out= arguments runs there, torch's values in ``out``; and the loss's gradients
    with a chunking option are the unwrapped ones."""
    from offtensor.pager import Pager

    g = torch.Generator().manual_seed(0)
    x, w, target = torch.randn(8, 16, generator=g), torch.randn(32, 16, generator=g), torch.randint(0, 32, (8,), generator=g)
    pager = Pager(torch.device(device), budget_bytes=1024)
    ow = ot.offload(w.clone(), device, pager=pager)
    out = torch.empty(8, 32, device=device)
    assert torch.mm(x.to(device), ow.T, out=out) is out
    close = torch.equal if device == "cpu" else (lambda a, b: torch.allclose(a, b, atol=1e-5))
    assert close(out.cpu(), x @ w.T) and pager.stats.host_ops == 1
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=2) if hasattr(nn, "LinearCrossEntropyOptions") else None
    if options is None:
        pytest.skip("torch has no linear_cross_entropy options")
    xs = x.to(device).requires_grad_()
    ow.requires_grad_()
    loss = F.linear_cross_entropy(xs, ow, target.to(device), reduction="none", options=options)
    plain_x, plain_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    want = F.linear_cross_entropy(plain_x, plain_w, target, reduction="none", options=options)
    grads = torch.autograd.grad(loss.sum(), (xs, ow))
    wants = torch.autograd.grad(want.sum(), (plain_x, plain_w))
    assert close(loss.detach().cpu(), want.detach())
    for got, expected in zip(grads, wants):
        got = got.materialize() if isinstance(got, ot.OffloadedTensor) else got
        assert close(got.cpu(), expected)
    assert pager.stats.peak_device_bytes <= 1024


def test_an_interrupt_at_any_point_of_a_batch_norm_on_the_host_leaves_each_statistic_whole_or_written(device):
    """Each running statistic is written back in one copy: a Ctrl-C anywhere in the op leaves the
    running mean as it was or as written, and the next batch norm runs."""
    from offtensor.pager import Pager
    from test_interrupts_more import _whole_or_written

    g = torch.Generator().manual_seed(0)
    x, mean, var = torch.randn(2, 64, 3, 3, generator=g), torch.randn(64, generator=g), torch.rand(64, generator=g) + 0.5
    pager = Pager(torch.device(device), budget_bytes=200)
    ox, omean, ovar = (ot.offload(t.clone(), device, pager=pager) for t in (x, mean, var))
    after = mean.clone()
    aten._batch_norm_with_update(x, None, None, after, var.clone(), 0.3, 1e-5)

    def run():
        aten._batch_norm_with_update(ox, None, None, omean, ovar, 0.3, 1e-5)

    def ours(code) -> bool:
        return "offtensor" in code.co_filename and "ops" in code.co_filename

    def next_runs(n):
        with torch.no_grad():
            omean.copy_(mean.to(device))
        run()
        got = omean.materialize().cpu()
        assert torch.equal(got, after) if device == "cpu" else torch.allclose(got, after, atol=1e-6), n

    assert _whole_or_written(omean, mean.to(device), after.to(device), run, ours, each=next_runs) > 5
    assert pager.stats.peak_device_bytes <= 200


def test_a_draw_from_an_offloaded_table_larger_than_the_room_runs_only_where_the_hosts_generator_is_the_devices(device):
    """``torch.multinomial`` of a probability table larger than the room has no slices: on its host
    master, the draw comes from the host's generator. On the emulated device that is the device's
    own, so the draw is the unwrapped one under the same seed; on a GPU it would be another stream
    than the device's, so it is refused (it was computed there without a word)."""
    from offtensor.pager import Pager

    probs = torch.rand(64, 128, generator=torch.Generator().manual_seed(0))
    pager = Pager(torch.device(device), budget_bytes=8192)
    offloaded = ot.offload(probs.clone(), device, pager=pager)
    if device != "cpu":
        with pytest.raises(ot.BudgetError, match="32768"):
            torch.multinomial(offloaded, 3)
        return
    torch.manual_seed(7)
    got = torch.multinomial(offloaded, 3)
    torch.manual_seed(7)
    assert torch.equal(got, torch.multinomial(probs, 3)) and pager.stats.host_ops == 1
