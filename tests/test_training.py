"""LoRA-style training through offloaded frozen weights, eager and compiled: adapter gradients
equal the unwrapped model's, an optimizer step gives the same adapters, the frozen masters stay
untouched, and autograd keeps no device copy of an offloaded weight between forward and backward
(backward pages again), so the budget holds across the whole step."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from torch import nn

import offtensor as ot

GiB = 1 << 30
IN, OUT, RANK, BATCH = 24, 40, 4, 5


class LoRALinear(nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.base = nn.Linear(in_features, out_features)
        self.lora_a = nn.Parameter(torch.randn(RANK, in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(out_features, RANK) * 0.1)

    @classmethod
    def around(cls, base: nn.Linear) -> "LoRALinear":
        """Adapters around an existing (frozen) linear layer."""
        lora = cls(base.in_features, base.out_features)
        lora.base = base
        return lora

    def forward(self, x):
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Alternating widths, so no activation has a weight's shape (see _saved_weight_copies).
    model = nn.Sequential(LoRALinear(IN, OUT), nn.GELU(), LoRALinear(OUT, IN), nn.GELU(), LoRALinear(IN, OUT),
                          nn.GELU(), LoRALinear(OUT, IN))
    for name, p in model.named_parameters():
        p.requires_grad_("lora" in name)
    return model


def _wrap(model, device):
    """Base weights offloaded; the cache holds half of them, so backward must page again."""
    base = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".base.weight" in n)
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".base.weight" not in n)
    return ot.wrap_model(model, budget_gb=(rest + base // 2) / GiB, device=device,
                         policy=lambda name: "offload" if ".base.weight" in name else "keep")


def _saved_weight_copies(model, run):
    """Tensors autograd saves for backward during ``run()`` that hold an offloaded weight's values
    in device memory (a plain tensor of a weight's shape that is not a view of its host master)."""
    offloaded = [p for p in model.parameters() if isinstance(p, ot.OffloadedTensor)]
    shapes = {tuple(p.shape) for p in offloaded} | {tuple(p.shape)[::-1] for p in offloaded}
    host_storages = {p._host.untyped_storage().data_ptr() for p in offloaded}
    copies = []

    def pack(t):
        if (
            not isinstance(t, ot.OffloadedTensor)
            and tuple(t.shape) in shapes
            and t.untyped_storage().data_ptr() not in host_storages
        ):
            copies.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = run()
    return copies, result


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_lora_gradients_and_optimizer_step_equal_the_unwrapped_model(device, backend):
    model = _model()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    frozen = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor)}
    assert frozen
    run = torch.compile(model, backend=backend) if backend else model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    generator = torch.Generator().manual_seed(1)
    for step in range(2):
        x = torch.randn(BATCH, IN, generator=generator).to(device)
        copies, loss = _saved_weight_copies(model, lambda: run(x).square().mean())
        assert not copies, [tuple(c.shape) for c in copies]
        loss.backward()
        reference_loss = reference(x).square().mean()
        reference_loss.backward()
        torch.testing.assert_close(loss, reference_loss)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if p.requires_grad:
                torch.testing.assert_close(p.grad, q.grad, msg=name)
            else:
                assert p.grad is None
        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if p.requires_grad:
            torch.testing.assert_close(p, q, msg=name)
    for name, p in model.named_parameters():
        if name in frozen:
            assert isinstance(p, ot.OffloadedTensor)
            assert torch.equal(p.cpu(), frozen[name]), name
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes
    assert s.bytes_h2d > 0


def test_backward_pages_offloaded_weights_again_instead_of_keeping_copies(device):
    model = _model()
    _wrap(model, device)
    x = torch.randn(BATCH, IN).to(device)
    loss = model(x).square().mean()
    after_forward = ot.stats(model)
    loss.backward()
    after_backward = ot.stats(model)
    # every offloaded weight is needed again by backward (grad of the input), and half the cache
    # cannot hold them all from forward: backward copies again
    assert after_backward.bytes_h2d > after_forward.bytes_h2d
    assert after_backward.peak_device_bytes <= after_backward.budget_bytes


@pytest.mark.parametrize("backend", [None, "aot_eager"])
def test_an_offloaded_weight_that_needs_a_gradient_gets_the_unwrapped_one(device, backend):
    weight = torch.randn(8, 6)
    offloaded = nn.Parameter(ot.offload(weight, device), requires_grad=True)
    reference = weight.clone().to(device).requires_grad_()
    x = torch.randn(3, 8).to(device)

    def loss(x, w):
        return (x @ w).square().sum()

    run = torch.compile(loss, backend=backend) if backend else loss
    run(x, offloaded).backward()
    loss(x, reference).backward()
    assert not isinstance(offloaded.grad, ot.OffloadedTensor)  # a plain device tensor, like any gradient
    torch.testing.assert_close(offloaded.grad, reference.grad)


def test_compiled_index_ops_on_an_offloaded_table_that_needs_a_gradient_stay_in_the_graph(device):
    """embedding, index_select and indexing of an offloaded table that needs a gradient broke the
    graph (each ran eagerly), on the belief that their opaque ops lacked an autograd formula; they
    run below autograd, where the table's own formula applies. No break now, and the compiled step
    gives the unwrapped loss and gradient bit for bit, as a plain device tensor."""
    import torch.nn.functional as F

    table = torch.randn(50, 8, generator=torch.Generator().manual_seed(0))
    offloaded = nn.Parameter(ot.offload(table, device), requires_grad=True)
    reference = table.clone().to(device).requires_grad_()
    ids = torch.tensor([3, 7, 3, 49]).to(device)

    def loss(w):
        return F.embedding(ids, w).square().sum() + w.index_select(0, ids).sum() + w[ids].mean()

    assert torch._dynamo.explain(loss)(offloaded).graph_break_count == 0
    torch._dynamo.reset()
    got = torch.compile(loss, backend="aot_eager")(offloaded)
    got.backward()
    expected = loss(reference)
    expected.backward()
    assert torch.equal(got, expected)
    assert type(offloaded.grad) is torch.Tensor and torch.equal(offloaded.grad, reference.grad)


# ---------------------------------------------------------------------------- offloaded MoE experts


def _tiny_moe(layers: int = 1):
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=64, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_grouped_gemm_fallback_backward_pages_only_the_routed_experts(device):
    """transformers' grouped GEMM fallback (what its MoE runs under torch.compile) has a backward op
    of its own; on an offloaded stack it pages each expert with tokens for the input's gradient, as
    the forward does, not the whole stack, and gives the op's own gradients."""
    pytest.importorskip("transformers")
    from transformers.integrations import moe  # noqa: F401  (registers the ops)

    stack = torch.randn(8, 16, 24)
    offloaded = ot.offload(stack, device)
    x, grad = torch.randn(5, 16).to(device), torch.randn(5, 24).to(device)
    offs = torch.tensor([0, 2, 2, 2, 4, 4, 5, 5]).to(device)  # experts 1, 4 and 6 have tokens
    backward = torch.ops.transformers.grouped_mm_fallback_backward
    expected = backward(x, stack.to(device), offs, grad)
    before = offloaded.pager.stats.bytes_h2d
    got = backward(x, offloaded, offs, grad)
    assert all(type(g) is torch.Tensor and torch.equal(g, e) for g, e in zip(got, expected))
    assert offloaded.pager.stats.bytes_h2d - before == 3 * 16 * 24 * 4


@pytest.mark.parametrize("trained", ["all", "adapters"])
def test_compiled_training_of_an_offloaded_moe_equals_the_unwrapped_model(device, trained):
    """Full fine-tuning (every parameter needs a gradient) and LoRA-style training (frozen experts,
    trainable adapters) of a tiny Qwen3-MoE whose expert stacks are offloaded at half the model's
    bytes, compiled: the graph's backward runs transformers' grouped GEMM backward on the routed
    experts only (it paged the whole stack, past the budget), and the loss and every gradient equal
    the unwrapped eager model's."""
    model = _tiny_moe()
    if trained == "adapters":
        for p in model.parameters():
            p.requires_grad_(False)
        attention = model.model.layers[0].self_attn
        attention.q_proj = LoRALinear.around(attention.q_proj)
    reference = copy.deepcopy(model).to(device)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    ot.wrap_model(model, budget_gb=0.5 * total / GiB, device=device)
    assert any(isinstance(p, ot.OffloadedTensor) and p.dim() == 3 for p in model.parameters())
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0)).to(device)
    loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
    loss.backward()
    reference_loss = reference(input_ids=ids, labels=ids).loss
    reference_loss.backward()
    assert torch.equal(loss, reference_loss)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            assert type(p.grad) is torch.Tensor and torch.equal(p.grad, q.grad), name
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes
