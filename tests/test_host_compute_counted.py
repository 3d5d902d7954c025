"""Ops computed from the host master of a tensor larger than the budget's room (ops/host_compute.py)
are counted and recorded: ``ot.stats`` gives how many ran there, the master bytes they read, the
bytes they wrote back, the bytes of their results sent to the device and the host's time; a
recorded timeline has each as an op on the host lane at its measured time, its results' copy after
it. ``out=`` forms of those ops run there too (an offloaded out= written back in one copy, with
torch's resize rules), where before they raised ``BudgetError``."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.sim.timeline import Timeline

from test_lines_in_slices import BUDGET, GiB

SHAPE = (64, 128)
NBYTES = 64 * 128 * 4  # one weight's bytes: more than the room, which holds a quarter of it


class _Weights(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(SHAPE).round(decimals=1))
        self.v = nn.Parameter(torch.randn(SHAPE).round(decimals=1))
        self.t = nn.Parameter(torch.randn(100, 128))

    def forward(self, x):
        return self.w.argmax() + x.sum()


def _wrapped(device, budget=BUDGET):
    model = _Weights()
    plain = _Weights().to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (narrow output tiles: no product runs here)
        ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    return model, plain


def _host_figures(stats) -> tuple:
    return stats.host_ops, stats.host_read_bytes, stats.host_written_bytes, stats.host_result_bytes


def _equal(got, expected, device):
    if device == "cpu":
        assert torch.equal(got, expected)
    else:  # a GPU's kernel may round in another order than the CPU's
        torch.testing.assert_close(got, expected)


# ---------------------------------------------------------------------------- counters


def test_each_kind_of_op_on_the_host_is_counted_with_its_exact_bytes(device):
    """A read (its master's bytes read, its result sent), an in-place write (read and written back,
    not a device->host copy) and an out= form (the input read, the out= written back): each one op,
    its host time measured; no weight byte paged."""
    model, _ = _wrapped(device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a GPU warns that the CPU's kernel computes)
        model.w.argmax()
        assert _host_figures(ot.stats(model)) == (1, NBYTES, 0, 8)  # an int64 index
        model.w.tril_(-3)
        assert _host_figures(ot.stats(model)) == (2, 2 * NBYTES, NBYTES, 8)
        torch.cumsum(model.v, 0, out=model.w)
        assert _host_figures(ot.stats(model)) == (3, 3 * NBYTES, 2 * NBYTES, 8)
        values, indices = torch.empty(0, device=device), torch.empty(0, dtype=torch.long, device=device)
        torch.sort(model.v.flatten(), out=(values, indices))  # plain out= tensors: the results the device receives
        stats = ot.stats(model)
    assert _host_figures(stats) == (4, 4 * NBYTES, 2 * NBYTES, 8 + NBYTES + 2 * NBYTES)
    assert stats.host_seconds > 0
    assert (stats.bytes_h2d, stats.bytes_d2h, stats.page_ins) == (0, 0, 0)
    text = str(stats)
    assert "host_ops=4" in text and "host_written_bytes=65.54 kB" in text and "host_seconds=" in text
    ot.reset_stats(model)
    assert _host_figures(ot.stats(model)) == (0, 0, 0, 0) and "host_ops" not in str(ot.stats(model))


def test_an_op_whose_weight_fits_the_room_is_not_counted_as_computed_on_the_host(device):
    model, _ = _wrapped(device, budget=5 * NBYTES // 2)  # (room for one weight whole, not all three)
    with torch.no_grad():
        model.w.argmax()
        torch.cumsum(model.v, 0, out=model.w)
    stats = ot.stats(model)
    assert _host_figures(stats) == (0, 0, 0, 0) and stats.host_seconds == 0 and stats.page_ins > 0


# ---------------------------------------------------------------------------- the timeline


def test_a_recorded_op_on_the_host_is_an_op_on_the_host_lane_at_its_measured_time(device):
    """Its master's bytes, its measured time (the stats' own), then its result's copy, which the
    dispatched op waits for; that op reads no weight byte on the device; the replay's host lane
    carries the measured time and the trace names the lane."""
    model, _ = _wrapped(device)
    with torch.no_grad(), ot.timeline(model) as tl:
        model(torch.ones(3, device=device))
    seconds = ot.stats(model).host_seconds
    (host,) = [r for r in tl.records if r.stream == "host"]
    assert (host.kind, host.name, host.nbytes) == ("op", "host argmax", NBYTES)
    assert host.measured_host_ms == pytest.approx(seconds * 1e3)
    (copy,) = [r for r in tl.records if r.name == "host result"]
    assert (copy.kind, copy.stream, copy.nbytes, copy.waits) == ("copy", "copy", 8, [host.id])
    (argmax,) = [r for r in tl.records if r.name == "argmax"]
    assert copy.id in argmax.waits and (argmax.nbytes, argmax.flops) == (0, 0)
    replay = tl.replay()
    assert replay.host_ms >= host.measured_host_ms
    assert replay.ends[host.id] - replay.starts[host.id] == pytest.approx(host.measured_host_ms)
    lanes = {e["args"]["name"] for e in tl.trace()["traceEvents"] if e["ph"] == "M" and "tid" in e}
    assert lanes == {"compute", "copy", "host"}


def test_a_replay_takes_a_host_ops_measured_time_instead_of_the_profiles_figures():
    """The H200 profile has no host figures (a routed expert on its host is never chosen there): a
    measured op still replays at its time."""
    tl = Timeline()
    tl.add_op(0, NBYTES, "float32", name="host argmax", stream="host", measured_host_ms=2.5)
    replay = tl.replay("h200")
    assert replay.host_ms == pytest.approx(2.5) and replay.bound_by == "host"


# ---------------------------------------------------------------------------- out= forms

OUT = {
    "cumsum(v, 0, out=w)": lambda m, d: torch.cumsum(m.v, 0, out=m.w),
    "index_select(t, 0, rows, out=w)": lambda m, d: torch.index_select(m.t, 0, torch.arange(63, -1, -1, device=d),
                                                                         out=m.w),
    "sort(v.flatten(), out=(w.view(-1), plain))": lambda m, d: torch.sort(
        m.v.flatten(), stable=True, out=(m.w.view(-1), torch.empty(0, dtype=torch.long, device=d))),
    "argmax(v, out=plain)": lambda m, d: torch.argmax(m.v, out=torch.empty((), dtype=torch.long, device=d)),
    "cumsum(plain, 0, out=w)": lambda m, d: torch.cumsum(torch.ones(SHAPE, device=d), 0, out=m.w),
}


@pytest.mark.parametrize("name", sorted(OUT))
def test_an_out_form_on_the_host_writes_what_the_unwrapped_op_writes(name, device):
    model, plain = _wrapped(device)
    pager = model.w._master.pager
    with torch.no_grad():
        model.w.abs().sum(0)  # (a read first: a cached copy the write must drop)
        expected = OUT[name](plain, device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (a GPU warns that the CPU's kernel computes)
            got = OUT[name](model, device)
        for g, e in zip(got if isinstance(got, tuple) else (got,), expected if isinstance(expected, tuple) else (expected,)):
            _equal(g.materialize() if isinstance(g, ot.OffloadedTensor) else g, e, device)
        if isinstance(got, tuple):
            assert got[0] is not None and isinstance(got[0], ot.OffloadedTensor)
        _equal(model.w.materialize(), plain.w, device)
        _equal(model.w * 1, plain.w, device)  # through the device: no stale cached copy
    assert pager.stats.peak_device_bytes <= pager.budget_bytes


def test_an_out_of_the_wrong_shape_takes_torchs_resize_within_its_master(device):
    """torch warns and resizes an out= of another shape and as many elements; so here, in place."""
    model, plain = _wrapped(device)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cumsum(model.v.flatten(), 0, out=model.w)
        expected = torch.cumsum(plain.v.flatten(), 0, out=plain.w)
    assert model.w.shape == expected.shape == (SHAPE[0] * SHAPE[1],)
    _equal(model.w.materialize(), expected, device)
    assert sum("was resized" in str(w.message) for w in caught) == 2  # torch's own warning, once each


def test_an_out_resized_past_its_master_is_refused_naming_it_and_left_whole(device):
    model, _ = _wrapped(device)
    before = model.w.materialize().clone()
    with torch.no_grad(), pytest.raises(RuntimeError) as raised, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch's resize warning comes first, as for a plain tensor)
        torch.index_select(model.t, 0, torch.arange(100, device=device), out=model.w)
    assert "'w'" in str(raised.value) and f"{NBYTES} bytes" in str(raised.value) and "(100, 128)" in str(raised.value)
    assert model.w.shape == SHAPE and torch.equal(model.w.materialize(), before)


def test_an_out_of_the_wrong_dtype_gives_torchs_error(device):
    model, plain = _wrapped(device)
    with torch.no_grad():
        with pytest.raises(RuntimeError) as unwrapped:
            torch.argmax(plain.v, out=torch.empty((), device=device))
        with pytest.raises(RuntimeError) as wrapped:
            torch.argmax(model.v, out=torch.empty((), device=device))
    assert str(wrapped.value) == str(unwrapped.value)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")
def test_an_interrupt_at_any_point_of_an_out_write_on_the_host_leaves_the_out_whole_or_written(device):
    """The out= is written back in one copy: a Ctrl-C leaves it as it was or as written."""
    from test_interrupts_more import _whole_or_written

    model, plain = _wrapped(device)
    before = plain.w.detach().cpu()
    after = torch.cumsum(model.v.materialize().cpu(), 0)  # (the host's kernel, as the op runs it)

    def run():
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.cumsum(model.v, 0, out=model.w)

    def ours(code) -> bool:
        return "offtensor" in code.co_filename and "ops" in code.co_filename

    assert _whole_or_written(model.w, before, after, run, ours) > 5
    run()
    assert torch.equal(model.w.materialize().cpu(), after)


def test_a_plan_on_meta_replays_an_op_on_the_host_at_this_machines_host_figures():
    """A plan on meta measures no time, and the built-in profiles have no host figures: the op is
    replayed at this machine's (``measure_host``), a finite step, not an infinite one."""
    with torch.device("meta"):
        model = _Weights()
    tl = ot.plan(model, budget_gb=BUDGET / GiB, example_inputs=(torch.ones(2, 128, device="meta"),), steps=1, warmup=0)
    host = [r for r in tl.records if r.stream == "host"]
    assert host and all(r.measured_host_ms is None for r in host)
    replay = tl.replay("h200")
    assert 0 < replay.host_ms < float("inf") and replay.step_ms < float("inf")
