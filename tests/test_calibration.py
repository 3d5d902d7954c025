"""The device model against the GPU: hand-written offloading schedules measured on an H200,
written here as timelines the way their code issues copies and GEMMs, and replayed under
the built-in ``h200`` profile. Each prediction must land within 5 % of its measurement.

The workload: 24 layers of ``x @ W1 (8192 x 24576) @ W2 (24576 x 8192)`` in bf16, 12 layers (9.66 GB)
offloaded; prefill is 4096 tokens, decode one. The profile's bf16 rate comes from the all-resident
prefill (see sim.profiles.PROFILES), so that row is the profile's definition and is not checked here;
everything else (copy overlap, slot reuse, step boundaries, decode's memory-bound GEMMs) is predicted.
"""

import dataclasses
import os
import sys

import pytest
import torch

import offtensor as ot
from offtensor.sim.profiles import get_profile
from offtensor.sim.timeline import Timeline

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import plan_calibration  # noqa: E402  (the host-bound models, shared with the wall-clock benchmark)

LAYERS, HIDDEN, FFN = 24, 8192, 24576
WEIGHT_BYTES = HIDDEN * FFN * 2
PREFILL, DECODE = 4096, 1
STEPS = 4  # the last one is reported: slots and prefetches have reached their steady state

# ms per step, measured in one run on an H200 (PCIe Gen5 x16, torch 2.11).
MEASURED = {
    "all resident": {"decode": 4.67, "prefill": 116.1},
    "vLLM-style .to(non_blocking) + functional_call": {"decode": 179.8, "prefill": 277.6},
    "prefix offloaded, 2 slots, within one forward": {"decode": 177.1, "prefill": 231.0},
    "odd layers offloaded, 2 slots, within one forward": {"decode": 174.6, "prefill": 178.6},
    "prefix offloaded, 4 slots, across steps": {"decode": 176.7, "prefill": 180.0},
    "odd layers offloaded, 2 slots, across steps": {"decode": 175.3, "prefill": 183.4},
}


def _gemm(tl, tokens, first: bool, waits=()):
    """One GEMM of a layer: x (tokens x K) @ W (K x N), as its kernel reads and writes device memory."""
    k, n = (HIDDEN, FFN) if first else (FFN, HIDDEN)
    nbytes = (tokens * k + k * n + tokens * n) * 2
    return tl.add_op(2 * tokens * k * n, nbytes, "bfloat16", waits=waits, name=f"gemm{'1' if first else '2'}")


def slots_schedule(offloaded, slots, across_steps, tokens):
    """The hand-written two-stream loop: each offloaded layer's W1 and W2 are copied into one of
    ``slots`` layer-sized slots on a side stream; the copy into a slot waits for the GEMM that last
    read it; each GEMM waits for its weight's copy. Within one forward, the first ``slots`` offloaded
    layers are copied when the forward starts; across steps, the slot freed by one of the last layers
    of a step copies the first layers of the next, so the copy stream never stops at a step boundary."""
    tl = Timeline()
    order = sorted(offloaded)
    slot_reader = [None] * slots  # the last GEMM that read each slot
    ready = {}  # layer -> (copy of W1, copy of W2)

    def copy_in(index):
        layer = order[index % len(order)]
        slot = index % slots
        waits = [slot_reader[slot]] if slot_reader[slot] is not None else []
        ready[layer] = (
            tl.add_copy(WEIGHT_BYTES, waits, name=f"copy {layer}.w1"),
            tl.add_copy(WEIGHT_BYTES, [], name=f"copy {layer}.w2"),
        )

    for step in range(STEPS):
        if step:
            tl.next_step()
        if step == 0 or not across_steps:
            for i in range(min(slots, len(order))):
                copy_in(i)
        for layer in range(LAYERS):
            if layer in ready:
                c1, c2 = ready.pop(layer)
                _gemm(tl, tokens, True, [c1])
                g2 = _gemm(tl, tokens, False, [c2])
                index = order.index(layer)
                slot_reader[index % slots] = g2
                nxt = index + slots
                if nxt < len(order) or across_steps:
                    copy_in(nxt)
            else:
                _gemm(tl, tokens, True)
                _gemm(tl, tokens, False)
    return tl


def vllm_schedule(offloaded, tokens):
    """vLLM's cpu_offload: every forward copies each offloaded weight with ``.to(non_blocking=True)``
    on the current stream into a fresh state dict, then runs the model with ``functional_call``. One
    stream: the copies run before the forward's GEMMs, and the next forward's after them."""
    tl = Timeline()
    for step in range(STEPS):
        if step:
            tl.next_step()
        copies = {layer: (tl.add_copy(WEIGHT_BYTES, stream="compute"), tl.add_copy(WEIGHT_BYTES, stream="compute"))
                  for layer in sorted(offloaded)}
        for layer in range(LAYERS):
            c1, c2 = copies.get(layer, ((), ()))
            _gemm(tl, tokens, True, [c1] if c1 != () else [])
            _gemm(tl, tokens, False, [c2] if c2 != () else [])
    return tl


PREFIX = set(range(12))
ODD = set(range(1, LAYERS, 2))

SCHEDULES = {
    "all resident": lambda tokens: slots_schedule(set(), 1, False, tokens),
    "vLLM-style .to(non_blocking) + functional_call": lambda tokens: vllm_schedule(PREFIX, tokens),
    "prefix offloaded, 2 slots, within one forward": lambda tokens: slots_schedule(PREFIX, 2, False, tokens),
    "odd layers offloaded, 2 slots, within one forward": lambda tokens: slots_schedule(ODD, 2, False, tokens),
    "prefix offloaded, 4 slots, across steps": lambda tokens: slots_schedule(PREFIX, 4, True, tokens),
    "odd layers offloaded, 2 slots, across steps": lambda tokens: slots_schedule(ODD, 2, True, tokens),
}

CHECKED = [
    (name, phase)
    for name in SCHEDULES
    for phase in ("decode", "prefill")
    if (name, phase) != ("all resident", "prefill")  # defines the profile's bf16 rate
]


def predicted_ms(name, phase):
    tokens = PREFILL if phase == "prefill" else DECODE
    return SCHEDULES[name](tokens).replay("h200").step_ms


@pytest.mark.parametrize("name,phase", CHECKED)
def test_handwritten_schedule_replays_within_5_percent_of_h200_measurement(name, phase):
    predicted = predicted_ms(name, phase)
    measured = MEASURED[name][phase]
    assert abs(predicted - measured) / measured <= 0.05, f"{name}, {phase}: predicted {predicted:.1f} ms, measured {measured} ms"


def test_all_resident_prefill_defines_the_sustained_bf16_rate():
    # The profile derives its bf16 rate from this measurement; this checks that the FLOPs the replay
    # counts for the schedule are the ones that derivation assumed.
    assert predicted_ms("all resident", "prefill") == pytest.approx(MEASURED["all resident"]["prefill"], rel=0.005)


def test_calibration_separates_good_and_bad_schedules():
    # What the calibration is for: the replay must rank schedules as the GPU did. Prefix-offloaded
    # prefill within one forward idles the copy stream behind the resident block; odd layers do not.
    bad = SCHEDULES["prefix offloaded, 2 slots, within one forward"](PREFILL).replay("h200")
    good = SCHEDULES["odd layers offloaded, 2 slots, within one forward"](PREFILL).replay("h200")
    assert bad.ratio_to_bound > 1.2 and good.ratio_to_bound < 1.03
    assert bad.copy_busy < 0.8 and good.copy_busy > 0.97


def _charged(profile, **host_us):
    """``profile`` with offtensor's host time per record set to ``host_us`` (µs), the rest as it is."""
    return dataclasses.replace(get_profile(profile), host_us=dict(host_us))


def _steady_stats(kwargs, cls, args, steps=3):
    """The wrapped model's stats over ``steps`` steps after as many to fill its cache or pool."""
    torch.manual_seed(0)
    model = ot.wrap_model(cls(*args), **kwargs)
    x = torch.randn(1, args[1])
    with torch.no_grad():
        for i in range(2 * steps):
            if i == steps:
                ot.reset_stats(model)
            model(x)
    return ot.stats(model)


def test_a_plan_of_a_host_bound_model_charges_one_page_of_host_time_per_op():
    # Every weight offloaded and cached: a step copies nothing, and what it costs is offtensor's own
    # host work per op (the profile's host_us["page"]) beside each tiny op. The plan must charge
    # exactly that: a microsecond more a page is n microseconds more a step. (Whether the figures so
    # charged predict the emulated step's wall clock is benchmarks/plan_calibration.py's question.)
    profile = _charged("h200", page=20.0)
    tl, kwargs, cls, args = plan_calibration.plain_setup(profile)
    n = args[0]
    last = [r for r in tl.records if r.step == tl.steps - 1 and r.kind == "op"]
    assert len(last) == n and all(r.pages == 1 for r in last)  # one hit per op, recorded as such
    assert not any(r.kind == "copy" for r in tl.records if r.step == tl.steps - 1)
    step = tl.replay(profile)
    dearer = tl.replay(_charged(profile, page=21.0))
    assert step.bound_by == dearer.bound_by == "host"
    assert dearer.step_ms - step.step_ms == pytest.approx(n * 1e-3, rel=1e-6)
    assert step.host_ms == pytest.approx(n * 20e-3, rel=1e-6)
    stats = _steady_stats(kwargs, cls, args)
    assert stats.hits == 3 * n and stats.bytes_h2d == 0  # the plan's steady step: a hit an op, no copy


def test_a_plan_of_a_pooled_host_bound_moe_charges_the_pools_host_time_per_grouped_gemm():
    # Every routed stack offloaded and served from an expert pool that holds them all: a step fetches
    # nothing, and what it costs is the pooled path's host work per grouped GEMM (host_us["pool"])
    # beside each tiny op; no page, no host read. Without the pool's figure the plan would find the
    # step a tenth of what it measures on the emulated device (benchmarks/plan_calibration.py).
    profile = _charged("h200", page=10.0, pool=30.0)
    with torch.no_grad():
        tl, kwargs, cls, args = plan_calibration.pooled_setup(profile)
    n = args[0]
    last = [r for r in tl.records if r.step == tl.steps - 1]
    assert [r.pooled for r in last if r.kind == "op"] == [1] * (2 * n)  # each GEMM pooled, none paged
    assert not any(r.kind in ("copy", "sync") for r in last)
    step = tl.replay(profile)
    dearer = tl.replay(_charged(profile, page=10.0, pool=31.0))
    assert step.bound_by == dearer.bound_by == "host"
    assert dearer.step_ms - step.step_ms == pytest.approx(2 * n * 1e-3, rel=1e-6)
    assert tl.replay(_charged(profile, page=10.0, pool=0.0)).step_ms < step.step_ms / 3
    stats = _steady_stats(kwargs, cls, args)
    assert stats.expert_pool["fetches"] == 0 and stats.expert_pool["hits"] > 0 and stats.bytes_h2d == 0  # from the pool


if __name__ == "__main__":  # the table for the report: python tests/test_calibration.py
    for name in SCHEDULES:
        row = []
        for phase in ("decode", "prefill"):
            p, m = predicted_ms(name, phase), MEASURED[name][phase]
            row.append(f"{phase} {p:7.1f} vs {m:7.1f} ({(p - m) / m:+.1%})")
        print(f"{name:52s} " + "   ".join(row))
