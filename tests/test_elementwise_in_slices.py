"""Elementwise ops on a weight larger than the budget's free room run in slices of it: fills and the
random fills ``nn.init`` makes in place, a cast (``.to(dtype)``, ``.half()``, autocast's), and
``cat`` / ``stack`` of such a weight (``parameters_to_vector``). Before, each paged the weight whole
and raised ``BudgetError`` at a budget wrap had accepted (placement counts a linear's weight at its
tile), so ``model.apply(init_weights)``, a head's reset or a forward under ``torch.autocast`` with
grad on failed on a wrapped model that ran without them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import offtensor as ot

GiB = 1024**3


def _build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))


def _pair(device):
    """(an unwrapped model, the same model wrapped with every weight offloaded at a budget whose
    room holds 16-row tiles of its middle weight (bit-identical tiles) but not the weight whole)."""
    model = _build()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no narrow-tile warning: its forward is the unwrapped one's)
        ot.wrap_model(model, budget_gb=64 * 1024 / GiB, device=device, policy={"offload": ["*"]})
    big = model[2].weight
    assert big.numel() * big.element_size() > big._master.pager.free_bytes()  # (what the test is about)
    return _build().to(device), model


def _quiet(fn, *args):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


FILLS = {
    "zero_": lambda w: w.zero_(),
    "fill_": lambda w: w.fill_(0.25),
    "fill_ from a 0-dim tensor": lambda w: w.fill_(torch.tensor(0.5, device=w.device)),
    "masked_fill_": lambda w: w.masked_fill_(torch.arange(w.numel(), device=w.device).view(w.shape) % 3 == 0, -1.0),
    "nn.init.zeros_": nn.init.zeros_,
    "nn.init.constant_": lambda w: nn.init.constant_(w, 0.125),
    "nn.init.eye_": nn.init.eye_,
}


@pytest.mark.parametrize("name", sorted(FILLS))
def test_a_fill_of_a_weight_larger_than_the_room_writes_every_element_as_torch_does(name, device):
    reference, model = _pair(device)
    x = torch.randn(5, 64, device=device)
    with torch.no_grad():
        FILLS[name](reference[2].weight)
        FILLS[name](model[2].weight)
    assert torch.equal(model[2].weight.cpu(), reference[2].weight.cpu())
    with torch.no_grad():
        assert torch.equal(_quiet(model, x), reference(x))


RANDOM = {
    "uniform_": (lambda w: w.uniform_(2.0, 3.0), 2.0, 3.0),
    "normal_": (lambda w: w.normal_(10.0, 0.5), 5.0, 15.0),
    "bernoulli_": (lambda w: w.bernoulli_(0.5).add_(4.0), 4.0, 5.0),
    "exponential_": (lambda w: w.exponential_(1.0).add_(6.0), 6.0, float("inf")),
    "nn.init.kaiming_uniform_": (lambda w: nn.init.kaiming_uniform_(w).add_(7.0), 6.8, 7.2),
    "nn.init.trunc_normal_": (lambda w: nn.init.trunc_normal_(w, mean=8.0, std=0.02, a=7.9, b=8.1), 7.9, 8.1),
}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_a_random_fill_of_a_weight_larger_than_the_room_draws_every_element_and_says_so(name, device):
    # Every element drawn (the range lies outside the weight's old values, so one left out shows),
    # from one seed: the same values twice. Drawn slice by slice, they are the distribution's but
    # not, on a GPU, the values one draw of the whole gives: a warning names the weight.
    fill, low, high = RANDOM[name]
    drawn = []
    for _ in range(2):
        _, model = _pair(device)
        torch.manual_seed(3)
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            fill(model[2].weight)
        values = model[2].weight.detach().cpu()
        assert bool(((values >= low) & (values <= high)).all()), name
        assert values.unique().numel() > 1
        assert any("'2.weight'" in str(w.message) and "slice by slice" in str(w.message) for w in caught), \
            [str(w.message) for w in caught]
        drawn.append(values)
    assert torch.equal(drawn[0], drawn[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_a_cast_of_a_weight_larger_than_the_room_is_torchs_cast(dtype, device):
    reference, model = _pair(device)
    with torch.no_grad():  # (with grad on, a lazy cast: tests/test_autocast.py)
        got = model[2].weight.to(dtype)
    assert type(got) is torch.Tensor and got.dtype == dtype and got.device.type == torch.device(device).type
    assert torch.equal(got.cpu(), reference[2].weight.to(dtype).cpu())
    assert torch.equal(model[2].weight.detach().half().cpu(), reference[2].weight.detach().half().cpu())


def test_cat_stack_and_parameters_to_vector_of_a_weight_larger_than_the_room(device):
    reference, model = _pair(device)
    w, r = model[2].weight, reference[2].weight
    assert torch.equal(torch.cat([w.view(-1), w[0]]).cpu(), torch.cat([r.view(-1), r[0]]).cpu())
    assert torch.equal(torch.stack([w, w.t()]).cpu(), torch.stack([r, r.t()]).cpu())
    got = nn.utils.parameters_to_vector(model.parameters())
    assert torch.equal(got.cpu(), nn.utils.parameters_to_vector(reference.parameters()).cpu())


def test_model_apply_of_an_init_function_runs_on_a_wrapped_model(device):
    reference, model = _pair(device)

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.bias)
            nn.init.constant_(module.weight, 0.01)

    reference.apply(init)
    model.apply(init)
    x = torch.randn(3, 64, device=device)
    with torch.no_grad():
        assert torch.equal(_quiet(model, x), reference(x))


def test_autocast_with_grad_on_runs_a_weight_larger_than_the_room(device):
    # Under autocast with grad on, torch casts each weight whole before the op (a linear's cast of
    # its fp32 weight to bfloat16): that cast runs in slices. Forward and gradients match the
    # unwrapped model's under the same autocast.
    reference, model = _pair(device)
    x = torch.randn(6, 64, device=device)
    kind = torch.device(device).type
    outs = []
    for m in (reference, model):
        with torch.autocast(kind, dtype=torch.bfloat16):
            y = _quiet(m, x)
        _quiet(lambda: y.float().square().sum().backward())
        outs.append(y)
    assert outs[0].dtype == outs[1].dtype == torch.bfloat16
    assert torch.equal(outs[0], outs[1])
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad.cpu(), q.grad.cpu()), name


@pytest.mark.parametrize("n", [64, 100, 20])
def test_a_half_precision_step_in_slices_is_the_whole_ops_or_warns(n, device):
    """The CPU adds a bfloat16 ``alpha * grad`` in a vectorised loop over 64-element blocks and a
    scalar loop over the rest, and the two round otherwise (one element in a few hundred): slices of
    whole blocks give the whole op's result (a 100 x 100 weight: 16-row slices, not 75-row ones);
    where the room holds no whole block of rows (20 x 20), a warning names the weight."""
    from offtensor.pager import Pager

    torch.manual_seed(0)
    weight, grad = torch.randn(n, n).bfloat16(), torch.randn(n, n).bfloat16().to(device)
    pager = Pager(torch.device(device), budget_bytes=weight.numel() * 2 * 3 // 4)
    offloaded = ot.offload(weight.clone(), device, pager=pager)
    plain = weight.clone().to(device)
    aligned = n * 16 * 2 <= pager.free_bytes()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        offloaded.add_(grad, alpha=-0.7)
    plain.add_(grad, alpha=-0.7)
    ours = [w for w in caught if "offtensor" in str(w.message)]
    if aligned or device != "cpu":
        assert not ours and torch.equal(offloaded.materialize(), plain)
    else:
        assert "vector blocks" in str(ours[0].message)
        torch.testing.assert_close(offloaded.materialize(), plain)


OVERLAPS = {
    # name: (op, whether torch refuses it on the plain weight)
    "add_(w.t())": (lambda w: w.add_(w.t()), True),
    "addcmul_(w.t(), w)": (lambda w: w.addcmul_(w.t(), w), True),
    "add_(w[0])": (lambda w: w.add_(w[0]), True),
    "mul_(w)": (lambda w: w.mul_(w), False),
    "add_(w[:])": (lambda w: w.add_(w[:]), False),
    "w[:128].sub_(w[128:])": (lambda w: w[:128].sub_(w[128:]), False),
}


@pytest.mark.parametrize("name", sorted(OVERLAPS))
def test_an_in_place_op_in_slices_reading_the_written_weight_runs_or_is_refused_as_torch_does(name, device):
    """Torch refuses an argument that covers part of the written tensor's bytes other than as the
    same view (``w.add_(w.t())``). In slices, each would read elements already written: before,
    such an op ran and wrote neither torch's refusal nor ``w + w.t()``. Now it is refused with
    torch's message, the weight whole; the same view, or disjoint halves, run bit for bit."""
    plain, model = _pair(device)
    op, refused = OVERLAPS[name]
    w, before = model[2].weight, plain[2].weight.detach().clone()
    with torch.no_grad():
        if refused:
            with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
                op(plain[2].weight)
            with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
                op(w)
            assert torch.equal(w.materialize(), before)
        else:
            _quiet(op, w)
            op(plain[2].weight)
            assert torch.equal(w.materialize(), plain[2].weight)
