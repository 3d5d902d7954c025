"""PyTorch's module database (``torch.testing._internal.common_modules.module_db``) wrapped at budgets
below its bytes, as the OpInfo sweep runs ``op_db``: every module with weights, on some of its
samples, everything offloadable (``policy={"offload": ["*"]}``), at budgets from 0.3 to 0.9 of its
bytes, with and without grad. Each cell is either refused at wrap time with a BudgetError, or runs
within its budget and gives the unwrapped module's outputs (and, with grad, its inputs' gradients)
bit for bit, or wrap warned that it may not (tiles of a dtype not known to be exact, a fast path
skipped).

By default 3 samples per module at budgets 0.3, 0.5, 0.7 and 0.9 run (well under a minute);
``OFFTENSOR_MODULEDB_FULL=1`` (or ``OFFTENSOR_OPINFO_FULL=1``) runs every sample at every tenth from
0.3 to 0.9."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

import offtensor as ot
from offtensor.pager import BudgetError


def _import_module_db():
    """``common_modules``, imported as test_opinfo.py imports op_db: torch.testing._internal's
    common_utils freezes torch.backends flags and loads its own hypothesis profile at import; give
    the rest of the session its normal flags and the project's profile back."""
    import hypothesis

    previous = getattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
    try:
        return pytest.importorskip("torch.testing._internal.common_modules")
    finally:
        setattr(torch.backends, "__allow_nonbracketed_mutation_flag", previous)
        hypothesis.settings.load_profile("offtensor")


common_modules = _import_module_db()

GiB = 1 << 30
FULL = any(os.environ.get(v, "") not in ("", "0") for v in ("OFFTENSOR_MODULEDB_FULL", "OFFTENSOR_OPINFO_FULL"))
SAMPLES = None if FULL else 3
FRACTIONS = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9) if FULL else (0.3, 0.5, 0.7, 0.9)
# What wrap says when it cannot promise bit-identical results.
INEXACT_WARNINGS = ("narrower than", "may differ", "last bits")


def _modules():
    return [m for m in common_modules.module_db if "Lazy" not in m.module_cls.__name__]


def _samples(info, requires_grad):
    try:
        samples = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=requires_grad,
                                          training=False)
    except Exception:  # a sample generator that needs what this build lacks
        return []
    return [s for s in samples if s.forward_input is not None]


def _build(info, sample):
    torch.manual_seed(0)
    module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).eval()
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in module.parameters()):
        return None
    return module


def _weight_bytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in [*module.parameters(), *module.buffers()]}.values())


def _tensors(tree):
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _run(module, sample, grad, device):
    """Outputs of ``module`` on ``sample`` and, with grad, the gradients of the inputs that require it."""
    args, kwargs = copy.deepcopy((sample.forward_input.args, sample.forward_input.kwargs))
    args, kwargs = torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, (args, kwargs))
    torch.manual_seed(1)
    with torch.enable_grad() if grad else torch.no_grad():
        out = module(*args, **kwargs)
    outs = _tensors(out)
    grads = []
    if grad:
        inputs = [t for t in _tensors((args, kwargs)) if t.requires_grad]
        diff = [o for o in outs if o.requires_grad and o.is_floating_point()]
        if inputs and diff:
            grads = torch.autograd.grad([o.sum() for o in diff], inputs, allow_unused=True)
    return [o.detach().cpu() for o in outs] + [g.cpu() for g in grads if g is not None]


@pytest.mark.parametrize("info", _modules(), ids=lambda m: m.name)
def test_every_budget_wrap_accepts_runs_the_module_bit_identically_or_warns(info, device):
    # On main: wrap accepted and the forward raised BudgetError in many cells (Linear, Conv,
    # ConvTranspose, Bilinear, RNNCell, norms with multi-dim weights); nn.Transformer differed
    # without a warning.
    cells = 0
    for grad in (False, True):
        taken = 0
        for sample in _samples(info, requires_grad=grad):
            if SAMPLES is not None and taken >= SAMPLES:
                break
            module = _build(info, sample)
            if module is None or not any(True for _ in module.parameters()) or not _weight_bytes(module):
                continue
            module = module.to(device)
            try:
                expected = _run(module, sample, grad, device)
            except Exception:  # the reference itself cannot run this sample here
                continue
            taken += 1
            for fraction in FRACTIONS:
                wrapped = copy.deepcopy(module)
                budget = int(fraction * _weight_bytes(module))
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    try:
                        ot.wrap_model(wrapped, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]},
                                      prefetch=False)
                    except BudgetError:
                        continue  # refused at wrap time: honest
                    cells += 1
                    where = f"{info.name} sample {taken}, grad={grad}, {fraction} of {_weight_bytes(module)} bytes"
                    got = _run(wrapped, sample, grad, device)  # a BudgetError here is the failure this test is for
                warned = any(any(w in str(c.message) for w in INEXACT_WARNINGS) for c in caught)
                same = len(got) == len(expected) and all(map(torch.equal, got, expected))
                assert same or warned, f"{where}: differs from the unwrapped module without a warning"
                s = ot.stats(wrapped)
                assert s.peak_device_bytes <= s.budget_bytes, where
    if not cells:
        pytest.skip(f"{info.name}: no sample with weights that a budget below its bytes admits")
