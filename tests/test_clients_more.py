"""More clients over a wrapped model, each against the same model unwrapped, bit for bit
(``torch.equal``): peft adapters on stacked MoE experts, DoRA, several adapters mixed and an adapter
loaded from disk; transformers pipelines, ``generate`` returning attentions and hidden states,
``save_pretrained`` read back by plain transformers, ``resize_token_embeddings``; torch's
parametrizations registered after wrapping, ``torch.func`` and forward-mode AD; ``torch.export``'s
``run_decompositions``. Tiny models built offline, as in tests/test_clients.py."""

from __future__ import annotations

import copy

import pytest
import torch

import offtensor as ot

GiB = 1 << 30


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}.values())


def _wrap(model: torch.nn.Module, device, fraction=0.3) -> None:
    ot.wrap_model(model, budget_gb=fraction * _weight_bytes(model) / GiB, device=device)
    assert ot.stats(model).offloaded_bytes > 0


def _paged_within_budget(model: torch.nn.Module) -> None:
    s = ot.stats(model)
    assert s.bytes_h2d > 0, "nothing was paged"
    assert s.peak_device_bytes <= s.budget_bytes, s


def _ids(device, batch=2):
    ids = torch.randint(0, 128, (batch, 6), generator=torch.Generator().manual_seed(1)).to(device)
    return ids, torch.ones_like(ids)


def _same_logits(model, reference, device) -> None:
    ids, mask = _ids(device)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)


def _same_training(model, reference, device, steps=2) -> None:
    """``steps`` AdamW steps of each model's trainable weights: equal losses at every step."""
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, reference)]
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        ids = torch.randint(0, 128, (2, 8), generator=g).to(device)
        losses = []
        for m, optimizer in zip((model, reference), optimizers):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses), (step, losses)


def _tiny(name, device):
    pytest.importorskip("transformers")
    from offtensor.models.tiny import tiny_transformers

    model = tiny_transformers(name)
    return model, copy.deepcopy(model).to(device)


# ---------------------------------------------------------------------------- peft


def test_peft_lora_on_stacked_moe_experts_trains_like_the_unwrapped_run(device):
    """peft's ``target_parameters`` LoRA on a stacked expert weight computes ``baddbmm(W, A, B)``
    over the whole stack at every forward, where the rest of the model reads it one routed expert
    at a time, so wrap left no room for the stack. It paged the stack whole and raised BudgetError
    at the first forward of a budget wrap accepted; now baddbmm runs in tiles of the batches."""
    peft = pytest.importorskip("peft")
    model, reference = _tiny("qwen3_moe", device)

    def config():
        return peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False,
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

    torch.manual_seed(1)
    model = peft.get_peft_model(model, config())
    torch.manual_seed(1)
    reference = peft.get_peft_model(reference, config())
    _wrap(model, device)
    stacks = [p for n, p in model.named_parameters() if n.endswith("experts.base_layer.base_layer.gate_up_proj")]
    assert stacks and all(isinstance(p, ot.OffloadedTensor) for p in stacks)
    s = ot.stats(model)
    assert stacks[0].numel() * stacks[0].element_size() > s.budget_bytes - s.resident_bytes  # never fits whole
    _same_logits(model, reference, device)
    model.train()
    reference.train()
    _same_training(model, reference, device)
    model.eval()
    reference.eval()
    _same_logits(model, reference, device)
    _paged_within_budget(model)


# ---------------------------------------------------------------------------- torch.export


def test_export_run_decompositions_of_a_model_with_a_weight_past_the_room_runs_in_tiles(device):
    """``run_decompositions`` registers Python kernels on the CPU and CUDA keys of the composites it
    keeps (``linear``) while it runs. An op first met then was classified as having a kernel of its
    own and kept a handler that pages it whole: the decomposed program, and every later eager
    forward in inference mode, raised BudgetError on a weight that tiles."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 64)).eval()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    s = ot.stats(model)
    assert model[2].weight.numel() * 4 > s.budget_bytes - s.resident_bytes  # only its tiles fit
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = reference(x)
    program = torch.export.export(model, (x,)).run_decompositions()
    with torch.no_grad():
        assert torch.equal(program.module()(x), expected)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    _paged_within_budget(model)
