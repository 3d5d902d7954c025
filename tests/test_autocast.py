"""A wrapped model under ``torch.autocast`` with grad on: autocast casts each float32 weight to its
lower precision before the op, and its cast cache and autograd keep that cast. Made as a plain
device tensor, every offloaded weight of the forward stayed on the device in bfloat16 until the
autocast region ended: device memory outside the budget, half the offloaded model. The cast is a
lazy cast now (``offtensor.cast_views``): an OffloadedTensor over the weight's host bytes that each
op pages and casts, with the values of torch's cast (also after the weight is written while the
cast lives), bit for bit with the unwrapped model under the same autocast."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import cast_views

GiB = 1024**3


def _build():
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])


def _pair(device, budget=600 * 1024):
    model = _build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})
    return _build().to(device), model


def _weight_casts_alive() -> int:
    """Plain bfloat16 tensors shaped as a weight that Python can see (what a cast returned)."""
    gc.collect()
    return sum(1 for o in gc.get_objects() if type(o) is torch.Tensor and o.dtype == torch.bfloat16
               and o.shape == (256, 256))


@pytest.mark.parametrize("x_needs_grad", [False, True])
def test_autocast_with_grad_on_keeps_no_weight_cast_on_the_device(x_needs_grad, device):
    reference, model = _pair(device)
    kind = torch.device(device).type
    x = torch.randn(4, 256, device=device, requires_grad=x_needs_grad)
    outs = []
    for m in (reference, model):
        with torch.autocast(kind, dtype=torch.bfloat16):
            y = m(x)
            if m is model:
                assert _weight_casts_alive() == 0  # (the cache and the graph hold lazy casts)
                assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes
            loss = y.float().square().sum()
        loss.backward()
        outs.append(y)
    assert torch.equal(outs[0], outs[1])
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad.cpu(), q.grad.cpu()), name
    if x_needs_grad:
        assert x.grad is not None


def test_an_optimizer_step_inside_one_autocast_region_sees_the_casts_torch_keeps(device):
    # torch's cache keeps each weight's cast for the whole region, so a forward after an optimizer
    # step inside it still reads the casts made before the step. A lazy cast reads the weight's
    # bytes, so before the step writes them it takes a copy of them: the same values.
    reference, model = _pair(device)
    kind = torch.device(device).type
    x = torch.randn(4, 256, device=device)
    results = []
    for m in (reference, model):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.5)
        outs = []
        with torch.autocast(kind, dtype=torch.bfloat16):
            for _ in range(3):
                y = m(x)
                y.float().square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                outs.append(y.detach())
        results.append((outs, [p.detach().cpu().clone() for p in m.parameters()]))
    for a, b in zip(results[0][0], results[1][0]):
        assert torch.equal(a, b)
    for a, b in zip(results[0][1], results[1][1]):
        assert torch.equal(a, b)


def test_a_weight_cast_in_a_forward_with_grad_on_is_a_lazy_cast_with_torchs_values(device):
    _, model = _pair(device)
    w = model[0].weight
    expected = w.detach().cpu().to(torch.float16)
    cast = w.to(torch.float16)
    assert isinstance(cast, ot.OffloadedTensor) and cast.dtype == torch.float16 and cast.requires_grad
    assert torch.equal(cast.detach().cpu(), expected)
    assert cast.tolist() == expected.tolist()
    assert torch.equal(cast.t().contiguous().cpu(), expected.t().contiguous())
    assert torch.equal(cast.view(torch.int16).cpu(), expected.view(torch.int16))  # its bytes are the cast's
    # A write of the weight leaves the cast as it was; a write of the cast leaves the weight.
    with torch.no_grad():
        w.add_(1.0)
        assert torch.equal(cast.cpu(), expected)
        before = w.detach().cpu().clone()
        copy = w.to(torch.float16)
        copy.mul_(2)
        assert torch.equal(copy.cpu(), (before.to(torch.float16) * 2))
        assert torch.equal(w.detach().cpu(), before)
    with torch.no_grad():
        plain = w.to(torch.float16)
    assert type(plain) is torch.Tensor  # no graph keeps it: the plain cast it always was


def test_autocast_runs_under_activation_checkpointing_and_saved_tensors_on_the_host(device):
    from torch.utils.checkpoint import checkpoint

    reference, model = _pair(device)
    kind = torch.device(device).type
    x = torch.randn(4, 256, device=device, requires_grad=True)
    for wrap_forward in (lambda m: checkpoint(m, x, use_reentrant=False),):
        grads = []
        for m in (reference, model):
            m.zero_grad()
            with torch.autocast(kind, dtype=torch.bfloat16):
                y = wrap_forward(m)
            y.float().sum().backward()
            grads.append([p.grad.cpu() for p in m.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads))
    grads = []
    for m in (reference, model):
        m.zero_grad()
        with torch.autograd.graph.save_on_cpu(), torch.autocast(kind, dtype=torch.bfloat16):
            y = m(x)
        y.float().sum().backward()
        grads.append([p.grad.cpu() for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_no_lazy_cast_is_left_once_a_step_ends(device):
    reference, model = _pair(device)
    kind = torch.device(device).type
    with torch.autocast(kind, dtype=torch.bfloat16):
        y = model(torch.randn(2, 256, device=device))
    y.float().sum().backward()
    del y
    gc.collect()
    assert cast_views.ALIVE[0] == 0


def test_factories_shaped_like_a_lazy_cast_take_its_dtype_without_casting_the_weight(device):
    _, model = _pair(device)
    cast = model[0].weight.to(torch.float16)
    master = cast._master
    for like in (torch.zeros_like(cast), torch.empty_like(cast), cast.new_zeros(3), torch.ones_like(cast)):
        assert type(like) is torch.Tensor and like.dtype == torch.float16
    assert "_cast" in cast.__dict__ and cast._master is master  # (not made a tensor of its own)


def test_a_transformers_model_trains_under_autocast_as_unwrapped(device):
    # A tied-embedding Llama, float32 weights, a third of them within the budget: two AdamW steps
    # under autocast(bfloat16), losses and weights bit for bit with the unwrapped model's.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)

    def build():
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(config).to(device)

    reference, model = build(), build()
    total = sum(p.numel() * p.element_size() for p in reference.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ot.wrap_model(model, budget_gb=total / 3 / GiB, device=device)
    ids = torch.randint(0, 300, (2, 9), device=device)
    kind = torch.device(device).type
    runs = []
    for m in (reference, model):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-3)
        losses = []
        for _ in range(2):
            with torch.autocast(kind, dtype=torch.bfloat16):
                loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        runs.append((losses, [p.detach().cpu() for p in m.parameters()]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes


def _cast_views_frames(code) -> bool:
    return code.co_filename.endswith(f"offtensor{__import__('os').sep}cast_views.py")


@pytest.mark.parametrize("what", ["a write of the weight", "a read of the cast's host bytes"])
def test_an_interrupt_at_any_bytecode_of_a_lazy_casts_copy_loses_nothing(what, device):
    # A KeyboardInterrupt raised at every 2nd opcode of cast_views' frames while a write of the weight
    # moves its lazy casts to a copy (or a host read makes one a tensor of its own): the op is cut
    # short or done, and done again it leaves the weight written and the cast with torch's values.
    import sys

    from test_interrupts_atomic import _InterruptAt

    def attempt(tracer):
        _, model = _pair(device)
        w = model[0].weight
        before = w.detach().cpu().clone()
        cast = w.to(torch.float16)
        sys.settrace(tracer)
        try:
            if what == "a write of the weight":
                with torch.no_grad():
                    w.add_(1.0)
            else:
                cast.tolist()
        except KeyboardInterrupt:
            sys.settrace(None)
            if what == "a write of the weight":
                with torch.no_grad():
                    w.add_(1.0)
        finally:
            sys.settrace(None)
        written = before + 1.0 if what == "a write of the weight" else before
        assert torch.equal(w.detach().cpu(), written)
        assert torch.equal(cast.detach().cpu(), before.to(torch.float16))
        assert cast.tolist() == before.to(torch.float16).tolist()

    counter = _InterruptAt(-1, _cast_views_frames)
    attempt(counter)
    assert counter.count > 10
    for n in range(1, counter.count + 1, 2):
        attempt(_InterruptAt(n, _cast_views_frames))


def test_a_write_through_a_view_of_a_lazy_cast_is_seen_through_the_cast(device):
    # Views of one cast alias each other as views of a plain tensor do: a write through a row of
    # ``cast.detach()`` (F.embedding's max_norm renormalises its weight so) is read through ``cast``;
    # the weight it was cast from is untouched.
    _, model = _pair(device)
    w = model[0].weight
    before = w.detach().cpu().clone()
    cast = w.to(torch.float16)
    rows = cast.detach()[1:3]
    with torch.no_grad():
        rows.fill_(3.0)
    expected = before.to(torch.float16)
    expected[1:3] = 3.0
    assert torch.equal(cast.detach().cpu(), expected)
    assert torch.equal(rows.cpu(), expected[1:3])
    assert torch.equal(w.detach().cpu(), before)
