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

The first ``OFFTENSOR_OPINFO_TIGHT_SAMPLES`` (2; 4 runs twice as many) float32 samples of each op whose largest tensor is
at least 64 bytes; about ten seconds."""

from __future__ import annotations

import itertools
import os
import warnings

import pytest
import torch

import offtensor
import opinfo_variants
from offtensor import BudgetError
from offtensor.pager import Pager
from opinfo_variants import (Mismatch, Skip, _full_name, _input_tensor_count, _offloadable, _sample_tensors, run_fn,
                             run_grad, run_inplace)
from test_opinfo import _op_db, _quick_sample_inputs

pytestmark = pytest.mark.opinfo

SAMPLES = int(os.environ.get("OFFTENSOR_OPINFO_TIGHT_SAMPLES", "2"))


class _Tight:
    """An ``opinfo_variants.Offloader`` stand-in: each tensor offloaded to one pager of ``budget``."""

    style = "whole"

    def __init__(self, device: str, budget: int):
        self.device, self.pager = device, Pager(torch.device(device), budget_bytes=budget)

    def __call__(self, t: torch.Tensor):
        return offtensor.offload(t.detach(), self.device, pager=self.pager)

    def check_untouched(self) -> None:
        pass  # (each tensor is its own master: no padding around it to check)


# variant: (which ops have it, whether samples require grad, the run, the splits: which tensors are
# offloaded, None for all, else whether the sample's input is the frozen one).
VARIANTS = {
    "fn": (lambda op: True, False, lambda op, sample, device, frozen: run_fn(op, sample, device, "whole"), (None,)),
    "grad": (lambda op: op.supports_autograd, True,
             lambda op, sample, device, frozen: run_grad(op, sample, device, "whole", frozen), (False, True)),
    "inplace": (lambda op: op.inplace_variant is not None, False,
                lambda op, sample, device, frozen: run_inplace(op, sample, device, "whole"), (None,)),
}


def _verdict(variant: str, op, sample, device: str, frozen, monkeypatch) -> str:
    tensors, inputs = _sample_tensors(sample), _input_tensor_count(sample)
    sizes = [t.numel() * t.element_size() for i, t in enumerate(tensors)
             if _offloadable(t, device) and (frozen is None or (i < inputs) == frozen)]
    if not sizes or max(sizes) < 64:
        raise Skip("no offloaded tensor of 64 bytes")
    tight = _Tight(device, max(sizes) // 2)
    monkeypatch.setattr(opinfo_variants, "Offloader", lambda device, style: tight)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            VARIANTS[variant][2](op, sample, device, frozen)
        except BudgetError as error:
            assert "bytes" in str(error)
            return "refused"
        except Mismatch:
            if not any("offtensor" in str(w.message) for w in caught):
                raise
            return "warned"
    assert tight.pager.stats.peak_device_bytes <= tight.pager.budget_bytes
    return "ran"


# The floor under the share of samples that run (the reference runs them all): 0.99 of the ops, of
# the gradients and of the in-place ops run on the CPU (0.998, 0.996 and 0.997 of 4 samples an op;
# 0.83, 0.79 and 0.97 before any op with a CPU kernel ran on the host masters where no slice fits:
# pools, convolutions of an offloaded input, interpolation, in-place products, batch norms writing
# offloaded running statistics, out= products). The rest: random ops (``rrelu``, ``normal``,
# ``bernoulli``).
@pytest.mark.parametrize("variant, floor", [("fn", 0.98), ("grad", 0.98), ("inplace", 0.98)])
def test_every_op_with_tensors_beyond_the_budget_runs_right_or_raises_budget_error(variant, floor, device, monkeypatch):
    has, requires_grad, _, splits = VARIANTS[variant]
    counts = {"ran": 0, "warned": 0, "refused": 0}
    wrong = []
    with _quick_sample_inputs():
        for op in _op_db():
            if not has(op) or torch.float32 not in op.supported_dtypes(torch.device(device).type):
                continue
            try:
                samples = list(itertools.islice(op.sample_inputs(device, torch.float32, requires_grad=requires_grad),
                                                SAMPLES))
            except Exception:  # noqa: BLE001 - a sample generator torch cannot run here is not ours
                continue
            for (i, sample), frozen in itertools.product(enumerate(samples), splits):
                try:
                    counts[_verdict(variant, op, sample, device, frozen, monkeypatch)] += 1
                except Skip:
                    pass
                except Exception as error:  # noqa: BLE001 - every failure is listed, not just the first
                    wrong.append(f"{_full_name(op)} sample {i} (frozen input: {frozen}): "
                                 f"{type(error).__name__}: {str(error)[:300]}")
    assert not wrong, "\n".join(wrong)
    print(f"\n{variant}: {counts}")  # (shown with -s: ran, warned and refused samples)
    total = sum(counts.values())
    assert total > 200 and (counts["ran"] + counts["warned"]) / total >= floor, counts
