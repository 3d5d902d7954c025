"""PyTorch's OpInfo database with every tensor of a sample offloaded to a pager whose budget is half
the sample's largest tensor: the paths an op takes when its arguments do not fit (tiles, slices,
pieces, lines, the host master) meet every op torch has, not only the ones a model's weights meet.

Gradients too: the trained tensors plain, the frozen ones (the sample's input, or its other
tensors: a weight) offloaded to a pager whose budget is half the largest of them.

In-place ops likewise, every tensor offloaded, the written one read back from its master and
through the device.

What runs must be right: equal to the op on plain tensors bit for bit, or different only where
offtensor warned (a sum over slices, a random fill drawn slice by slice), and within the budget.
What cannot run raises ``BudgetError``, naming the bytes, and nothing else: a path that cuts an op
it does not understand raised torch's own error for a valid call (``_foreach_mm``'s one element cut
as if elementwise: "shapes cannot be multiplied"). Most samples must run: the share that does is
held above a floor, so a path that stops serving ops shows here.

The first ``OFFTENSOR_OPINFO_TIGHT_SAMPLES`` (4) float32 samples of each op whose largest tensor is
at least 64 bytes; about ten seconds."""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch

import offtensor
from offtensor import BudgetError
from offtensor.pager import Pager
import opinfo_variants
from opinfo_variants import (Mismatch, Skip, _compare, _full_name, _input_tensor_count, _map_sample, _offloadable,
                             _reference, _sample_tensors, _seeded, run_grad, run_inplace)
from test_opinfo import _op_db, _quick_sample_inputs

pytestmark = pytest.mark.opinfo

SAMPLES = int(os.environ.get("OFFTENSOR_OPINFO_TIGHT_SAMPLES", "4"))
# Of the samples that the reference runs, the share that runs offloaded within half their largest
# tensor (0.83, 0.78 of the gradients and 0.97 of the in-place ops, on the CPU when written; the rest are activation ops with
# every argument offloaded: pools, convolutions of an offloaded input, interpolation, batch norm).
RUN_FLOOR, GRAD_RUN_FLOOR, INPLACE_RUN_FLOOR = 0.8, 0.75, 0.9


def _verdict(op, sample, device: str):
    tensors = _sample_tensors(sample)
    flags = [_offloadable(t, device) for t in tensors]
    sizes = [t.numel() * t.element_size() for t, f in zip(tensors, flags) if f]
    if not sizes or max(sizes) < 64:
        raise Skip("no offloadable tensor of 64 bytes")
    budget = max(sizes) // 2

    def reference():
        clones = [t.detach().clone() for t in tensors]
        inp, args, kwargs = _map_sample(sample, lambda i, t: clones[i])
        return (op.op(inp, *args, **kwargs), None), None

    (expected, _), _ = _reference(reference)
    pager = Pager(torch.device(device), budget_bytes=budget)
    offloaded = [offtensor.offload(t.detach(), device, pager=pager) if f else t.detach().clone()
                 for t, f in zip(tensors, flags)]
    inp, args, kwargs = _map_sample(sample, lambda i, t: offloaded[i])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            actual = _seeded(lambda: op.op(inp, *args, **kwargs))
        except BudgetError as error:
            assert "bytes" in str(error)
            return "refused"
    assert pager.stats.peak_device_bytes <= budget, f"peak {pager.stats.peak_device_bytes} over {budget}"
    try:
        _compare(actual, expected)
    except Mismatch:
        if not any("offtensor" in str(w.message) for w in caught):
            raise
        return "warned"
    return "ran"


class _Tight:
    """An ``opinfo_variants.Offloader`` stand-in: each frozen tensor offloaded to one pager of ``budget``."""

    style = "whole"

    def __init__(self, device: str, budget: int):
        self.device, self.pager = device, Pager(torch.device(device), budget_bytes=budget)

    def __call__(self, t: torch.Tensor):
        return offtensor.offload(t.detach(), self.device, pager=self.pager)

    def check_untouched(self) -> None:
        pass  # (each tensor is its own master: no padding around it to check)


def _inplace_verdict(op, sample, device: str, monkeypatch):
    sizes = [t.numel() * t.element_size() for t in _sample_tensors(sample) if _offloadable(t, device)]
    if not sizes or max(sizes) < 64:
        raise Skip("no offloadable tensor of 64 bytes")
    tight = _Tight(device, max(sizes) // 2)
    monkeypatch.setattr(opinfo_variants, "Offloader", lambda device, style: tight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run_inplace(op, sample, device, "whole")
        except BudgetError as error:
            assert "bytes" in str(error)
            return "refused"
        except Mismatch:
            if not any("offtensor" in str(w.message) for w in caught):
                raise
            return "warned"
    assert tight.pager.stats.peak_device_bytes <= tight.pager.budget_bytes
    return "ran"


def _grad_verdict(op, sample, device: str, input_is_frozen: bool, monkeypatch):
    tensors = _sample_tensors(sample)
    inputs = _input_tensor_count(sample)
    sizes = [t.numel() * t.element_size() for i, t in enumerate(tensors)
             if (i < inputs) == input_is_frozen and _offloadable(t, device)]
    if not sizes or max(sizes) < 64:
        raise Skip("no frozen tensor of 64 bytes")
    tight = _Tight(device, max(sizes) // 2)
    monkeypatch.setattr(opinfo_variants, "Offloader", lambda device, style: tight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            run_grad(op, sample, device, "whole", input_is_frozen)
        except BudgetError as error:
            assert "bytes" in str(error)
            return "refused"
        except Mismatch:
            if not any("offtensor" in str(w.message) for w in caught):
                raise
            return "warned"
    assert tight.pager.stats.peak_device_bytes <= tight.pager.budget_bytes
    return "ran"


def test_every_op_with_its_arguments_beyond_the_budget_runs_right_or_raises_budget_error(device):
    counts = {"ran": 0, "warned": 0, "refused": 0}
    wrong = []
    with _quick_sample_inputs():
        for op in _op_db():
            if torch.float32 not in op.supported_dtypes(torch.device(device).type):
                continue
            try:
                samples = list(itertools.islice(op.sample_inputs(device, torch.float32, requires_grad=False), SAMPLES))
            except Exception:  # noqa: BLE001 - a sample generator torch cannot run here is not ours
                continue
            for i, sample in enumerate(samples):
                try:
                    counts[_verdict(op, sample, device)] += 1
                except Skip:
                    pass
                except Exception as error:  # noqa: BLE001 - every failure is listed, not just the first
                    wrong.append(f"{_full_name(op)} sample {i}: {type(error).__name__}: {str(error)[:300]}")
    assert not wrong, "\n".join(wrong)
    total = sum(counts.values())
    assert total > 1000 and (counts["ran"] + counts["warned"]) / total >= RUN_FLOOR, counts


def test_every_gradient_with_frozen_tensors_beyond_the_budget_is_right_or_raises_budget_error(device, monkeypatch):
    counts = {"ran": 0, "warned": 0, "refused": 0}
    wrong = []
    with _quick_sample_inputs():
        for op in _op_db():
            if not op.supports_autograd or torch.float32 not in op.supported_dtypes(torch.device(device).type):
                continue
            try:
                samples = list(itertools.islice(op.sample_inputs(device, torch.float32, requires_grad=True), SAMPLES))
            except Exception:  # noqa: BLE001 - a sample generator torch cannot run here is not ours
                continue
            for i, sample in enumerate(samples):
                for input_is_frozen in (False, True):
                    try:
                        counts[_grad_verdict(op, sample, device, input_is_frozen, monkeypatch)] += 1
                    except Skip:
                        pass
                    except Exception as error:  # noqa: BLE001 - every failure is listed, not just the first
                        wrong.append(f"{_full_name(op)} sample {i} (frozen input: {input_is_frozen}): "
                                     f"{type(error).__name__}: {str(error)[:300]}")
    assert not wrong, "\n".join(wrong)
    total = sum(counts.values())
    assert total > 300 and (counts["ran"] + counts["warned"]) / total >= GRAD_RUN_FLOOR, counts


def test_every_in_place_op_on_tensors_beyond_the_budget_writes_right_or_raises_budget_error(device, monkeypatch):
    counts = {"ran": 0, "warned": 0, "refused": 0}
    wrong = []
    with _quick_sample_inputs():
        for op in _op_db():
            if op.inplace_variant is None or torch.float32 not in op.supported_dtypes(torch.device(device).type):
                continue
            try:
                samples = list(itertools.islice(op.sample_inputs(device, torch.float32), SAMPLES))
            except Exception:  # noqa: BLE001 - a sample generator torch cannot run here is not ours
                continue
            for i, sample in enumerate(samples):
                try:
                    counts[_inplace_verdict(op, sample, device, monkeypatch)] += 1
                except Skip:
                    pass
                except Exception as error:  # noqa: BLE001 - every failure is listed, not just the first
                    wrong.append(f"{_full_name(op)} sample {i}: {type(error).__name__}: {str(error)[:300]}")
    assert not wrong, "\n".join(wrong)
    total = sum(counts.values())
    assert total > 300 and (counts["ran"] + counts["warned"]) / total >= INPLACE_RUN_FLOOR, counts
