"""torchao quantised weights: weight-only int8, float8 and int4 (intx) configs that
run on CPU, in both orders (quantise then wrap, wrap then quantise), give the unwrapped quantised
model's outputs bit for bit, offloaded and within budget; ``ot.offload`` takes a quantised tensor;
``ot.on_host`` lets quantisation read the host masters instead of paging each weight whole.

The quantised tensors are wrapper subclasses: their plain leaves (qdata, scale, zero_point) are
what offtensor offloads (offtensor/leaves.py), the outer object and its class stay."""

from __future__ import annotations

import gc

import pytest
import torch

import offtensor as ot

GiB = 1 << 30


def _torchao():
    return pytest.importorskip("torchao.quantization", reason="torchao is optional (requirements-test.txt)")


def _configs():
    q = _torchao()
    return {
        "int8": q.Int8WeightOnlyConfig(),
        "float8": q.Float8WeightOnlyConfig(),
        "int4": q.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=q.PerGroup(32)),
    }


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128), torch.nn.Linear(128, 128),
    ).to(torch.bfloat16).eval()


def _bytes(model) -> int:
    """Bytes of the model's plain tensors: a quantised weight's leaves."""
    from offtensor import leaves

    return sum(t.numel() * t.element_size() for p in model.parameters() for t in leaves.leaf_tensors(p))


def _quantised(config):
    model = _model()
    _torchao().quantize_(model, config)
    return model


@pytest.mark.parametrize("order", ["quantise_then_wrap", "wrap_then_quantise"])
@pytest.mark.parametrize("config", ["int8", "float8", "int4"])
def test_a_quantised_model_wrapped_in_either_order_gives_the_unwrapped_outputs_within_budget(config, order, device):
    cfg = _configs()[config]
    reference = _quantised(cfg).to(device)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(1)).to(device, torch.bfloat16)
    with torch.no_grad():
        expected = reference(x)
    if order == "quantise_then_wrap":
        model = _quantised(cfg)
        ot.wrap_model(model, budget_gb=0.5 * _bytes(model) / GiB, device=device)
    else:
        model = _model()
        ot.wrap_model(model, budget_gb=0.4 * _bytes(model) / GiB, device=device)
        ot.reset_stats(model)
        with ot.on_host(model):
            _torchao().quantize_(model, cfg)
        assert ot.stats(model).bytes_h2d == 0, "quantising paged the weights instead of reading their masters"
    weight = model[0].weight
    assert type(weight) is type(reference[0].weight) and isinstance(weight, torch.nn.Parameter)
    assert isinstance(weight.qdata, ot.OffloadedTensor)
    assert weight.device == reference[0].weight.device  # on a GPU: cuda, not the host it was quantised on
    with torch.no_grad():
        got = model(x)
    assert torch.equal(got, expected)
    gc.collect()  # the float weights replaced by quantisation die with their masters
    s = ot.stats(model)
    assert 0 < s.offloaded_bytes <= _bytes(model)  # leaf bytes only: no float master left behind
    assert s.bytes_h2d > 0 and s.peak_device_bytes <= s.budget_bytes, s


def test_wrap_then_quantise_without_on_host_pages_the_weights_and_still_matches(device):
    """Without ``ot.on_host`` quantisation reads each offloaded weight through paging, which works
    while each fits the room; the result is the same."""
    cfg = _configs()["int8"]
    # Quantised on the device, as the wrapped model's paged weights are: a GPU's kernels need not
    # round as the host's do.
    reference = _model().to(device)
    _torchao().quantize_(reference, cfg)
    model = _model()
    ot.wrap_model(model, budget_gb=0.8 * _bytes(model) / GiB, device=device)
    ot.reset_stats(model)
    _torchao().quantize_(model, cfg)
    assert ot.stats(model).bytes_h2d > 0
    x = torch.randn(2, 128).to(device, torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def test_offload_of_a_quantised_tensor_keeps_its_class_with_offloaded_leaves(device):
    """On main: AttributeError: 'Tensor' object has no attribute 'tensor_data_names'."""
    weight = _quantised(_configs()["int8"])[0].weight.detach()
    offloaded = ot.offload(weight, device=device)
    assert type(offloaded) is type(weight)
    assert isinstance(offloaded.qdata, ot.OffloadedTensor) and isinstance(offloaded.scale, ot.OffloadedTensor)
    assert torch.equal(offloaded.qdata.cpu(), weight.qdata) and torch.equal(offloaded.scale.cpu(), weight.scale)
    # Computed values are compared with the plain quantised weight on the same device: a GPU's
    # kernels need not round as the host's do.
    on_device = weight.to(device)
    assert offloaded.device == on_device.device and offloaded.dequantize().device == on_device.device
    assert torch.equal(offloaded.dequantize(), on_device.dequantize())
    x = torch.randn(3, 128, dtype=torch.bfloat16).to(device)
    assert torch.equal(torch.nn.functional.linear(x, offloaded), torch.nn.functional.linear(x, on_device))


def test_on_host_gives_back_the_weights_it_lent_and_a_write_through_them_reaches_the_next_forward(device):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    ot.wrap_model(model, budget_gb=0.5 * _bytes(model) / GiB, device=device)
    weight = next(p for p in model.parameters() if isinstance(p, ot.OffloadedTensor))
    x = torch.randn(2, 64).to(device)
    with torch.no_grad():
        model(x)  # caches device copies of the offloaded weights
        with ot.on_host(model) as same:
            assert same is model
            lent = next(p for p in model.parameters() if p.shape == weight.shape and p is not weight)
            assert type(lent) is torch.nn.Parameter and lent.device.type == "cpu"
            lent.mul_(2)
        assert weight in list(model.parameters())
        doubled = weight.cpu()
    assert torch.equal(doubled, lent.detach())
    reference = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    reference.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    reference.to(device)  # compared on the same device: a GPU's kernels need not round as the host's do
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


@pytest.mark.parametrize("config", ["int8", "float8", "int4"])
def test_a_wrapped_quantised_weight_is_on_its_leaves_device_when_they_move_to_another_device_type(config):
    """On a GPU the leaves move from the host to cuda, another device type: wrap_model's own
    pipeline (``prepare``) onto a meta pager does the same move on any machine (the emulated
    device is the host's own type, where an outer object left on the host looks right). Before:
    the quantised tensor stayed on cpu around meta leaves, and ``detach()`` (``state_dict()``)
    raised "Attempted to set the storage of a tensor on device "meta" to a storage on different
    device "cpu"" from torchao's ``return_and_correct_aliasing``."""
    from offtensor import leaves
    from offtensor.config import OffloadConfig
    from offtensor.model.prepare import prepare

    model = _quantised(_configs()[config])
    weight = model[0].weight
    cfg = OffloadConfig(budget_gb=1.0, device=torch.device("meta"), policy="*", strict=False)
    prepare(model, cfg, cfg.device)
    meta = torch.device("meta")
    assert model[0].weight is weight and all(isinstance(t, ot.OffloadedTensor) for t in leaves.leaf_tensors(weight))
    assert weight.device == meta and weight.untyped_storage().device == meta
    assert weight.detach().device == meta and model.state_dict()["0.weight"].device == meta
    assert model(torch.randn(2, 128, dtype=torch.bfloat16, device="meta")).device == meta


@pytest.mark.parametrize("config", ["int8", "float8", "int4"])
def test_on_host_lends_quantised_weights_over_their_leaves_host_masters(config, device):
    """A transform over an already quantised, wrapped model (here: dequantising every weight back
    to a plain Parameter) reads each quantised weight as its class rebuilt over its leaves' host
    masters: nothing paged. Before, ``ot.on_host`` lent only plain offloaded weights, and
    ``dequantize()`` paged every quantised leaf onto the device whole."""
    from offtensor import leaves

    cfg = _configs()[config]
    model = _quantised(cfg)
    weights = [m.weight for m in model if isinstance(m, torch.nn.Linear)]
    originals = [w.dequantize() for w in weights]  # before wrapping: the host's own values
    ot.wrap_model(model, budget_gb=0.5 * _bytes(model) / GiB, device=device, policy="*")
    assert all(isinstance(leaf, ot.OffloadedTensor) for w in weights for leaf in leaves.leaf_tensors(w))
    ot.reset_stats(model)
    with torch.no_grad(), ot.on_host(model):
        linears = [m for m in model if isinstance(m, torch.nn.Linear)]
        for linear, weight, original in zip(linears, weights, originals, strict=True):
            lent = linear.weight
            assert type(lent) is type(weight) and lent is not weight and lent.device.type == "cpu"
            assert torch.equal(lent.dequantize(), original)
            linear.weight = torch.nn.Parameter(lent.dequantize(), requires_grad=False)
        assert ot.stats(model).bytes_h2d == 0, "reading the lent quantised weights paged their leaves"
    assert all(isinstance(m.weight, ot.OffloadedTensor) for m in linears)  # placed as usual
    reference = _quantised(cfg)
    for m in reference:
        if isinstance(m, torch.nn.Linear):
            m.weight = torch.nn.Parameter(m.weight.dequantize(), requires_grad=False)
    x = torch.randn(2, 128, dtype=torch.bfloat16).to(device)
    with torch.no_grad():
        assert torch.equal(model(x), reference.to(device)(x))
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes, s


CASTS = {
    "half()": lambda m: m.half(),
    "to(float16)": lambda m: m.to(torch.float16),
    "float()": lambda m: m.float(),
    "to(float32)": lambda m: m.to(torch.float32),
}


@pytest.mark.parametrize("cast", list(CASTS))
@pytest.mark.parametrize("config", ["int8", "float8", "int4"])
def test_a_cast_of_a_wrapped_quantised_model_is_the_unwrapped_cast_with_its_leaves_offloaded(config, cast, device):
    """A cast of a quantised model whose leaves are offloaded: each quantised weight cast as its
    class casts it unwrapped (torchao's intx casts its scale under ``.to(dtype)`` but not under
    ``.half()``; its Int8Tensor and Float8Tensor keep their dtype), computed on the host with
    nothing paged, the leaves the cast changed offloaded at their new size, the ones it left kept
    as they are. Before: torch's path paged the leaves and kept plain device tensors outside the
    budget, then failed counting them."""
    from offtensor import leaves

    cfg = _configs()[config]
    model = _quantised(cfg)
    weight = model[0].weight
    ot.wrap_model(model, budget_gb=0.5 * _bytes(model) / GiB, device=device, policy="*")
    before = leaves.leaf_tensors(weight)
    assert all(isinstance(leaf, ot.OffloadedTensor) for leaf in before)
    ot.reset_stats(model)
    CASTS[cast](model)
    assert ot.stats(model).bytes_h2d == 0, "the cast paged the quantised leaves"
    reference = CASTS[cast](_quantised(cfg))
    assert model[0].weight is weight and type(weight) is type(reference[0].weight)
    assert weight.dtype == reference[0].weight.dtype and weight.device == torch.device(device)
    for got, old, want in zip(leaves.leaf_tensors(weight), before, leaves.leaf_tensors(reference[0].weight),
                              strict=True):
        assert isinstance(got, ot.OffloadedTensor) and got.dtype == want.dtype
        assert torch.equal(got.cpu(), want)
        assert (got is old) == (want.dtype == old.dtype)  # a leaf the cast leaves as it is is not copied
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).to(device, reference[0].bias.dtype)
    reference.to(device)
    with torch.no_grad():
        try:
            want = reference(x)
        except RuntimeError as error:  # .half() of Int8Tensor: a bf16 weight beside fp16 biases, unwrapped too
            with pytest.raises(RuntimeError, match="same dtype"):
                model(x)
            assert "same dtype" in str(error)
        else:
            assert torch.equal(model(x), want)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes, s


def test_a_cast_of_a_quantised_weight_with_resident_and_offloaded_leaves_keeps_each_where_it_was(device):
    """The budget keeps the small scales resident and offloads the int8 data: ``.to(float16)``
    casts the resident scale on the host copy and puts it back on the device, resident, within
    budget; the offloaded data is left as it is."""
    from offtensor import leaves

    cfg = _configs()["int4"]
    model = _quantised(cfg)
    ot.wrap_model(model, budget_gb=0.6 * _bytes(model) / GiB, device=device)
    mixed = [m.weight for m in model if isinstance(m, torch.nn.Linear)
             and len({isinstance(leaf, ot.OffloadedTensor) for leaf in leaves.leaf_tensors(m.weight)}) == 2]
    assert mixed, "no quantised weight with both resident and offloaded leaves at this budget"
    where = [[isinstance(leaf, ot.OffloadedTensor) for leaf in leaves.leaf_tensors(w)] for w in mixed]
    ot.reset_stats(model)
    model.to(torch.float16)
    assert ot.stats(model).bytes_h2d == 0
    assert [[isinstance(leaf, ot.OffloadedTensor) for leaf in leaves.leaf_tensors(w)] for w in mixed] == where
    assert all(w.dtype == torch.float16 and w.scale.dtype == torch.float16 for w in mixed)
    reference = _quantised(cfg).to(torch.float16).to(device)
    x = torch.randn(3, 128).to(device, torch.float16)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.resident_bytes + 0 <= s.budget_bytes and s.peak_device_bytes <= s.budget_bytes, s
