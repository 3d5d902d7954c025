"""torch's module utilities on a wrapped model, each against an unwrapped copy bit for bit and within
the budget: RNNs (whose kernel takes ``_flat_weights``, a list of the module's parameters) trained,
flattened, re-assigned and cast; ``swa_utils.AveragedModel`` (EMA with buffers) and ``update_bn``;
``parameters_to_vector`` / ``vector_to_parameters``; gradient clipping, foreach or not;
``GradScaler`` with ``unscale_``; transformers' ``prune_linear_layer`` (head pruning);
``fuse_conv_bn_eval`` / ``fuse_linear_bn_eval``; ``skip_init``; ``requires_grad_`` and
``zero_grad(set_to_none=False)``; ``share_memory()`` for Hogwild training in forked processes."""

from __future__ import annotations

import copy
import multiprocessing
import os

import pytest
import torch
from torch import nn

import offtensor as ot

GiB = 1 << 30


def _bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def _wrapped_twin(model: nn.Module, device, fraction: float) -> nn.Module:
    twin = copy.deepcopy(model)
    ot.wrap_model(twin, budget_gb=fraction * _bytes(model) / GiB, device=device)
    assert ot.stats(twin).offloaded_bytes > 0
    return twin


def _within_budget(model: nn.Module) -> None:
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def _same(a, b) -> bool:
    return torch.equal(a.detach().cpu(), b.detach().cpu())


def _same_parameters(a: nn.Module, b: nn.Module, grads: bool = False) -> bool:
    pairs = zip(a.parameters(), b.parameters())
    return all(_same(p.grad, q.grad) if grads else _same(p, q) for p, q in pairs)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 200), nn.ReLU(), nn.Linear(200, 8))


class _Recurrent(nn.Module):
    def __init__(self, cls, **kwargs):
        super().__init__()
        self.inp, self.mid = nn.Linear(16, 256), nn.Linear(256, 16)
        self.rnn = cls(16, 24, **kwargs)
        self.head = nn.Linear(24 * (2 if kwargs.get("bidirectional") else 1), 300)

    def forward(self, x):
        return self.head(self.rnn(self.mid(self.inp(x)))[0])


@pytest.mark.parametrize("cls", [nn.LSTM, nn.GRU, nn.RNN])
@pytest.mark.parametrize("kwargs", [{}, {"num_layers": 2, "bidirectional": True, "batch_first": True}])
def test_rnns_train_flatten_and_take_new_weights_as_unwrapped(device, cls, kwargs):
    torch.manual_seed(0)
    reference = _Recurrent(cls, **kwargs).to(device)
    model = _wrapped_twin(reference, device, 0.5)
    x = torch.randn(3, 5, 16, device=device)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (reference, model)]
    for _ in range(2):
        outputs = [m(x) for m in (reference, model)]
        assert _same(*outputs)
        for out, opt in zip(outputs, optimizers):
            out.square().sum().backward()
        assert _same_parameters(reference, model, grads=True)
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        assert _same_parameters(reference, model)
    new = torch.randn(reference.rnn.weight_ih_l0.shape, device=device)
    for m in (reference, model):
        m.rnn.flatten_parameters()
        m.rnn.weight_ih_l0 = nn.Parameter(new.clone())  # _flat_weights must follow
    assert all(w is getattr(model.rnn, n) for w, n in zip(model.rnn._flat_weights, model.rnn._flat_weights_names))
    assert _same(reference(x), model(x))
    _within_budget(model)


def test_an_averaged_model_of_a_wrapped_model_averages_as_unwrapped(device):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn, update_bn

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(16, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 200)).to(device)
    model = _wrapped_twin(reference, device, 0.1)
    averaged = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9), use_buffers=True) for m in (reference, model)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    for _ in range(3):
        x = torch.randn(4, 16, device=device)
        for m, avg, opt in zip((reference, model), averaged, optimizers):
            m(x).square().sum().backward()
            opt.step()
            opt.zero_grad()
            avg.update_parameters(m)
        assert _same_parameters(*averaged)
    loader = [torch.randn(4, 16, device=device) for _ in range(2)]
    x = torch.randn(4, 16, device=device)
    for avg in averaged:
        update_bn(loader, avg)
        avg.eval()
    assert _same(averaged[0](x), averaged[1](x))
    _within_budget(model)
    _within_budget(averaged[1].module)  # a deep copy: wrapped on a pager of its own


def test_vectors_clipping_and_a_grad_scaler_step_offloaded_weights_as_unwrapped(device):
    from torch.nn.utils import clip_grad_norm_, clip_grad_value_, parameters_to_vector, vector_to_parameters

    reference = _mlp().to(device)
    model = _wrapped_twin(reference, device, 0.12)  # the largest weight larger than the room
    vector = parameters_to_vector(reference.parameters())
    assert _same(vector, parameters_to_vector(model.parameters()))
    for m in (reference, model):
        vector_to_parameters(vector.flip(0).clone(), m.parameters())
    assert any(isinstance(p, ot.OffloadedTensor) for p in model.parameters())
    scalers = [torch.amp.GradScaler(device.split(":")[0], init_scale=2.0 ** 10) for _ in range(2)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.01, foreach=True) for m in (reference, model)]
    for step in range(3):
        x = torch.randn(4, 16, device=device)
        norms = []
        for m, scaler, opt in zip((reference, model), scalers, optimizers):
            scaler.scale(m(x).square().sum()).backward()
            scaler.unscale_(opt)
            norms.append(clip_grad_norm_(m.parameters(), 0.5, foreach=step != 1))
            clip_grad_value_(m.parameters(), 0.01, foreach=step != 2)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        assert _same(*norms) and _same_parameters(reference, model)
    _within_budget(model)


def test_pruned_heads_fused_batch_norms_and_skip_init_layers_as_unwrapped(device):
    from torch.nn.utils.fusion import fuse_conv_bn_eval, fuse_linear_bn_eval
    from transformers.pytorch_utils import prune_linear_layer

    torch.manual_seed(0)
    reference = nn.ModuleDict({"conv": nn.Conv2d(8, 64, 3), "bn": nn.BatchNorm2d(64), "q": nn.Linear(64, 256),
                               "bn1": nn.BatchNorm1d(256), "o": nn.Linear(256, 100)}).to(device)
    for bn in (reference.bn, reference.bn1):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    reference.eval()
    model = _wrapped_twin(reference, device, 0.3)
    x = torch.randn(2, 8, 10, 10, device=device)

    def forward(m):
        return m.o(m.bn1(m.q(m.bn(m.conv(x)).mean((2, 3)))))

    keep = torch.arange(256, device=device)[32:]  # heads pruned as transformers' prune_heads did
    torch.manual_seed(5)
    fresh = torch.nn.utils.skip_init(nn.Linear, 256, 100, device=device)
    fresh.weight.data.normal_()
    fresh.bias.data.zero_()
    for m in (reference, model):
        m.conv, m.bn = fuse_conv_bn_eval(m.conv, m.bn), nn.Identity()
        m.q, m.bn1 = fuse_linear_bn_eval(m.q, m.bn1), nn.Identity()
        m.q = prune_linear_layer(m.q, keep)
        m.o = prune_linear_layer(copy.deepcopy(fresh), keep, dim=1)
    assert _same(forward(reference), forward(model))
    for m in (reference, model):
        m.requires_grad_(False)
        m.requires_grad_(True)
        forward(m).square().sum().backward()
        m.zero_grad(set_to_none=False)
        forward(m).sum().backward()
    assert _same_parameters(reference, model, grads=True)
    _within_budget(model)


def _hogwild(model: nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(3):
        model(torch.randn(4, 16)).square().sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="Hogwild here forks its workers")
def test_share_memory_shares_offloaded_weights_so_hogwild_workers_train_them(device):
    """``model.share_memory()`` puts every weight in shared memory so that forked workers train
    one model. Before, an offloaded weight's host master stayed private: the workers' steps on it
    were lost. And a forward of a weight whose copy the parent had cached read that stale copy."""
    if device != "cpu":
        pytest.skip("a forked worker may not use a GPU that its parent has used")
    reference = _mlp()
    everything = {"offload": ["*.weight"]}
    model = copy.deepcopy(reference)
    ot.wrap_model(model, budget_gb=2 * _bytes(model) / GiB, device=device, policy=everything)  # all cached
    x = torch.randn(4, 16)
    for m in (reference, model):
        m.share_memory()
    assert all(p.is_shared() for p in model.parameters())
    for m in (reference, model):
        with torch.no_grad():
            m(x)
    assert ot.stats(model).cached_bytes == ot.stats(model).offloaded_bytes  # the parent's cache is warm
    fork = multiprocessing.get_context("fork")
    for m in (reference, model):
        for seed in (1, 2):
            worker = fork.Process(target=_hogwild, args=(m, seed))
            worker.start()
            worker.join()
            assert worker.exitcode == 0
    with torch.no_grad():
        assert _same(reference(x), model(x))
    _within_budget(model)


def _add_to_leaves(model: nn.Module) -> None:
    with torch.no_grad():
        model[0].weight.a.add_(1)
        model[0].weight.b.add_(2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the worker is forked")
def test_share_memory_shares_a_wrapper_subclass_weights_offloaded_leaves(device):
    """A TwoTensor weight's own storage holds no bytes (torch's ``share_memory_`` of one crashes the
    process): each offloaded leaf's host master is shared instead."""
    if device != "cpu":
        pytest.skip("a forked worker may not use a GPU that its parent has used")
    from torch.testing._internal.two_tensor import TwoTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))
    model[0].weight = nn.Parameter(TwoTensor(torch.randn(256, 64), torch.randn(256, 64)))
    reference = copy.deepcopy(model)
    ot.wrap_model(model, budget_gb=0.5 * _bytes(model) / GiB, device=device, policy={"offload": ["*"]})
    model.share_memory()
    assert all(leaf.is_shared() for leaf in (model[0].weight.a, model[0].weight.b, model[1].weight))
    worker = multiprocessing.get_context("fork").Process(target=_add_to_leaves, args=(model,))
    worker.start()
    worker.join()
    assert worker.exitcode == 0
    _add_to_leaves(reference)
    x = torch.randn(2, 64)
    with torch.no_grad():
        expected, out = reference(x), model(x)
    assert _same(expected.a, out.a) and _same(expected.b, out.b)
