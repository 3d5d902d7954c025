"""The expert policy's host time in a recorded timeline (``offtensor.sim.policy_clock``): recorded
per record while an MoE model runs under ``ot.timeline``, charged to the host lane only by a replay
with ``policy_host=True``, nothing for a model without routed experts, and the policy's methods are
themselves again after the recording, however it ends."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.moe.speculation import RoutingSpeculator
from offtensor.moe.stacks import ExpertStacks
from offtensor.sim.policy_clock import POLICY, PolicyClock

pytest.importorskip("transformers")
from test_moe_predictor import _decode, _qwen3, _wrap_quarter  # noqa: E402  (a tiny Qwen3-MoE, a quarter of its experts cached)


def _originals():
    return {(cls, name): cls.__dict__[name] for cls, names, _ in POLICY for name in names}


def test_an_moe_decode_records_its_policy_host_time_and_a_replay_charges_it_only_when_asked():
    before = _originals()
    model = _wrap_quarter(_qwen3())
    _decode(model, 2)  # warm: the router order and the stacks each router selects
    with ot.timeline(model) as tl:
        _decode(model, 3)
    policy = sum(r.policy_ms for r in tl.records)
    assert policy > 0 and all(r.policy_ms >= 0 for r in tl.records)
    plain, charged = tl.replay("h200"), tl.replay("h200", policy_host=True)
    last = sum(r.policy_ms for r in tl.records if r.step == tl.steps - 1)
    assert charged.host_ms == pytest.approx(plain.host_ms + last)
    assert sum(charged.steps_ms) > sum(plain.steps_ms)
    assert _originals() == before and PolicyClock.installed is None


def test_a_model_without_routed_experts_records_no_policy_time():
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    ot.wrap_model(model, budget_gb=2e-5, device="cpu")
    with ot.timeline(model) as tl:
        with torch.no_grad():
            model(torch.randn(2, 32))
    assert tl.records and all(r.policy_ms == 0.0 for r in tl.records)


def test_the_policy_is_itself_again_after_a_recording_cut_short():
    before = _originals()
    model = _wrap_quarter(_qwen3())
    with pytest.raises(KeyboardInterrupt):
        with ot.timeline(model):
            assert ExpertStacks.__dict__["victim"] is not before[(ExpertStacks, "victim")]  # timed while recording
            raise KeyboardInterrupt
    assert _originals() == before and PolicyClock.installed is None
    assert RoutingSpeculator.__dict__["router_ran"] is before[(RoutingSpeculator, "router_ran")]


def test_one_clock_at_a_time():
    first, second = PolicyClock(), PolicyClock()
    assert first.install()
    try:
        assert not second.install()
    finally:
        first.remove()
    assert PolicyClock.installed is None


def test_only_the_recording_threads_policy_calls_are_timed():
    import threading

    clock = PolicyClock()
    assert clock.install()
    try:
        stacks = ExpertStacks()
        worker = threading.Thread(target=lambda: stacks.step())
        worker.start()
        worker.join()
        assert clock.take() == 0.0 and not clock.parts  # another thread's call: not this recording's
        stacks.step()
        assert clock.calls.get("bookkeeping") == 1
    finally:
        clock.remove()


def test_an_excluded_call_named_as_a_part_is_counted_apart_and_not_as_policy_time():
    class Paging:
        def page(self):
            time.sleep(0.02)
            ExpertStacks.step(stacks)  # the policy's own call inside it: still the policy's

    stacks = ExpertStacks()
    clock = PolicyClock()
    assert clock.install()
    try:
        clock.exclude(Paging, ("page",), part="pager")
        Paging().page()
        policy = clock.take()
        assert clock.calls == {"pager": 1, "bookkeeping": 1}
        assert clock.parts["pager"] >= 0.02 and policy == pytest.approx(clock.parts["bookkeeping"] * 1e3)
        assert policy < 20  # ms: the sleep is the pager's
    finally:
        clock.remove()
    assert "page" in Paging.__dict__ and PolicyClock.installed is None


def test_a_pager_entry_point_excluded_at_install_and_named_as_a_part_is_timed_once_as_that_part():
    # Pager.page is charged elsewhere from install on (the profile's page figure stands for it); a
    # benchmark that names it as the part "pager" must read its time, not the time of a second
    # wrapper around the first, which took the inner timing off and read about nothing.
    from offtensor.pager.pager import Pager

    original = Pager.__dict__["page"]

    def slow_page(self, *args, **kwargs):
        time.sleep(0.02)

    Pager.page = slow_page
    clock = PolicyClock()
    try:
        assert clock.install()
        clock.exclude(Pager, ("page",), part="pager")
        Pager.page(None)
        assert clock.calls == {"pager": 1} and clock.parts["pager"] >= 0.02 and clock.take() == 0.0
    finally:
        clock.remove()
        Pager.page = original
    assert Pager.__dict__["page"] is original and PolicyClock.installed is None


def test_the_lookahead_kernels_a_guess_runs_are_not_the_policys_host_time(monkeypatch):
    # On a GPU the look-ahead's matmul is a launch on the compute stream (an op of its own in a
    # replay): where the host runs it, its run is not counted as the policy's host work.
    from offtensor.moe import speculation

    def slow_kernel(x, weight, bias, first):
        time.sleep(0.02)
        return x

    monkeypatch.setattr(speculation, "lookahead_scores", slow_kernel)

    def router_ran(self, router, x):
        speculation.lookahead_scores(x, None, None, None)

    monkeypatch.setattr(RoutingSpeculator, "router_ran", router_ran)
    clock = PolicyClock()
    assert clock.install()
    try:
        RoutingSpeculator.router_ran(None, None, torch.zeros(1))
        assert clock.calls == {"guesses": 1} and clock.take() < 20  # ms: the sleep is the kernel's
    finally:
        clock.remove()
    assert speculation.lookahead_scores is slow_kernel and PolicyClock.installed is None


def test_a_garbage_collection_inside_a_policy_call_is_a_part_of_its_own_not_policy_time(monkeypatch):
    # A collection runs in whichever call allocates when a generation fills: which call pays for
    # it is chance, so it is timed apart ("gc") and the call it ran inside is charged less it.
    import gc

    junk = [[i] for i in range(300_000)]  # a full collection walks every one of them

    def step(self):
        gc.collect()

    monkeypatch.setattr(ExpertStacks, "step", step)
    clock = PolicyClock()
    assert clock.install()
    try:
        ExpertStacks.step(None)
        policy, collector = clock.take(), clock.parts.get("gc", 0.0) * 1e3
        assert clock.calls["gc"] >= 1 and clock.calls["bookkeeping"] == 1
        assert policy < collector / 10  # ms: the collection's time is not the call's
    finally:
        clock.remove()
    assert clock._collection not in gc.callbacks and PolicyClock.installed is None
    del junk


def test_the_clocks_own_wrapping_is_charged_to_no_call(monkeypatch):
    # A clock whose every reading is 1 us later than the last: a timed call spans one step, a
    # timed call inside another costs that one two (its own two readings), and a loop of 100
    # plain calls spans one: 0.01 us a call. Calibrated on that clock (1 us inside less the plain
    # call's 0.01, 1 us outside), a policy call that did nothing but make 50 timed calls of the
    # pager's is charged what 51 plain calls would cost, not its children's wrapping.
    from offtensor.sim import policy_clock

    now = [0.0]

    def readings():
        now[0] += 1e-6
        return now[0]

    monkeypatch.setattr(policy_clock, "_OVERHEADS", [0.0, 0.0])  # (the process's own, measured on the real clock, untouched)
    monkeypatch.setattr(policy_clock.time, "perf_counter", readings)
    clock = PolicyClock()
    inside, outside = clock.calibrate(calls=100, repeats=2)
    assert inside == pytest.approx(0.99e-6) and outside == pytest.approx(1e-6)

    def run(clock):
        pager = clock._timed(lambda: None, ("excluded", "pager"))
        policy = clock._timed(lambda: [pager() for _ in range(50)], "guesses")
        policy()
        return clock.take(), clock.parts.pop("pager")

    assert run(clock) == (pytest.approx(51e-3), pytest.approx(50e-6))  # ms, s: the readings of the wrapping
    clock._inside, clock._outside = inside, outside
    assert run(clock) == (pytest.approx(0.01e-3), pytest.approx(50 * 0.01e-6))


def test_the_depth_benchmark_times_each_setting_with_the_heap_frozen_too_and_unfreezes_it(thawed_heap):
    """``benchmarks/moe_policy_scale.py --freeze-gc``: every setting also run with ``gc.freeze()``
    once its model is wrapped, deciding the same (the same hit rate), and the heap given back to
    the collector after each run."""
    import gc
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    import moe_policy_scale

    frozen_during = []
    real = moe_policy_scale.timed_replay

    def timed_replay(*args, wrapped=None, **kwargs):
        def check():
            wrapped()
            frozen_during.append(gc.get_freeze_count())
        return real(*args, wrapped=check if wrapped is not None else None, **kwargs)

    before = gc.get_freeze_count()
    moe_policy_scale.timed_replay = timed_replay
    try:
        out = moe_policy_scale.measure(2, 3, 0.25, freeze=True)
    finally:
        moe_policy_scale.timed_replay = real
    assert set(out) == {"cache_alone", "cache_alone_gc_frozen", "default", "default_gc_frozen"}
    assert out["cache_alone"]["hit_rate"] == out["cache_alone_gc_frozen"]["hit_rate"]
    assert out["default"]["hit_rate"] == out["default_gc_frozen"]["hit_rate"]
    assert len(frozen_during) == 2 and all(n > before for n in frozen_during)
    assert gc.get_freeze_count() == before


def test_a_clock_by_method_times_each_entry_point_apart_under_its_part():
    """``PolicyClock(by_method=True)`` (the benchmarks' ``--by-method``): each of the policy's entry
    points is a part of its own, "<part>.<method>", and the policy's time is theirs summed."""
    model = _wrap_quarter(_qwen3())
    _decode(model, 2)
    clock = PolicyClock(by_method=True)
    assert clock.install()
    try:
        _decode(model, 3)
    finally:
        clock.remove()
    methods = {f"{part}.{name}" for _, names, part in POLICY for name in names}
    timed = {p for p in clock.parts if p != "gc"}
    assert timed and timed <= methods and "bookkeeping.accessed" in timed and "victim.victim" in timed
    assert set(clock.calls) >= timed and clock.take() == pytest.approx(sum(clock.parts[p] for p in timed) * 1e3)
    assert PolicyClock.installed is None
