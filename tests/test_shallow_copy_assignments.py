"""Weights assigned through a shallow copy of a wrapped model (``copy.copy``: the same modules and
weights under a second name): placed, named, counted and refused exactly as through the original,
at every budget wrap accepts, whether they land in the copy's own top-level module or a submodule,
by attribute, ``setattr``, ``register_parameter``, ``register_buffer``, ``load_state_dict(assign=True)``
or a swapped-in submodule."""

from __future__ import annotations

import copy
import gc
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.model.copies import state_of
from test_budget_fuzz_assigned import ASSIGNED, _assign_then_run, _assigned_budgets

GiB = 1 << 30


def _placement(model: nn.Module) -> tuple:
    """Where each weight of ``model`` went and what the wrap counts: what two names must agree on.
    Masters of replaced weights are counted until they die, and a wrap's placement leaves cycles
    (a BudgetError it caught, trying a budget whole first, holds its frames): collected first."""
    gc.collect()
    where = tuple((name, isinstance(t, ot.OffloadedTensor), str(t.device), tuple(t.shape), t.dtype)
                  for name, t in (*model.named_parameters(), *model.named_buffers()))
    s = ot.stats(model)
    return where, s.offloaded_bytes, s.resident_bytes, state_of(model).working_set_bytes


def _recording(step, through_copy: bool, seen: list):
    """``step`` taken on ``copy.copy(model)`` (or on ``model``), noting the wrapped model it changed."""
    def taken(model, device):
        if not seen:  # the wrapped model takes each step before its unwrapped reference does
            seen.append(model)
        try:
            step(copy.copy(model) if through_copy else model, device)
        finally:
            taken.made = getattr(step, "made", None)
    return taken


@pytest.mark.parametrize("case", list(ASSIGNED))
def test_weights_assigned_through_a_shallow_copy_are_placed_as_through_the_original_at_every_budget(case, device):
    # A shallow copy has its own class back (a wrapped module's class pickles and copies as the
    # user's), so what was assigned into its own top-level module went through nn.Module's own
    # __setattr__: a weight larger than the room stayed resident, uncounted, where the original
    # offloads it or refuses it naming the bytes (the product cases: w1 and w2 of the model itself).
    build, steps, make_x = ASSIGNED[case]
    smallest, whole = _assigned_budgets(case, device)
    # The smallest budget, one between and the whole model: test_budget_fuzz_assigned walks the budgets in
    # between for the original; here each is taken twice (original and copy), so three stand for them.
    for budget in sorted({smallest, (smallest + whole) // 2, whole}):
        outcomes = []
        for through_copy in (False, True):
            seen = []
            outcome = _assign_then_run(build, [_recording(s, through_copy, seen) for s in steps], make_x, budget,
                                       device)
            outcomes.append((outcome, _placement(seen[0])))
        assert outcomes[1] == outcomes[0], (budget, outcomes)


class _Own(nn.Module):
    """A model holding a weight of its own beside a submodule: ``(x @ w) -> layer``."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(64, 64) / 8)
        self.layer = nn.Linear(64, 64)

    def forward(self, x):
        y = self.layer(x @ self.w)
        extra = self._parameters.get("extra", self._buffers.get("extra"))
        return y if extra is None else y + extra.sum()


def _assign(how: str, model: nn.Module, t: torch.Tensor, where: str) -> None:
    module = model if where == "root" else model.layer
    name = "w" if where == "root" else "weight"
    if how == "attribute":
        setattr(module, name, nn.Parameter(t))
    elif how == "register_parameter":
        module.register_parameter("extra" if where == "root" else name, nn.Parameter(t))
    elif how == "register_buffer":
        module.register_buffer("extra", t)
    elif how == "load_state_dict":
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        state["w" if where == "root" else "layer.weight"] = t
        model.load_state_dict(state, assign=True)
    elif how == "submodule":
        torch.manual_seed(3)  # the same bias for the model and its reference
        fresh = nn.Linear(64, 64).to(t.device)
        with torch.no_grad():
            fresh.weight.copy_(t)
        if where == "root":
            model.layer = fresh
        else:
            model.layer.inner = fresh  # a submodule of a submodule, through the copy's (shared) module


@pytest.mark.parametrize("where", ["root", "submodule"])
@pytest.mark.parametrize("how", ["attribute", "register_parameter", "register_buffer", "load_state_dict", "submodule"])
def test_each_way_of_assigning_through_a_shallow_copy_places_and_refuses_as_the_original(how, where, device):
    budget = 64 * 64 * 4 + 4096  # room for one 64 x 64 float weight (and the bias): the rest offloaded
    results = []
    for through_copy in (False, True):
        torch.manual_seed(0)
        model = _Own()
        reference = copy.deepcopy(model).to(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # narrow tiles: what is compared here is the placement
            ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})
            name = copy.copy(model) if through_copy else model
            before = _placement(model)
            if how == "register_buffer":  # past the room even in tiles of one slice: refused, nothing changed
                with pytest.raises(ot.BudgetError, match=r"extra \(4194304 bytes\) needs"):
                    _assign(how, name, torch.randn(64, 16384), where)
                assert _placement(model) == before
            fits = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)) / 8
            _assign(how, name, fits, where)
            _assign(how, reference, fits.to(device), where)
            x = torch.randn(3, 64, device=device)
            with torch.no_grad():
                assert torch.equal(model(x), reference(x))
            results.append(_placement(model))
            s = ot.stats(model)
            assert s.peak_device_bytes <= s.budget_bytes
    assert results[1] == results[0]


def test_a_shallow_copy_gets_its_own_class_back_with_the_original_and_places_nothing_after(device):
    torch.manual_seed(0)
    model = _Own()
    ot.wrap_model(model, budget_gb=(64 * 64 * 4 + 4096) / GiB, device=device, policy={"offload": ["*"]})
    twin, layer_twin = copy.copy(model), copy.copy(model.layer)
    layer_twin.weight = nn.Parameter(torch.randn(64, 64))  # a copy of a submodule places into the model too
    assert isinstance(model.layer.weight, ot.OffloadedTensor)
    ot.unwrap_model(model)
    assert type(twin) is _Own and type(layer_twin) is nn.Linear
    twin.w = nn.Parameter(torch.randn(64, 64))  # a plain model now: a plain assignment
    assert type(model.w) is nn.Parameter and model.w.device == torch.device("cpu")
