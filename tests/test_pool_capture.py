"""A pooled decode step (``expert_pool=True``) that a CUDA graph can capture: after warm-up it moves
nothing between the host and the device and waits for nothing, checked on the emulated device by a
recorder of every op the step dispatches (``HostTraffic``), for the admit's two forms (the GPU's
tensor ops with one group per slot, the emulated device's native call), on the model of
benchmarks/pool_graph_decode.py, whose capture on a GPU this guards; on a GPU, the capture itself.

What the recorder counts as host traffic, each a copy or a wait on a GPU:
- a tensor made on the host from Python values (``aten.lift_fresh``: ``t[i] = v`` makes ``v`` on
  the host and copies it into ``t``, a blocking copy that capture refuses; ``torch.tensor(...)``);
- a tensor off the step's device (an index made without ``device=``: the step runs with ``meta``
  as the default device, so such a tensor is on meta);
- an op other than the pool's fetches (``masked_row_gather``, the emulated device's native admit)
  reading a host master (``host.to(device)`` is no op on the emulated device; what reads its
  result reads the master's memory);
- a read of a device value on the host (``.item()``, ``nonzero``, ...) or a routing read of the
  pager (``HOST_SYNCS``).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import offtensor as ot
from offtensor.ops import expert_pool as pool_ops
from offtensor.ops.rows import HOST_SYNCS

transformers = pytest.importorskip("transformers")

aten = torch.ops.aten
GiB = 1 << 30
LIFTS = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.lift.default}
SYNCS = {aten._local_scalar_dense.default, aten.item.default, aten.nonzero.default, aten.equal.default,
         aten.is_nonzero.default, aten.masked_select.default, aten.unique_consecutive.default, aten._unique2.default,
         aten.bincount.default, aten.repeat_interleave.Tensor, aten.index_fill_.int_Tensor}
# The ops that read host masters by design: the pool's fetch (on a GPU through the pinned stack's
# device address) and the emulated device's admit, which does the same fetches in its loops.
FETCHES = {torch.ops.offtensor.masked_row_gather.default}
if pool_ops._NATIVE_ADMIT is not None:
    FETCHES.add(pool_ops._NATIVE_ADMIT)
# Python custom ops are opaque to a dispatch mode: the recorder runs their bodies under itself.
_PYTHON_OPS = getattr(torch._library.custom_ops, "OPDEFS", {})
# A 0-dim host tensor that an op other than these takes is a number its kernel takes by value
# (``torch.where(c, t, 4)`` makes one with ``aten.scalar_tensor``): nothing is copied for it.
COPIES = {aten.copy_.default, aten._to_copy.default, aten._copy_from.default, aten.index_put_.default,
          aten.index_copy_.default, aten.cat.default, aten.stack.default}


class HostTraffic(TorchDispatchMode):
    """Records the ops dispatched in its scope that would be host<->device traffic on a GPU (see the
    module's docstring). ``device``: the step's device; ``hosts``: the host masters' storages."""

    def __init__(self, device: torch.device, hosts):
        super().__init__()
        self.device, self.hosts = torch.device(device), {h.untyped_storage().data_ptr() for h in hosts}
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        body = _PYTHON_OPS.get(func._schema.name)
        if body is not None:  # an offtensor op written in Python: what it runs is the step's too
            with self:
                return body._init_fn(*args, **kwargs)
        if func in LIFTS:
            self.found.append(f"{func}: a tensor made on the host from Python values (t[i] = v, torch.tensor)")
        if func in SYNCS:
            self.found.append(f"{func}: a device value read on the host")
        for t in tree_leaves((args, kwargs)):
            if type(t) is not torch.Tensor:
                continue  # an OffloadedTensor: its own dispatch pages it (the pager's bytes are checked)
            host = t.device.type == "cpu" and t.untyped_storage().data_ptr() in self.hosts
            if host and func not in FETCHES:
                self.found.append(f"{func} reads a host master ({tuple(t.shape)} {t.dtype})")
            elif self._off(t) and not host and not (self._number(t) and func not in COPIES):
                self.found.append(f"{func} takes a {tuple(t.shape)} tensor on {t.device}, off the step's device")
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if type(t) is torch.Tensor and self._off(t) and not (
                    func is aten.scalar_tensor.default and self._number(t)):
                self.found.append(f"{func} makes a {tuple(t.shape)} tensor on {t.device}, off the step's device")
        return out

    def _off(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is off the step's device ("cuda" is any CUDA device unless an index is given)."""
        return t.device.type != self.device.type or (self.device.index is not None and t.device != self.device)

    @staticmethod
    def _number(t: torch.Tensor) -> bool:
        return t.dim() == 0 and t.device.type == "cpu"


def _bench():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "pool_graph_decode.py")
    spec = importlib.util.spec_from_file_location("pool_graph_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def _models(device: str):
    """benchmarks/pool_graph_decode.py's model, small: the resident one and a pooled copy whose pool
    holds half of all experts (every few steps evict)."""
    bench = _bench()
    args = argparse.Namespace(hidden=64, layers=3, experts=8, vocab=128)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # grouped_mm is bf16 on CUDA
    torch.manual_seed(0)
    base = bench.MoeLM(args, dtype).eval()
    budget, _ = bench._budget(base, 0.5)
    pooled = copy.deepcopy(base)
    ot.wrap_model(pooled, budget_gb=budget / GiB, device=device, policy=["*.experts.*"], expert_pool=True)
    return base.to(device), pooled


def _pager(model):
    return next(p for p in model.parameters() if isinstance(p, ot.OffloadedTensor))._master.pager


def _hosts(model) -> list:
    return [p._host for p in model.parameters() if isinstance(p, ot.OffloadedTensor)]


@pytest.fixture(params=["gpu_form", "emulated"])
def form(request, monkeypatch):
    if request.param == "gpu_form":  # the admit as tensor ops, one group per pool slot
        monkeypatch.setattr(pool_ops, "SLOT_GROUPS", ("cuda", "cpu"))
        monkeypatch.setattr(pool_ops, "NATIVE_ADMIT", False)
    elif pool_ops._NATIVE_ADMIT is None:
        pytest.skip("the emulated device's native admit needs the native extension")
    return request.param


def test_a_pooled_decode_step_moves_nothing_between_host_and_device_after_warm_up(form, device):
    """Decode steps after two warm-up steps, recorded: no host-made value, no tensor off the device,
    no read of a host master but the pool's fetches, no host sync, no page by the pager; the steps
    fetch into the pool and decode the resident model's tokens."""
    resident, pooled = _models(device)
    pager, pool = _pager(pooled), _pager(pooled).expert_pool.pools[0]
    token = torch.tensor([[3]], device=device)
    expected, got = [], []
    with torch.no_grad():
        for _ in range(2):  # warm-up: the pool's first fetches, the caches of shapes
            pooled(token)
        fetched = int(pool.counts[0])
        for step in range(8):
            expected.append(resident(token).argmax(-1))
            paged, syncs = pager.stats.bytes_h2d, HOST_SYNCS[0]
            recorder = HostTraffic(device, _hosts(pooled))
            with recorder, torch.device("meta"):
                logits = pooled(token)
            assert recorder.found == [], (step, recorder.found)
            assert HOST_SYNCS[0] == syncs and pager.stats.bytes_h2d == paged
            got.append(logits.argmax(-1))
            token = expected[-1]
    assert int(pool.counts[0]) > fetched  # the recorded steps fetched into the pool
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_recorder_sees_each_kind_of_host_traffic():
    """Each thing the recorder is for, done on purpose on the emulated device, is recorded: a Python
    value written by indexing, a tensor made without ``device=`` (on meta here), a host master read
    by an ordinary op, a read of a device value on the host; a plain device op is not."""
    master = torch.randn(4, 3)
    table = torch.zeros(5, dtype=torch.int64)
    cases = {
        "lift_fresh": lambda: table.__setitem__(4, -1),
        "off the step's device": lambda: table.index_select(0, torch.arange(2)),
        "reads a host master": lambda: master.to("cpu").index_select(0, table[:2]),
        "read on the host": lambda: table.sum().item(),
    }
    for what, run in cases.items():
        recorder = HostTraffic("cpu", [master])
        with recorder, torch.device("meta"):
            run()
        assert any(what in f for f in recorder.found), (what, recorder.found)
    recorder = HostTraffic("cpu", [master])
    with recorder, torch.device("meta"):
        table[4:].fill_(-1)
        torch.where(table >= 0, table, 7).index_select(0, table[:2])
    assert recorder.found == []


def test_the_pools_fetch_without_the_native_gather_refuses_cuda_graph_capture(monkeypatch):
    """Without the extension's gather kernel the fetch copies the whole host stack with a blocking
    copy: under capture it raises, naming the stack and its bytes, instead of failing in torch."""
    monkeypatch.setattr(pool_ops, "_HAVE_GATHER", False)
    dst, host, dest = torch.zeros(2, 3), torch.randn(4, 3), torch.tensor([2, 0, 2, 1])
    pool_ops.masked_row_gather(dst, host, dest)  # not capturing: the fallback's copies
    assert torch.equal(dst, host[[1, 3]])
    monkeypatch.setattr(pool_ops, "capturing_on", lambda device: True)
    with pytest.raises(RuntimeError, match=r"\(4, 3\) torch.float32 host stack \(48 bytes\) cannot be captured"):
        pool_ops.masked_row_gather(dst, host, dest)


def test_a_pooled_decode_step_captures_in_a_cuda_graph_and_replays_the_resident_tokens(device):
    """On a GPU: the pooled step captured once (after two warm-up steps) replays the resident
    model's greedy tokens, its LRU decisions and fetches replayed on the device."""
    if device != "cuda" or not torch.cuda.is_available():
        pytest.skip("captures a CUDA graph: runs with OFFTENSOR_TEST_DEVICE=cuda")
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from decode_steps import decode, graphed

    resident, pooled = _models("cuda")
    start = torch.tensor([[3]], device="cuda")
    replay, _ = graphed(pooled, start, torch.device("cuda"))
    expected, _ = decode(resident, start, 12, torch.device("cuda"))
    got, _ = decode(replay, start, 12, torch.device("cuda"))
    assert torch.equal(got, expected)
    assert _pager(pooled).expert_pool.report()["fetches"] > 0
