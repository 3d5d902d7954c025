"""Budgets near the smallest one ``wrap_model`` accepts, for weights assigned after wrapping
(``module.weight = ...``, ``load_state_dict(assign=True)``, a submodule swapped in): each budget
either refuses the assignment, naming it and its bytes and changing nothing, or runs the changed
model bit for bit within the budget. The readers are test_budget_fuzz.py's."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot

from test_budget_fuzz import _OwnProduct, _OwnReader, _smallest_accepted

GiB = 1 << 30


# ---------------------------------------------------------------------------- assigned after wrapping
# A weight assigned into a wrapped model later (``module.weight = ...``, ``load_state_dict(assign=True)``,
# a submodule swapped in) was checked on its own, not with its module's other offloaded weights: an
# LSTM's weights (read whole, all in one kernel), a grouped convolution's tile of its weight with its
# bias, or w1 and w2 of a module
# that multiplies them, were each accepted where together they did not fit, and the next forward
# raised BudgetError. Each budget below must either refuse an assignment, naming it and its bytes and
# changing nothing, or run the changed model bit for bit within the budget.


class _Holder(nn.Module):
    """One module of each kind, so a swapped-in submodule has a parent to be assigned into."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        y = self.inner(x)
        return y[0] if isinstance(y, tuple) else y


def _tensor(*shape, dtype=torch.float32, seed=1):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) / 8).to(dtype)


def _setter(path: str, make):
    """A step assigning ``make()`` (moved to the step's device) as the Parameter at ``path``."""
    def step(model, device):
        owner, _, attr = path.rpartition(".")
        setattr(model.get_submodule(owner), attr, nn.Parameter(make().to(device)))
    return step


def _swap_in(make):
    def step(model, device):
        torch.manual_seed(5)  # the same new submodule for the model and its reference
        step.made = make().to(device)
        model.inner = step.made
    return step


def _load_as(dtype):
    """load_state_dict(assign=True) of the model's own values at a wider dtype: same shapes, more bytes."""
    def step(model, device):
        state = {k: _tensor(*v.shape, dtype=dtype, seed=i).to(device)
                 for i, (k, v) in enumerate(model.state_dict().items())}
        model.load_state_dict(state, assign=True)
    return step


def _wide_product(product: str, inner: int) -> nn.Module:
    module = _OwnProduct(product)
    module.w1, module.w2 = nn.Parameter(_tensor(48, inner)), nn.Parameter(_tensor(inner, 80, seed=2))
    return module


def _lstm(i, h):
    torch.manual_seed(0)
    return nn.LSTM(i, h)


ASSIGNED = {
    # name: (model, steps, input)
    "linear": (lambda: _Holder(nn.Linear(16, 16)),
               [_setter("inner.weight", lambda: _tensor(64, 16)), _setter("inner.bias", lambda: _tensor(64, seed=2))],
               lambda: _tensor(3, 16, seed=3)),
    "conv": (lambda: _Holder(nn.Conv2d(4, 8, 3)),
             [_setter("inner.weight", lambda: _tensor(32, 4, 3, 3)), _setter("inner.bias", lambda: _tensor(32, seed=2))],
             lambda: _tensor(2, 4, 6, 6, seed=3)),
    "grouped conv": (lambda: _Holder(nn.Conv2d(4, 8, 3, groups=2)),
                     [_setter("inner.weight", lambda: _tensor(32, 2, 3, 3)),
                      _setter("inner.bias", lambda: _tensor(32, seed=2))],
                     lambda: _tensor(2, 4, 6, 6, seed=3)),
    "lstm swapped in": (lambda: _Holder(_lstm(8, 8)), [_swap_in(lambda: _lstm(8, 24))], lambda: _tensor(5, 2, 8, seed=3)),
    "lstm loaded as float64": (lambda: _Holder(_lstm(8, 16)), [_load_as(torch.float64)],
                               lambda: _tensor(5, 2, 8, dtype=torch.float64, seed=3)),
    "product": (lambda: _OwnProduct("mm"),
                [_setter("w1", lambda: _tensor(48, 1024)), _setter("w2", lambda: _tensor(1024, 80, seed=2))],
                lambda: _tensor(3, 48, seed=3)),
    "product swapped in": (lambda: _Holder(_OwnProduct("mm")), [_swap_in(lambda: _wide_product("einsum", 1024))],
                           lambda: _tensor(3, 48, seed=3)),
    "product loaded as float64": (lambda: _OwnProduct("mm"), [_load_as(torch.float64)],
                                  lambda: _tensor(3, 48, dtype=torch.float64, seed=3)),
    "own conv3d": (lambda: _OwnReader("conv3d"),
                   [_setter("w", lambda: _tensor(32, 4, 3, 3, 3)), _setter("b", lambda: _tensor(32, seed=2))],
                   lambda: _tensor(2, 4, 5, 6, 5, seed=3)),
}


def _assign_then_run(build, steps, make_x, budget: int, device, policy=None) -> str:
    """Wrap ``build()`` at ``budget`` bytes, every weight offloaded, take ``steps``; then the
    outcome: "refused" (an assignment raised BudgetError naming a weight and bytes, and changed
    nothing) or "ran" (forward and backward as the unwrapped model, changed alike, within budget)."""
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model).to(device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy=policy or {"offload": ["*"]})
        for step in steps:
            before = {n: t for n, t in (*model.named_parameters(), *model.named_buffers())}
            modules = set(model.modules())
            try:
                step(model, "cpu")
            except (ot.BudgetError, RuntimeError) as e:
                assert re.search(r"offtensor: .*'?\w[\w.]*'? \(\d+ bytes\).* needs \d+ bytes", str(e)), str(e)
                after = {n: t for n, t in (*model.named_parameters(), *model.named_buffers())}
                # load_state_dict goes on past a key it could not load: those keys are left as they were
                refused = re.findall(r'parameter named "([\w.]+)"', str(e)) or list(before)
                assert after.keys() == before.keys() and all(after[n] is before[n] for n in refused), str(e)
                assert set(model.modules()) == modules
                made = getattr(step, "made", None)  # a submodule refused: left as it was, not wrapped
                if made is not None:
                    assert not any(isinstance(t, ot.OffloadedTensor) for t in made.parameters())
                    assert all("_offtensor_user_class" not in type(m).__dict__ for m in made.modules())
                return "refused"
            step(reference, device)
        x = make_x().to(device)
        out, expected = model(x), reference(x)
        out.square().sum().backward()
        expected.square().sum().backward()
    exact = not any("in the last bits" in str(w.message) for w in caught)
    pairs = [(out, expected)] + [(p.grad, q.grad) for p, q in zip(model.parameters(), reference.parameters())
                                 if p.grad is not None or q.grad is not None]  # a kept weight forward does not read
    for got, want in pairs:
        if exact:
            assert torch.equal(got, want), budget
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes, budget
    return "ran"


def _assigned_budgets(case: str, device) -> tuple:
    """(the smallest budget wrap accepts, the bytes of the whole model after the steps) of an
    ASSIGNED case, in bytes."""
    build, steps, _ = ASSIGNED[case]
    smallest = _smallest_accepted(build, 10**7, device)
    changed = build()
    for step in steps:
        step(changed, "cpu")
    return smallest, sum(t.numel() * t.element_size() for t in (*changed.parameters(), *changed.buffers()))


@pytest.mark.parametrize("case", list(ASSIGNED))
def test_a_weight_assigned_after_wrapping_runs_or_is_refused_at_every_budget_wrap_accepts(case, device):
    build, steps, make_x = ASSIGNED[case]
    smallest, whole = _assigned_budgets(case, device)
    outcomes = {}
    evenly = range(smallest, whole + 1, max(1, (whole - smallest) // 12))
    doubling = (smallest << k for k in range(16) if smallest << k < whole)
    for budget in sorted({*evenly, *doubling, whole}):
        outcomes[budget] = _assign_then_run(build, steps, make_x, budget, device)
    assert outcomes[whole] == "ran", outcomes


@pytest.mark.parametrize("case", ["lstm", "grouped conv", "product"])
def test_a_kept_weight_assigned_after_wrapping_leaves_room_for_each_modules_weights_together(case, device):
    # A weight the policy keeps resident shrinks the room, and the room was planned again for each
    # offloaded weight alone: an LSTM's four weights (one kernel reads them all), a grouped
    # convolution's tile of its weight and its bias, or a tile of each of w1 and w2 of ``w1 @ w2`` then did not fit
    # together, and forward raised BudgetError.
    inner = {"lstm": lambda: _lstm(8, 16), "grouped conv": lambda: nn.Conv2d(4, 32, 3, groups=2),
             "product": lambda: _wide_product("mm", 1024)}[case]
    make_x = {"lstm": lambda: _tensor(5, 2, 8, seed=3), "grouped conv": lambda: _tensor(2, 4, 6, 6, seed=3),
              "product": lambda: _tensor(3, 48, seed=3)}[case]

    def build():
        torch.manual_seed(0)
        return _Holder(inner())

    whole = sum(p.numel() * 4 for p in build().parameters())
    outcomes = {}
    for kept in range(4, whole, max(4, whole // 64 // 4 * 4)):
        step = _setter("extra", lambda: _tensor(kept // 4, seed=4))
        outcomes[kept] = _assign_then_run(build, [step], make_x, whole + 4, device,
                                          policy={"keep": ["extra"], "offload": ["*"]})
    assert outcomes[4] == "ran", outcomes


def test_a_submodule_refused_part_way_through_its_tensors_is_left_as_it_was(device):
    # A swapped-in submodule's tensors are placed one by one: those placed before one was refused
    # stayed offloaded (or moved onto the device) and its modules stayed wrapped, though the
    # submodule was never attached. Now the refusal puts every one of them back.
    def build(hidden):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), _lstm(8, hidden))

    model = _Holder(build(8))
    lstm_bytes = sum(p.numel() * 4 for p in model.inner[1].parameters())
    budget = 8 * 8 * 4 + 8 * 4 + lstm_bytes  # the kept Linear and the LSTM's weights together
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"keep": ["inner.0.*"], "offload": ["*"]})
    old = model.inner
    fresh = build(12)  # its first LSTM weight fits the room, the first two do not
    before = {name: (t, t.device, t.data_ptr()) for name, t in fresh.named_parameters()}
    with pytest.raises(ot.BudgetError, match=r"inner\.1\.weight_hh_l0 \(2304 bytes\) needs 3840 bytes .* module 'inner\.1'"):
        model.inner = fresh
    assert model.inner is old
    assert {name: (t, t.device, t.data_ptr()) for name, t in fresh.named_parameters()} == before
    assert all("_offtensor_user_class" not in type(m).__dict__ for m in fresh.modules())
    x = _tensor(5, 2, 8, seed=3)
    assert torch.equal(fresh(x)[0], build(12)(x)[0])  # the refused submodule still runs as it did


class _OwnWeightAndChildren(nn.Module):
    """A module with a weight of its own beside two children: torch loads its own keys first, its
    children's next, and runs its load post-hook last."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64))
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        return self.b(self.a(x @ self.w))


@pytest.mark.parametrize("fraction", [0.45, 0.6, 0.75])
def test_an_assigned_load_that_swaps_places_as_one_that_assigns(fraction):
    """``load_state_dict(new, assign=True)`` under ``set_swap_module_params_on_conversion(True)``
    (torch swaps each incoming tensor into its Parameter object; the module's post-hook places it)
    places every weight as the same load without it does, and runs bit for bit within the budget.
    A parent's own incoming weight, not yet placed while its children were, had counted as resident
    beside them: at 0.45 and 0.6 of the weights the load was refused with a BudgetError naming a
    child's weight, and at 0.75 it offloaded the parent's weight instead of a child's."""
    torch.manual_seed(0)
    reference = _OwnWeightAndChildren()
    budget = fraction * sum(p.numel() * p.element_size() for p in reference.parameters()) / GiB
    new = {k: torch.randn_like(v) for k, v in reference.state_dict().items()}
    x = torch.randn(2, 64)
    placed = {}
    before = torch.__future__.get_swap_module_params_on_conversion()
    try:
        for swap in (False, True):
            torch.__future__.set_swap_module_params_on_conversion(swap)
            model = copy.deepcopy(reference)
            ot.wrap_model(model, budget_gb=budget, device="cpu")
            model.load_state_dict(new, assign=True)
            placed[swap] = [isinstance(p, ot.OffloadedTensor) for p in model.parameters()]
            loaded = copy.deepcopy(reference)
            loaded.load_state_dict(new)
            with torch.no_grad():
                assert torch.equal(model(x), loaded(x)), swap
            s = ot.stats(model)
            assert s.peak_device_bytes <= s.budget_bytes, (swap, s)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)
    assert placed[True] == placed[False]
