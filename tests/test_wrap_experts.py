"""Stacked experts and prefetch through ``wrap_model``: grouped mm pages only the experts that have
tokens, more experts than the budget holds are paged in chunks, prefetch hits dense weights the
cache cannot keep and does not chase routed experts. The tiny model and its helpers are
test_wrap.py's."""

from __future__ import annotations

import torch
from torch import nn

import offtensor as ot
from offtensor.model.state import wrapped_state

from test_wrap import HIDDEN, INTER, VOCAB, _budget_gb, _model, _run, _weight_bytes

GiB = 1 << 30


# ---------------------------------------------------------------------------- stacked experts


class _Stack(nn.Module):
    """16 stacked experts of 16 KiB each (fp32), more than one op's working set (8 experts) holds."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        self.experts = nn.Module()
        self.experts.down_proj = nn.Parameter(torch.randn(16, 64, 64).to(dtype))


def test_grouped_mm_pages_only_the_experts_that_have_tokens(device):
    # grouped_mm takes only bfloat16 on CUDA
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    stack = _Stack(dtype)
    weight = stack.experts.down_proj.detach().clone().to(device)
    # Room for 10 of the 16 experts: more than one op's working set (8), less than the stack.
    ot.wrap_model(stack, budget_gb=weight.numel() * weight.element_size() * 10 / 16 / GiB, device=device)
    offloaded = stack.experts.down_proj
    assert isinstance(offloaded, ot.OffloadedTensor)
    x = torch.randn(7, 64, device=device, dtype=dtype)
    # Tokens 0-1 go to expert 1, 2-5 to expert 5, 6 to expert 15; every other expert has none.
    ends = [0, 2, 2, 2, 2, 6] + [6] * 9 + [7]
    offs = torch.tensor(ends, dtype=torch.int32, device=device)
    for w, expected_w in ((offloaded, weight), (offloaded.transpose(-2, -1), weight.transpose(-2, -1))):
        ot.reset_stats(stack)
        wrapped_state(stack).pager.clear()
        out = torch._grouped_mm(x, w, offs=offs)
        assert torch.equal(out, torch._grouped_mm(x, expected_w, offs=offs))
        assert ot.stats(stack).bytes_h2d == 3 * 64 * 64 * weight.element_size()
        assert ot.stats(stack).peak_device_bytes <= ot.stats(stack).budget_bytes


def test_selecting_more_experts_than_the_budget_holds_pages_them_in_chunks(device):
    stack = _Stack()
    weight = stack.experts.down_proj.detach().clone().to(device)
    ot.wrap_model(stack, budget_gb=160 * 1024 / GiB, device=device)
    offloaded = stack.experts.down_proj
    every = torch.arange(16, device=device).flip(0)
    assert torch.equal(offloaded[every], weight[every])
    assert torch.equal(offloaded.index_select(0, every), weight.index_select(0, every))
    s = ot.stats(stack)
    # Each expert is paged at least once; the second selection may hit the experts the budget
    # kept (registered expert stacks go through the expert cache, offtensor/moe).
    assert 16 * 64 * 64 * 4 <= s.bytes_h2d <= 2 * 16 * 64 * 64 * 4
    assert s.peak_device_bytes <= s.budget_bytes


# ---------------------------------------------------------------------------- prefetch


def _decode_like(model, steps: int):
    """Single-token forwards with fresh random tokens, so routing changes from step to step."""
    generator = torch.Generator().manual_seed(0)
    device = next(model.parameters()).device
    for _ in range(steps):
        _run(model, torch.randint(0, VOCAB, (1, 1), generator=generator).to(device))


def test_prefetch_hits_dense_weights_that_the_cache_cannot_keep(device):
    model = _model()
    mlp_bytes = 6 * INTER * HIDDEN * 4
    # Room for half of the offloaded MLP weights: every step pages them again.
    budget = _weight_bytes(model) - mlp_bytes // 2
    ot.wrap_model(model, budget_gb=budget / GiB, device=device,
                  policy=lambda name: "offload" if ".mlp." in name else "keep")
    _decode_like(model, 12)
    s = ot.stats(model)
    assert s.bytes_h2d > 2 * mlp_bytes
    assert s.prefetch_hits > 0
    assert s.prefetch_hits >= 0.9 * s.prefetches
    assert s.peak_device_bytes <= s.budget_bytes


def test_prefetch_does_not_chase_routed_experts(device):
    # Only experts are offloaded, so the first weight paged in a step is a routed expert slice:
    # passes must still be whole forwards, and experts that the router changes its mind about
    # must not be copied ahead of time.
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.6), device=device, policy={"offload": ["*.experts.*"]})
    _decode_like(model, 24)
    s = ot.stats(model)
    assert s.prefetches - s.prefetch_hits <= max(2, s.prefetches // 4)
    assert s.peak_device_bytes <= s.budget_bytes
