"""Any model, any budget: working sets as ops really need them, ops over lists paged in
pieces, bit-identical linear for every input layout, identity of RNN and attention weights, and
pointwise ops and optimizer steps on a weight past the room in slices."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.pager import BudgetError, Pager
from offtensor.tensor import new_host_master, wrap_host

GiB = 1 << 30


def _offload_under(pager, t):
    return wrap_host(new_host_master(t, pin=False), pager)


def _weight_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())


# ---------------------------------------------------------------------------- 3. bit-identical linear


@pytest.mark.parametrize("shape", [(256, 64, 4, 7), (512, 128, 3, 9)])
def test_linear_with_a_non_contiguous_3d_input_matches_a_weight_that_requires_grad(device, shape):
    # aten::matmul folds a non-contiguous 3-D input into one mm when the weight requires grad and
    # runs bmm otherwise, even under no_grad: the paged copy must require grad like the weight.
    k, n, b, s = shape
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(n, k, device=device))
    bias = nn.Parameter(torch.randn(n, device=device))
    x = torch.randn(s, b, k, device=device).transpose(0, 1)
    assert not x.is_contiguous() and x.dim() == 3
    offloaded_weight = nn.Parameter(ot.offload(weight.detach().cpu(), device=device))
    offloaded_bias = nn.Parameter(ot.offload(bias.detach().cpu(), device=device))
    with torch.no_grad():
        expected = F.linear(x, weight, bias)
        assert torch.equal(F.linear(x, offloaded_weight, offloaded_bias), expected)
        assert torch.equal(F.linear(x, offloaded_weight, bias), expected)
    assert offloaded_weight.requires_grad


def test_linear_with_a_contiguous_3d_input_whose_unit_dim_has_another_stride_matches_a_weight_that_requires_grad(device):
    # fsmt on transformers 5.17: a (2, 1, 32) decoder state with strides (32, 64, 1) counts as
    # contiguous, yet aten::matmul folds it only when the weight requires grad (2.98e-08 apart).
    torch.manual_seed(0)
    weight = nn.Parameter(torch.randn(96, 32, device=device))
    x = torch.randn(1, 2, 32, device=device).transpose(0, 1)
    assert x.is_contiguous() and x.stride() == (32, 64, 1)
    offloaded_weight = nn.Parameter(ot.offload(weight.detach().cpu(), device=device))
    with torch.no_grad():
        assert torch.equal(F.linear(x, offloaded_weight), F.linear(x, weight))
        assert torch.equal(x @ offloaded_weight.t(), x @ weight.t())


# ---------------------------------------------------------------------------- 1. working sets, lists in pieces


def test_cat_of_two_offloaded_weights_larger_than_the_free_room_pages_one_at_a_time(device):
    # mobilebert: torch.cat([decoder.weight.t(), dense.weight]) with room for one weight only.
    pager = Pager(torch.device(device), 2048)  # holds b (1536 bytes), not a and b (2560)
    a, b = torch.randn(16, 16), torch.randn(24, 16)
    oa, ob = _offload_under(pager, a), _offload_under(pager, b)
    assert torch.equal(torch.cat([oa.t(), ob.t()], 1), torch.cat([a.t(), b.t()], 1).to(device))
    assert torch.equal(torch.cat([ob, oa]), torch.cat([b, a]).to(device))
    assert torch.equal(torch.stack([oa, ob[:16]], dim=1), torch.stack([a, b[:16]], dim=1).to(device))
    assert pager.stats.peak_device_bytes <= 2048


def test_foreach_op_over_offloaded_tensors_larger_than_the_free_room_runs_per_element(device):
    pager = Pager(torch.device(device), 1500)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    oa, ob = _offload_under(pager, a), _offload_under(pager, b)
    for got, want in zip(torch._foreach_mul([oa, ob], 2.0), [a * 2, b * 2]):
        assert torch.equal(got, want.to(device))
    t1, t2 = [torch.randn(16, 16, device=device) for _ in range(2)], [torch.randn(16, 16, device=device) for _ in range(2)]
    scalars = torch.tensor([2.0, 3.0])  # one per element, as a tensor: split with the lists
    for got, want in zip(torch._foreach_addcmul([oa, ob], t1, t2, scalars), torch._foreach_addcmul([a.to(device), b.to(device)], t1, t2, scalars)):
        assert torch.equal(got, want)
    # The functional fused Adam step gives five lists back: joined per return, not mixed.
    state = dict(lr=0.1, beta1=0.9, beta2=0.99, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
    lists = lambda *ts: ([t.to(device) for t in ts], [torch.ones(16, 16, device=device)] * 2,
                         [torch.zeros(16, 16, device=device)] * 2, [torch.zeros(16, 16, device=device)] * 2, [],
                         [torch.tensor(1.0, device=device)] * 2)
    got, want = torch.ops.aten._fused_adam([oa, ob], *lists()[1:], **state), torch.ops.aten._fused_adam(*lists(a, b), **state)
    assert [len(g) for g in got] == [len(w) for w in want] == [2, 2, 2, 2, 0]
    assert all(torch.equal(g, w) for gs, ws in zip(got, want) for g, w in zip(gs, ws))
    torch._foreach_add_([oa, ob], [torch.ones(16, 16, device=device)] * 2)
    assert torch.equal(oa.cpu(), a + 1) and torch.equal(ob.cpu(), b + 1)
    assert pager.stats.peak_device_bytes <= 1500


def test_an_op_no_slice_or_tile_covers_runs_on_the_host_masters_within_the_budget(device):
    """A grid sample reads its image and grid whole, 1536 bytes where the budget holds 1500: neither
    slices nor tiles cut it, so it runs on the host masters (before, ``BudgetError`` for a budget
    wrap had accepted), gives the plain result and takes no device room for the arguments."""
    pager = Pager(torch.device(device), 1500)
    image, grid = torch.randn(1, 1, 16, 16), torch.rand(1, 8, 8, 2) * 2 - 1  # 1024 and 512 bytes
    want = F.grid_sample(image, grid, align_corners=False)
    got = F.grid_sample(_offload_under(pager, image), _offload_under(pager, grid), align_corners=False)
    assert type(got) is torch.Tensor and got.device.type == device
    assert torch.equal(got.cpu(), want)
    assert pager.stats.host_ops == 1 and pager.stats.host_read_bytes == 1536
    assert pager.stats.peak_device_bytes <= 1500


def test_a_random_op_that_needs_more_than_the_budget_at_once_still_raises_budget_error(device):
    """An op that draws random numbers is not run on the host (its generator is not the device's):
    ``rrelu``'s noise over a tensor larger than the budget is refused, naming the bytes."""
    pager = Pager(torch.device(device), 1500)
    with pytest.raises(BudgetError, match="needs 4096 bytes"):
        F.rrelu(_offload_under(pager, torch.randn(32, 32)), training=True)


def test_a_pointwise_op_whose_arguments_exceed_the_budget_together_runs_in_slices(device):
    pager = Pager(torch.device(device), 1500)
    a, b = torch.randn(16, 16), torch.randn(16, 16)
    assert torch.equal((_offload_under(pager, a) + _offload_under(pager, b)).cpu(), a + b)
    assert pager.stats.peak_device_bytes <= 1500


class _CatHead(nn.Module):
    """mobilebert's prediction head: one op reads two weights of two modules."""

    def __init__(self):
        super().__init__()
        self.decoder = nn.Linear(64, 128, bias=False)
        self.dense = nn.Linear(128, 64, bias=False)
        self.small = nn.ModuleList(nn.Linear(8, 8) for _ in range(30))

    def forward(self, x):
        w = torch.cat([self.decoder.weight.t(), self.dense.weight], dim=0)
        for m in self.small:
            x = x + m(x[..., :8]).sum()
        return x @ w.t()


def test_a_model_whose_op_concatenates_two_offloaded_weights_runs_within_the_budget(device):
    torch.manual_seed(0)
    model = _CatHead().eval().to(device)
    x = torch.randn(3, 128, device=device)
    with torch.no_grad():  # the plain model on the same device: the same kernels, the same bits
        expected = model(x)
    ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / GiB, device=device, prefetch=False)
    assert isinstance(model.decoder.weight, ot.OffloadedTensor) and isinstance(model.dense.weight, ot.OffloadedTensor)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_every_tensor_of_one_module_counts_in_one_working_set():
    from offtensor.placement import Weight, choose_placement

    def weight(name, nbytes):
        return Weight([name], nbytes, (nbytes // 4, 1), nbytes)

    lstm = [weight(f"rnn.{n}", 100_000) for n in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")]
    p = choose_placement(lstm + [weight("other.weight", 150_000)], budget_bytes=10**7, offload_bytes=10**6, prefetch=False)
    assert p.working_set_bytes == 400_000  # the cuDNN LSTM op reads all four at once


class _StackedLSTMs(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnns = nn.ModuleList(nn.LSTM(32, 32) for _ in range(3))

    def forward(self, x):
        for rnn in self.rnns:
            x = rnn(x)[0]
        return x


@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_an_rnn_whose_weights_together_exceed_the_budget_is_refused_at_wrap_not_in_forward(device, fraction):
    # An RNN's kernel reads its weights itself (cuDNN every layer's at once), so dispatch cannot tile
    # it. On main placement planned tiles for them and forward raised BudgetError in mkldnn_rnn_layer.
    lstm = nn.LSTM(64, 64, num_layers=2)
    total = _weight_bytes(lstm)
    with pytest.raises(ot.BudgetError, match=rf"needs .* \({total} bytes\) on the device at once"):
        ot.wrap_model(lstm, budget_gb=fraction * total / 2**30, device=device)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in lstm.parameters())  # left as it was


def test_rnns_offloaded_one_by_one_run_bit_identically_within_the_budget(device):
    torch.manual_seed(0)
    model = _StackedLSTMs().eval()
    x = torch.randn(5, 2, 32)
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / 2**30, device=device)
    assert sum(isinstance(p, ot.OffloadedTensor) for p in model.parameters()) >= 4
    with torch.no_grad():
        assert torch.equal(model(x.to(device)), reference(x.to(device)))
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_stacked_experts_count_as_the_experts_one_op_pages_at_once():
    from offtensor.placement import Weight, choose_placement, working_set

    shape = (64, 32, 16)
    nbytes = 64 * 32 * 16 * 4
    assert working_set("model.layers.0.mlp.experts.down_proj", shape, nbytes) == nbytes // 64
    experts = [Weight([f"l.experts.{n}"], nbytes, shape, nbytes // 64) for n in ("gate_up_proj", "down_proj")]
    p = choose_placement(experts, budget_bytes=nbytes // 8, prefetch=False)
    # gate_up and down of one expert (two slices), not 8 routed experts of each stack
    assert p.working_set_bytes == 2 * nbytes // 64


# ---------------------------------------------------------------------------- 4. identity for every module


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn", "mha"])
def test_rnn_and_attention_modules_keep_their_parameter_objects_through_wrap_and_unwrap(device, kind):
    torch.manual_seed(0)
    if kind == "mha":
        module = nn.MultiheadAttention(32, 4)
        x = (torch.randn(5, 2, 32),) * 3
    else:
        module = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind](16, 32, num_layers=2)
        x = (torch.randn(5, 2, 16),)
    module.eval()
    objects = dict(module.named_parameters())
    expected = module(*x)[0].detach()
    reference = copy.deepcopy(module).to(device)
    ot.wrap_model(module, offload_gb=1, device=device)  # every weight offloaded
    assert all(isinstance(p, ot.OffloadedTensor) for p in module.parameters())
    assert all(p is objects[n] for n, p in module.named_parameters())
    with torch.no_grad():
        got = module(*(t.to(device) for t in x))[0]
        assert torch.equal(got, reference(*(t.to(device) for t in x))[0])
    torch.testing.assert_close(got.cpu(), expected)
    assert ot.stats(module).peak_device_bytes <= ot.stats(module).budget_bytes
    ot.unwrap_model(module)
    assert all(p is objects[n] for n, p in module.named_parameters())
    assert not any(isinstance(p, ot.OffloadedTensor) for p in module.parameters())
    if kind != "mha":
        assert all(w is objects[n] for w, n in zip(module._flat_weights, module._flat_weights_names))


# ---------------------------------------------------------------------------- training past the room


def _tiled_mlp(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)).to(device)
    return model, copy.deepcopy(model)


@pytest.mark.parametrize(
    "make",
    [
        lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
        lambda p: torch.optim.Adam(p, lr=1e-3),
        lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1, foreach=True),
    ],
    ids=["sgd-momentum-decay", "adam", "adamw-foreach"],
)
def test_an_optimizer_step_on_a_weight_larger_than_the_room_runs_in_slices_bit_identically(device, make):
    # Forward and backward tile the 256 KiB weight under a 128 KiB budget; the step's in-place updates
    # (add_, addcdiv_, lerp_, _foreach_mul_) and zeros_like(param) must run within it too.
    model, reference = _tiled_mlp(device)
    budget = 128 * 1024
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    assert isinstance(model[0].weight, ot.OffloadedTensor)
    assert model[0].weight.numel() * 4 > budget
    opt, ref_opt = make(model.parameters()), make(reference.parameters())
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to(device)
    for _ in range(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            m(x).square().sum().backward()
            o.step()
    assert torch.equal(model[0].weight.cpu(), reference[0].weight.cpu())
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    assert ot.stats(model).peak_device_bytes <= budget


def test_zeros_like_of_an_offloaded_weight_copies_nothing_to_the_device(device):
    pager = Pager(torch.device(device), 1 << 20)
    weight = _offload_under(pager, torch.randn(64, 32).t())
    for make in (torch.zeros_like, torch.empty_like, lambda w: torch.full_like(w, 3.0), lambda w: w.new_zeros(5)):
        out = make(weight)
        assert type(out) is torch.Tensor and out.device.type == torch.device(device).type
    zeros = torch.zeros_like(weight)
    assert zeros.stride() == weight.stride() and torch.equal(zeros.cpu(), torch.zeros(32, 64))
    assert pager.stats.bytes_h2d == 0


def test_a_pointwise_read_of_a_weight_larger_than_the_room_runs_in_slices(device):
    pager = Pager(torch.device(device), 16 * 1024)
    values = torch.randn(64, 128)  # 32 KiB
    weight = _offload_under(pager, values)
    mask = (torch.arange(128) % 3 == 0).to(device)
    assert torch.equal((weight * mask).cpu(), values * mask.cpu())
    # torch.equal (tagged pointwise, no meta kernel) raised NotImplementedError; it compares slices.
    other = values.clone()
    assert torch.equal(weight, other.to(device)) and torch.equal(other.to(device), weight)
    other[-1, -1] += 1
    assert not torch.equal(weight, other.to(device)) and not torch.equal(weight, values[:32].to(device))
    assert pager.stats.peak_device_bytes <= 16 * 1024
    if device == "cpu":  # a sum runs on the host master (host_compute): the op itself, in one kernel
        assert torch.equal(weight.sum(), values.sum()) and torch.equal(weight.sum(1), values.sum(1))
    assert torch.equal(weight.max().cpu(), values.max())  # each element read once: exact, no warning
    assert pager.stats.peak_device_bytes <= 16 * 1024
