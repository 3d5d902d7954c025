"""Parametrizations (``torch.nn.utils.parametrize``) of offloaded weights larger than the budget's
room: torch's ``orthogonal`` (every map, with and without trivialization), ``spectral_norm`` and
``weight_norm`` over any dim, registered before wrapping (planned in tiles) or after it; forward,
backward and AdamW steps give the unwrapped model's losses, outputs and weights bit for bit, within
the budget. A parametrization of the user's own, registered before wrapping, is counted whole and a
budget below it refused at wrap time, naming the weight and the bytes. And torch.ao's dynamic
quantisation of a wrapped model, which packs each weight once, as the unwrapped model's. Tiny
models built here."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import offtensor as ot

from test_weight_norm_in_slices import _conv, _mlp

GiB = 2**30
TIGHT = 4352  # one tile of 16 rows of a 64 x 64 weight, and 256 bytes: each weight is larger than that


def _wrap(model, device, budget=TIGHT):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # tiles narrower than 16 rows at this budget: said at wrap
        ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})


def _register(models, register):
    """``register`` on each of ``models`` from the same random state (orthogonal completes a
    non-square weight with random columns; spectral_norm starts its power iteration from random vectors)."""
    for m in models:
        torch.manual_seed(5)
        register(m)


def _pair(build, register, before, device, budget=TIGHT):
    model = build()
    if before:
        _register([model], register)
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device, budget)
    if not before:
        _register([model, reference], register)
    return model, reference


def _train_alike(model, reference, x, steps=2, forward=lambda m, x: m(x)):
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(steps):
        losses = []
        for m, opt in zip((model, reference), optimizers):
            opt.zero_grad()
            loss = forward(m, x).square().mean()
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        assert torch.equal(*losses), step
    with torch.no_grad():
        assert torch.equal(forward(model, x), forward(reference, x))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu()), name
    for (name, b), c in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b.cpu(), c.cpu()), name
    stats = ot.stats(model)
    assert 0 < stats.peak_device_bytes <= stats.budget_bytes


def _x(device):
    return torch.randn(16, 32, generator=torch.Generator().manual_seed(1)).to(device)


def _signal(device):
    return torch.randn(2, 8, 40, generator=torch.Generator().manual_seed(2)).to(device)


_WHEN = pytest.mark.parametrize("before", [True, False], ids=["registered-before", "registered-after"])


@_WHEN
@pytest.mark.parametrize("trivialization", [True, False], ids=["trivialization", "no-trivialization"])
@pytest.mark.parametrize("orthogonal_map", ["matrix_exp", "cayley", "householder"])
def test_orthogonal_of_weights_larger_than_the_room_trains_as_unwrapped(device, orthogonal_map, trivialization, before):
    """orthogonal reads its original only by ``tril`` / ``diagonal`` (on the host master) and
    multiplies its ``base`` into the result (mm, in tiles), yet wrap counted both whole: the budget
    was refused at wrap time, and registering after wrapping raised BudgetError. A square weight
    and a tall one (completed to a square ``base`` with random columns)."""
    def register(m):
        for i in (0, 2):
            parametrizations.orthogonal(m[i], orthogonal_map=orthogonal_map, use_trivialization=trivialization)

    model, reference = _pair(_mlp, register, before, device)
    original = model[2].parametrizations.weight.original
    assert isinstance(original, ot.OffloadedTensor) and original.numel() * 4 > TIGHT
    _train_alike(model, reference, _x(device))


@_WHEN
def test_spectral_norm_of_weights_larger_than_the_room_trains_as_unwrapped(device, before):
    """spectral_norm reads its original by ``mv`` (in tiles) and divides it by its norm (in
    slices); wrap counted it whole with its ``_u`` and ``_v`` and refused the budget."""
    def register(m):
        for i in (0, 2):
            parametrizations.spectral_norm(m[i])

    model, reference = _pair(_mlp, register, before, device)
    _train_alike(model, reference, _x(device))


@_WHEN
@pytest.mark.parametrize("dim", [1, 2, None], ids=["dim1", "dim2", "dimNone"])
def test_weight_norm_over_any_dim_of_a_weight_larger_than_the_room_trains_as_unwrapped(device, dim, before):
    """wav2vec2's ``dim=2`` (kernel positions): wrap counted the weight whole and refused the
    budget, registering after wrapping raised BudgetError; normalised in slices of that dim, a
    slice of the gradient went to the CPU kernel strided, which reads it as if contiguous (wrong
    gradients); ``g``'s norms at registration, in slices of columns, summed in another order. Over
    dim 1 and over the whole weight (``dim=None``: its norm on the host master) too."""
    model, reference = _pair(_conv, lambda m: parametrizations.weight_norm(m[2], dim=dim), before, device, 14464)
    assert model[2].parametrizations.weight.original1.numel() * 4 > 14464
    _train_alike(model, reference, _signal(device))


@_WHEN
def test_the_hook_based_spectral_norm_trains_as_unwrapped_and_unwraps(device, before):
    """The hook form leaves ``weight = weight_orig.data`` on the module until its first forward:
    a plain alias that kept the weight's old device storage once ``weight_orig`` was offloaded, so
    the budget wrap accepted held 16 KiB of it and the first forward raised BudgetError (\"only
    -12032 of the budget's 4352 bytes are free\"). It is offloaded with the storage it views now
    (registered after wrapping, it is a view of the offloaded weight from the start)."""
    def register(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecation of the hook form
            warnings.simplefilter("ignore", UserWarning)  # tiles narrower than 16 rows at this budget
            torch.nn.utils.spectral_norm(m[2])

    model, reference = _pair(_mlp, register, before, device)
    assert isinstance(model[2].weight, ot.OffloadedTensor)
    assert model[2].weight._master is model[2].weight_orig._master
    assert ot.stats(model).resident_bytes == 0
    _train_alike(model, reference, _x(device))
    ot.unwrap_model(model)
    assert not any(isinstance(t, ot.OffloadedTensor) for m in model.modules() for t in m.__dict__.values())
    with torch.no_grad():
        assert torch.equal(model(_x(device)), reference(_x(device)))


@_WHEN
def test_weight_norm_over_the_last_dim_is_planned_at_one_slice_without_a_warning_that_bits_may_differ(device, before):
    """Any number of slices of that dim gives the whole op's results bit for bit; planned as a
    convolution's output channels (16 slices, else 1) it warned that tiles narrower than 16 may
    differ in the last bits."""
    model = _conv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if before:
            parametrizations.weight_norm(model[2], dim=2)
        ot.wrap_model(model, budget_gb=14464 / GiB, device=device, policy={"offload": ["*"]})
        if not before:
            parametrizations.weight_norm(model[2], dim=2)
    assert isinstance(model[2].parametrizations.weight.original1, ot.OffloadedTensor)


def test_wav2vec2s_positional_convolution_larger_than_the_room_trains_as_unwrapped():
    """transformers' Wav2Vec2 weight-norms its positional convolution over ``dim=2``: wrap counted
    that weight whole (32 KiB here) and refused an 8 KiB budget."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
        conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0, layerdrop=0.0)  # (SpecAugment's masks draw from numpy's generator)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2Model(config)
    reference = copy.deepcopy(model)
    _wrap(model, "cpu", 8192)
    v = model.encoder.pos_conv_embed.conv.parametrizations.weight.original1
    assert isinstance(v, ot.OffloadedTensor) and v.numel() * 4 > 8192

    def hidden(m, x):
        torch.manual_seed(3)  # the same dropout masks for both
        return m(x).last_hidden_state

    _train_alike(model, reference, torch.randn(2, 400, generator=torch.Generator().manual_seed(1)), steps=1,
                 forward=hidden)


class _Symmetric(nn.Module):
    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.full((64, 1), 0.5))

    def forward(self, x):
        return x * self.scale


class _SymmetricFromUpper(_Symmetric):
    def right_inverse(self, w):
        return w.triu()  # a new original, placed as the parametrization is registered


@pytest.mark.parametrize("function", [_Symmetric, _Scaled, _SymmetricFromUpper])
def test_a_parametrization_of_the_users_own_registered_after_wrapping_trains_as_unwrapped(device, function):
    """One with a ``right_inverse`` had its new original counted whole as torch registered it, and
    refused: after torch had taken the weight off the module, which was left without one."""
    model, reference = _pair(_mlp, lambda m: parametrize.register_parametrization(m[2], "weight", function()),
                             False, device)
    assert isinstance(model[2].parametrizations.weight.original, ot.OffloadedTensor)
    _train_alike(model, reference, _x(device))


def test_a_parametrization_of_the_users_own_is_counted_whole_and_a_budget_below_it_refused_naming_it(device):
    """Its forward is the user's code, which may read the original whole with an op that has
    neither slices nor a host kernel: wrap counts it whole, refuses the budget before moving
    anything, and names the weight, the bytes and the parametrization (it named no parametrization)."""
    model = _mlp()
    parametrize.register_parametrization(model[2], "weight", _Symmetric())
    with pytest.raises(ot.BudgetError, match=r"'2\.parametrizations\.weight\.original'.*16384 bytes.*"
                                             r"the original of the parametrization _Symmetric, the user's own"):
        _wrap(model, device)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in model.parameters())


def _quantize_dynamic(model, qconfig, dtype, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization's own deprecation
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*deprecated")
        return torch.ao.quantization.quantize_dynamic(model, {nn.Linear: qconfig}, dtype=dtype, **kwargs)


@pytest.mark.parametrize("budget", [TIGHT, 20000], ids=["weights-larger-than-the-room", "weights-in-the-room"])
@pytest.mark.parametrize("scheme", ["qint8", "qint8-per-channel", "float16"])
def test_quantize_dynamic_of_a_wrapped_model_gives_the_unwrapped_quantised_model(scheme, budget):
    """Dynamic quantisation (a CPU flow, so the emulated device only) of a wrapped model, without
    ``ot.on_host``: ``quantize_per_tensor`` of a Linear's weight larger than the room raised
    BudgetError; and ``linear_prepack`` kept its page of the bias, whose memory the pager gave to
    the next copy, so a quantised layer added another weight's bytes as its bias."""
    from torch.ao import quantization as q
    qconfig, dtype = {"qint8": (q.default_dynamic_qconfig, torch.qint8),
                      "qint8-per-channel": (q.per_channel_dynamic_qconfig, torch.qint8),
                      "float16": (q.float16_dynamic_qconfig, torch.float16)}[scheme]
    model = _mlp()
    reference = _quantize_dynamic(copy.deepcopy(model), qconfig, dtype)
    _wrap(model, "cpu", budget)
    quantised = _quantize_dynamic(model, qconfig, dtype)
    x = _x("cpu")
    with torch.no_grad():
        model(x)  # pages every weight again, into the memory the packing read from
        assert torch.equal(quantised(x), reference(x))
    for i in (0, 2, 4):
        ours, theirs = (m[i]._packed_params._weight_bias() for m in (quantised, reference))
        assert torch.equal(ours[1], theirs[1]), i


def test_quantisation_in_place_of_a_wrapped_model_is_refused_before_it_changes_a_module():
    """torch.ao.quantization finds the modules to quantise by ``type(module)``, which for a module
    of a wrapped model is wrap's subclass of its class: ``quantize_dynamic(inplace=True)`` quantised
    nothing and raised nothing (the model stayed in floating point), and ``convert(inplace=True)``
    of modules given a qconfig by hand swapped none. Both are refused now, naming the way that
    works, before any module is quantised or given a qconfig; the model runs as before, and a
    quantised copy is still the unwrapped model's."""
    from torch.ao import quantization as q
    model = _mlp()
    reference = _quantize_dynamic(copy.deepcopy(model), q.default_dynamic_qconfig, torch.qint8)
    _wrap(model, "cpu", TIGHT)
    x = _x("cpu")
    with torch.no_grad():
        want = model(x)
    with pytest.raises(TypeError, match=r"in place \(inplace=True\) on a wrapped model would quantise nothing.*"
                                        r"torch\.nn\.modules\.container\.Sequential.*Quantise a copy"):
        _quantize_dynamic(model, q.default_dynamic_qconfig, torch.qint8, inplace=True)
    model[2].qconfig = q.default_dynamic_qconfig
    with pytest.raises(TypeError, match="would quantise nothing.*torch.nn.modules.linear.Linear"):
        q.convert(model, {nn.Linear: torch.ao.nn.quantized.dynamic.Linear}, inplace=True)
    del model[2].qconfig
    assert [type(m).__bases__[0] for m in model] == [type(m) for m in _mlp()]
    assert not any("qconfig" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(x), want)
        assert torch.equal(_quantize_dynamic(model, q.default_dynamic_qconfig, torch.qint8)(x), reference(x))


def _conv_bn_relu():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Linear(14, 14), nn.ReLU()).eval()
    with torch.no_grad():  # statistics of their own, so that the fusion changes the weights
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2)
    return model


def test_fusion_in_place_of_a_wrapped_model_is_refused_naming_the_way_that_works_and_a_fused_copy_is_exact():
    """``fuse_modules(inplace=True)`` (the usual step before eager quantisation) looked each group's
    types up by ``type(module)`` and stopped at torch's "did not find fuser method for: (Conv2d,
    BatchNorm2d, ReLU)", naming types it can fuse. It is refused now, saying why and what works,
    with no module changed; a fused copy (``inplace=False``) is the unwrapped model's, bit for bit,
    and a parametrization registered on a wrapped module still reads as one."""
    from torch.ao.quantization import fuse_modules
    groups = [["0", "1", "2"], ["3", "4"]]
    model = _conv_bn_relu()
    reference = fuse_modules(copy.deepcopy(model), groups)
    _wrap(model, "cpu", 6000)
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = model(x)
    before = [type(m) for m in model]
    with pytest.raises(TypeError, match=r"in place \(inplace=True\) on a wrapped model cannot fuse.*"
                                        r"torch\.nn\.modules\.conv\.Conv2d.*Fuse a copy \(fuse_modules\(model, \.\.\.\) "
                                        r"without inplace=True.*No module was fused"):
        fuse_modules(model, groups, inplace=True)
    assert [type(m) for m in model] == before
    with torch.no_grad():
        assert torch.equal(model(x), want)
        assert torch.equal(fuse_modules(model, groups)(x), reference(x))
    assert not parametrize.is_parametrized(model[3])
    parametrize.register_parametrization(model[3], "weight", _Symmetric())
    assert parametrize.is_parametrized(model[3], "weight") and isinstance(model[3].parametrizations, nn.ModuleDict)


def test_fx_graph_mode_quantisation_of_a_wrapped_model_is_refused_naming_the_copy_that_works():
    """``prepare_fx`` prepares the model's own modules (its graph module shares them) and finds
    them by type, so on a wrapped model it would quantise nothing; it was refused with the eager
    in-place message ("inplace=True", "quantize_dynamic"), which names neither what the user called
    nor what works. It names FX graph mode and ``prepare_fx(copy.deepcopy(model), ...)`` now, whose
    quantised model is the unwrapped one's, bit for bit; the wrapped model runs as before."""
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx
    model, x = _mlp().eval(), _x("cpu")

    def quantised(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization's own deprecations
            prepared = prepare_fx(m, get_default_qconfig_mapping("x86"), (x,))
            prepared(x)
            return convert_fx(prepared)

    reference = quantised(copy.deepcopy(model))
    _wrap(model, "cpu", 20000)
    with torch.no_grad():
        want = model(x)
    with pytest.raises(TypeError, match=r"FX graph mode \(prepare_fx.*would quantise nothing.*"
                                        r"prepare_fx\(copy\.deepcopy\(model\), \.\.\.\)"):
        quantised(model)
    assert not any("qconfig" in vars(m) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(x), want)
        assert torch.equal(quantised(copy.deepcopy(model))(x), reference(x))
