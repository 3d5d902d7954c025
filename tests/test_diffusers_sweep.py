"""A sweep of tiny diffusers models (transformers and DiTs, UNets, autoencoders, controlnets), as
tests/test_sweep.py is for transformers: each is built from the init dict of diffusers' own tests
(vendored in tests/diffusers_configs.py), run unwrapped, then wrapped at 30 % and at 60 % of its
weight bytes and run again on the same inputs.

Each budget has one expected outcome per model (``EXPECTED``), so a model whose outcome changes fails:

- ``refused``: ``wrap_model`` raises ``BudgetError`` (a table forward reads whole is larger than the
  budget: QwenImage's rope tables, plain attributes counted with the weights);
- ``exact``: no offtensor warning, outputs bit-identical, peak within the budget;
- ``sliced``: offtensor warned only that a table larger than the room is read in slices (OmniGen's
  ``pos_embed``), outputs bit-identical, peak within the budget;
- ``tiles``: offtensor warned that the budget leaves room only for output tiles narrower than its
  alignment, which sum in another order: outputs close to the unwrapped ones, peak within the budget.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import offtensor as ot

diffusers = pytest.importorskip("diffusers")
from diffusers_configs import MODELS, make_inputs  # noqa: E402

GiB = 1 << 30
FRACTIONS = (0.3, 0.6)

# diffusers class name -> (outcome at 30 %, outcome at 60 %)
EXPECTED = {
    # transformers and DiTs
    "AuraFlowTransformer2DModel": ("exact", "exact"),
    "CogVideoXTransformer3DModel": ("exact", "exact"),
    "CogView4Transformer2DModel": ("exact", "exact"),
    "Cosmos3OmniTransformer": ("tiles", "exact"),
    "DiTTransformer2DModel": ("tiles", "exact"),
    "EasyAnimateTransformer3DModel": ("exact", "exact"),
    "ErnieImageTransformer2DModel": ("tiles", "exact"),
    "Flux2Transformer2DModel": ("exact", "exact"),
    "FluxTransformer2DModel": ("exact", "exact"),
    "HunyuanDiT2DModel": ("exact", "exact"),
    "HunyuanVideoTransformer3DModel": ("exact", "exact"),
    "LTXVideoTransformer3DModel": ("tiles", "exact"),
    "LatteTransformer3DModel": ("tiles", "exact"),
    "NucleusMoEImageTransformer2DModel": ("refused", "refused"),
    "OmniGenTransformer2DModel": ("sliced", "sliced"),
    "PixArtTransformer2DModel": ("tiles", "exact"),
    "PriorTransformer": ("exact", "exact"),
    "QwenImageTransformer2DModel": ("refused", "exact"),
    "SanaTransformer2DModel": ("tiles", "exact"),
    "TransformerTemporalModel": ("exact", "exact"),
    "WanTransformer3DModel": ("exact", "exact"),
    "ZImageTransformer2DModel": ("exact", "exact"),
    # autoencoders
    "AutoencoderDC": ("exact", "exact"),
    "AutoencoderKL": ("exact", "exact"),
    "AutoencoderKLCogVideoX": ("exact", "exact"),
    "AutoencoderKLKVAE": ("exact", "exact"),
    "AutoencoderKLLTXVideo": ("exact", "exact"),
    "AutoencoderTiny": ("exact", "exact"),
    "VQModel": ("exact", "exact"),
    # UNets
    "UNet1DModel": ("exact", "exact"),
    "UNet2DConditionModel": ("exact", "exact"),
    "UNet2DModel": ("exact", "exact"),
    "UNet3DConditionModel": ("exact", "exact"),
    "UNetControlNetXSModel": ("exact", "exact"),
    # controlnets
    "ControlNetModel": ("exact", "exact"),
    "FluxControlNetModel": ("exact", "exact"),
    "HunyuanDiT2DControlNetModel": ("exact", "exact"),
    "QwenImageControlNetModel": ("refused", "exact"),
    "SD3ControlNetModel": ("exact", "exact"),
}


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}.values())


def _tensors(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for x in out for t in _tensors(x)]
    if isinstance(out, dict):
        return [t for x in out.values() for t in _tensors(x)]
    if hasattr(out, "to_tuple"):
        return _tensors(out.to_tuple())
    return []


def _to(value, device: str):
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return [_to(v, device) for v in value] if isinstance(value, list) else value


def _forward(model, inputs: dict) -> list:
    with torch.no_grad():  # a fresh copy of the inputs each time: a forward may write into one
        return _tensors(model(**{k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                                 for k, v in inputs.items()}))


def _outcome(model, inputs: dict, expected: list, fraction: float, device: str) -> str:
    """What wrapping ``model`` at ``fraction`` of its weight bytes gives: an outcome of ``EXPECTED``,
    or a sentence saying what went wrong."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ot.wrap_model(model, budget_gb=fraction * _weight_bytes(model) / GiB, device=device)
        except ot.BudgetError:
            return "refused"
        got = _forward(model, inputs)
    warned = {str(w.message) for w in caught if str(w.message).startswith("offtensor:")}
    tiles = {w for w in warned if "leaves room for output tiles narrower than" in w}
    sliced = {w for w in warned if "offloaded as a table that forward reads in slices" in w}
    if warned - tiles - sliced:
        return f"other warnings: {sorted(warned - tiles - sliced)}"
    s = ot.stats(model)
    if s.offloaded_bytes == 0:
        return "nothing offloaded"
    if s.peak_device_bytes > s.budget_bytes:
        return f"peak {s.peak_device_bytes} bytes over the budget of {s.budget_bytes}"
    if len(got) != len(expected) or any(a.shape != b.shape for a, b in zip(got, expected)):
        return "outputs of other shapes"
    if tiles:
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, msg=lambda m: f"tiles warned of, but the outputs are not close: {m}")
        return "tiles"
    if not all(torch.equal(a, b) for a, b in zip(got, expected)):
        difference = max((a.double() - b.double()).abs().max().item() for a, b in zip(got, expected) if a.numel())
        return f"outputs differ by {difference:.3g} without a warning of tiles"
    return "sliced" if sliced else "exact"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_tiny_diffusers_model_wrapped_at_30_and_60_percent_has_its_expected_outcome(name, device):
    init, spec = MODELS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' deprecations of some of its test configs' arguments
        model = getattr(diffusers, name)(**init).eval().to(device)
    for module in model.modules():  # .to() leaves plain tensor attributes (rope tables) behind: moved
        for attr, t in list(vars(module).items()):  # here, as a model's own tables on the GPU, on every device
            if type(t) is torch.Tensor:
                setattr(module, attr, t.to(device))
    inputs = {k: _to(v, device) for k, v in make_inputs(spec).items()}
    expected = _forward(model, inputs)
    assert expected and all(t.numel() for t in expected), "the unwrapped model gives no output"
    got = tuple(_outcome(copy.deepcopy(model), inputs, expected, f, device) for f in FRACTIONS)
    assert got == EXPECTED[name], f"{name}: {got} at {FRACTIONS}, expected {EXPECTED[name]}"


def test_every_vendored_diffusers_model_has_one_expected_outcome_per_budget():
    assert sorted(EXPECTED) == sorted(MODELS)
    assert all(len(outcomes) == len(FRACTIONS) for outcomes in EXPECTED.values())
