"""The learned look-ahead's maps live in the budget: ``install`` takes their bytes from it (cached
copies making room first) and gives back the bytes of the maps it replaces, unwrapping gives them
back, maps that would leave no room for the model's largest op are refused before anything changes,
and an online refit whose maps do not fit keeps the look-ahead it had."""

from __future__ import annotations

import sys

import pytest
import torch

import offtensor as ot
from offtensor.model.state import pager_of
from offtensor.moe.predictor import LOOKAHEAD_ACCOUNT, LookaheadPredictor, install
from offtensor.pager import BudgetError

pytest.importorskip("transformers")
from test_moe_predictor import _decode, _qwen3, _wrap_quarter  # noqa: E402  (a tiny Qwen3-MoE, 4 MoE layers)


def _maps(layers, hidden=None) -> LookaheadPredictor:
    """Linear maps [16, 64] for ``layers`` (with ``hidden``: reading a ReLU layer of that width)."""
    g = torch.Generator().manual_seed(0)
    predictor = LookaheadPredictor()
    for i in layers:
        width = 64 if hidden is None else hidden
        predictor.weights[i] = torch.randn(16, width, generator=g)
        predictor.biases[i] = torch.zeros(16)
        if hidden is not None:
            predictor.hidden_layers[i] = (torch.randn(hidden, 64, generator=g), torch.zeros(hidden))
    return predictor


def _held(pager) -> int:
    """Bytes of the installed look-ahead's maps that the budget holds (its account)."""
    return pager.held_outside(LOOKAHEAD_ACCOUNT)


def _used(pager) -> int:
    s = pager.snapshot()
    return s.resident_bytes + s.cached_bytes + _held(pager)


def test_installed_maps_come_out_of_the_budget_and_their_replacement_or_unwrap_gives_them_back():
    reference, model = _qwen3(), _wrap_quarter(_qwen3())
    pager = pager_of(model)
    budget = pager.budget_bytes
    want = _decode(reference, 6)
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 6), want))  # a warm cache, then the maps
    three = _maps(range(3))
    install(pager, three)
    nbytes = 3 * (16 * 64 + 16) * 4
    assert three.installed_bytes(4) == nbytes == _held(pager)
    assert pager.budget_bytes == budget - nbytes and ot.stats(model).budget_bytes == budget  # the budget as given
    assert _used(pager) <= budget
    install(pager, three)  # the same maps again: the same bytes
    assert pager.budget_bytes == budget - nbytes
    install(pager, _maps([0]))  # fewer maps: the rest of the bytes go back
    assert pager.budget_bytes == budget - nbytes // 3
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 6), want))
    assert _used(pager) <= budget
    ot.unwrap_model(model)
    assert pager.budget_bytes == budget


def test_maps_that_leave_no_room_for_the_largest_op_are_refused_and_change_nothing():
    reference, model = _qwen3(), _wrap_quarter(_qwen3())
    pager = pager_of(model)
    install(pager, _maps(range(3)))
    budget, held = pager.budget_bytes, _held(pager)
    routers = [r for r in pager.experts.speculator.routers if r.stacks]
    before = [r.lookahead for r in routers]
    big = _maps(range(3), hidden=8192)  # 3 x 8192 x (64 + 16 + 1) x 4 bytes: more than the room
    with pytest.raises(BudgetError, match=rf"look-ahead's maps need {big.installed_bytes(4)} bytes.*largest paged op"):
        install(pager, big)
    assert pager.budget_bytes == budget and _held(pager) == held
    assert all(r.lookahead is b for r, b in zip(routers, before))
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 4), _decode(reference, 4)))


def test_an_online_refit_whose_maps_do_not_fit_warns_and_keeps_the_installed_lookahead(monkeypatch):
    from offtensor.moe.refit import OnlineRefit

    model = _wrap_quarter(_qwen3())
    pager = pager_of(model)
    _decode(model, 2)  # the speculator learns its routers' stacks
    install(pager, _maps(range(3)))
    routers = [r for r in pager.experts.speculator.routers if r.stacks]
    before, budget = [r.lookahead for r in routers], pager.budget_bytes
    refit = OnlineRefit(pager, every=10_000, window=64, minimum=16)
    g = torch.Generator().manual_seed(0)
    for _ in range(64):
        refit.steps.append([(torch.randn(64, generator=g), torch.randperm(16, generator=g)[:4].sort().values)
                            for _ in range(4)])
    # The model's largest op now needs all of the room (its placement re-planned it, say): every
    # byte more that the refitted maps take would leave it short.
    room = pager.budget_bytes - pager.resident_bytes
    monkeypatch.setattr(pager.experts, "room_needed", lambda: room)
    with pytest.warns(RuntimeWarning, match="look-ahead installed before this refit stays"):
        assert refit.refit() == []
    # (On these seeded pairs the refit keeps more map bytes than the installed maps hold.)
    assert refit.predictor.installed_bytes(4) > 3 * (16 * 64 + 16) * 4
    assert all(r.lookahead is b for r, b in zip(routers, before)) and pager.budget_bytes == budget


def test_the_peak_counts_the_maps_bytes_and_stays_within_the_budget_as_given_after_they_are_installed():
    """Installing maps on a warm cache (as an online refit does) shrinks what paging may use; the
    peak, a high-water mark from before, was compared with that smaller figure and seemed over the
    budget though nothing ever was. ``stats.budget_bytes`` is the budget as given and the peak counts
    the maps' bytes: the two stay comparable however the maps change."""
    reference, model = _qwen3(), _wrap_quarter(_qwen3())
    pager = pager_of(model)
    budget = pager.budget_bytes
    want = _decode(reference, 6)
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 6), want))
    maps = _maps(range(3), hidden=128)
    assert ot.stats(model).peak_device_bytes > budget - maps.installed_bytes(4)  # past the room the maps leave
    install(pager, maps)
    s = ot.stats(model)
    assert s.budget_bytes == budget and s.peak_device_bytes <= s.budget_bytes
    ot.reset_stats(model)  # the peak starts again from what is held now: the maps included
    assert ot.stats(model).peak_device_bytes == _used(pager) >= maps.installed_bytes(4)
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 6), _decode(reference, 6)))
    s = ot.stats(model)
    assert _held(pager) <= s.peak_device_bytes <= s.budget_bytes == budget


def test_stacks_registered_anew_keep_the_installed_lookahead_and_its_bytes():
    reference, model = _qwen3(), _wrap_quarter(_qwen3())
    pager = pager_of(model)
    budget = pager.budget_bytes
    maps = _maps(range(3))
    install(pager, maps)
    before = pager.experts
    # A stack assigned after wrapping (the same values, a new parameter): the expert stacks are
    # registered again at the next forward, with the look-ahead installed before.
    experts = model.model.layers[0].mlp.experts
    experts.down_proj = torch.nn.Parameter(experts.down_proj.detach().clone())
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 4), _decode(reference, 4)))
    assert pager.experts is not before
    speculator = pager.experts.speculator
    assert pager.experts.lookahead[0] is maps and _held(pager) == maps.installed_bytes(4)
    assert pager.budget_bytes == budget - maps.installed_bytes(4)
    assert [r.lookahead is not None for r in speculator.routers if r.stacks] == [True, True, True, False]


@pytest.mark.parametrize("wrong", ["experts", "width", "hidden"])
def test_maps_of_another_shape_are_refused_at_install_naming_the_layer_and_change_nothing(wrong):
    reference, model = _qwen3(), _wrap_quarter(_qwen3())
    pager = pager_of(model)
    install(pager, _maps(range(3)))
    budget, routers = pager.budget_bytes, [r for r in pager.experts.speculator.routers if r.stacks]
    before = [r.lookahead for r in routers]
    bad = _maps(range(3), hidden=32 if wrong == "hidden" else None)
    if wrong == "experts":  # a model of 24 experts
        bad.weights[1], bad.biases[1] = torch.zeros(24, 64), torch.zeros(24)
    elif wrong == "width":  # a hidden state of 96
        bad.weights[1] = torch.zeros(16, 96)
    else:  # a hidden layer of 32 read by maps of 40
        bad.weights[1] = torch.zeros(16, 40)
    with pytest.raises(ValueError, match=r"MoE layer 1 \(model\.layers\.1\.mlp\.gate\).*width 64.*16 experts"):
        install(pager, bad)
    assert pager.budget_bytes == budget and all(r.lookahead is b for r, b in zip(routers, before))
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 3), _decode(reference, 3)))


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")
@pytest.mark.parametrize("more", [True, False])
def test_an_interrupt_at_any_bytecode_of_install_keeps_the_budget_and_its_record_in_step(more):
    from test_interrupts import PAGING_FILES, _interrupt_at, assert_consistent

    reference, model = _qwen3(), _wrap_quarter(_qwen3())
    pager = pager_of(model)
    budget = pager.budget_bytes
    _decode(model, 3)  # a warm cache: taking room evicts
    start, target = _maps(range(3)), _maps(range(3), hidden=48) if more else _maps([0])
    files = PAGING_FILES | {install.__code__.co_filename}
    n, interrupted = 0, True
    while interrupted:
        n += 1
        install(pager, start)
        interrupted = _interrupt_at(n, lambda: install(pager, target), files)
        # The budget gave the maps exactly what it records; the maps on the device are no more.
        assert pager.budget_bytes + _held(pager) == budget, f"after an interrupt at point {n}"
        on_device = sum(t.numel() * t.element_size() for r in pager.experts.speculator.routers
                        if r.lookahead is not None for t in r.lookahead)
        assert on_device <= _held(pager), f"after an interrupt at point {n}"
        assert_consistent(pager)
    assert n > 20 and _held(pager) == target.installed_bytes(4)
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 3), _decode(reference, 3)))



def _quarter_gb(model) -> float:
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    return (sum(p.numel() * 4 for p in model.parameters()) - 0.75 * experts) / (1 << 30)


@pytest.mark.parametrize("beside", ["maps", "another_models_maps", "garbage"])
def test_from_pretrained_installs_the_lookahead_saved_beside_the_checkpoint_or_warns_and_loads_without(tmp_path, beside):
    source = _qwen3()
    source.save_pretrained(tmp_path)
    maps = _maps(range(3))
    if beside == "another_models_maps":
        maps.weights[2] = torch.zeros(16, 96)
    if beside == "garbage":
        (tmp_path / "lookahead.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    else:
        maps.save(str(tmp_path))
    load = lambda: ot.from_pretrained(str(tmp_path), budget_gb=_quarter_gb(source), device="cpu",  # noqa: E731
                                      policy={"offload": ["*.experts.*"]})
    if beside == "maps":
        model = load()
    else:
        with pytest.warns(UserWarning, match="lookahead.safetensors: the learned look-ahead beside the checkpoint "
                                             "was not installed"):
            model = load()
    pager = pager_of(model)
    routers = [r for r in pager.experts.speculator.routers if r.stacks]
    if beside == "maps":
        assert _held(pager) == maps.installed_bytes(4)
        assert [r.lookahead is not None for r in routers] == [True, True, True, False]
        assert torch.equal(routers[1].lookahead[0], maps.weights[1])
    else:
        assert pager.experts.lookahead is None and all(r.lookahead is None for r in routers)
    assert all(torch.equal(a, b) for a, b in zip(_decode(model, 4), _decode(source, 4)))
