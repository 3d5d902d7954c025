"""The grouped GEMM's path for routed experts that are all cached: no wrapper per expert, one
record for the op, the layer's second stack announcing nothing anew; results and the expert
cache's bookkeeping exactly those of the per-expert path."""

from __future__ import annotations

import copy

import pytest
import torch

import offtensor as ot
from offtensor.model.copies import state_of
from offtensor.moe.prefetch import ExpertIssuer

transformers = pytest.importorskip("transformers")
GiB = 1 << 30


def _qwen3_moe(device):
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64, num_hidden_layers=3,
        num_key_value_heads=2, head_dim=16, intermediate_size=256, moe_intermediate_size=64, num_experts=16,
        num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(device)


def _wrapped_with_every_expert_cached(plain, device):
    model = copy.deepcopy(plain)
    weights = sum(p.numel() * p.element_size() for p in plain.parameters())
    ot.wrap_model(model, budget_gb=2 * weights / GiB, device=device, prefetch=False, policy=["*.experts.*"])
    n, k = plain.config.num_experts, plain.config.num_experts_per_tok
    index = torch.stack([(torch.arange(n) + j) % n for j in range(k)], dim=1).to(device)
    with torch.no_grad():  # a token routed to every expert: each one's copy is cached from here on
        for module in (m for m in model.modules() if type(m).__name__.endswith("Experts")):
            module(torch.randn(n, plain.config.hidden_size, device=device), index, torch.full((n, k), 1.0 / k, device=device))
    return model


def _decode(model, ids, steps):
    logits, cache, token = [], None, ids
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=token, past_key_values=cache, use_cache=True)
            cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            logits.append(out.logits)
    return logits


def test_cached_experts_are_paged_without_a_wrapper_per_expert_and_decode_as_the_plain_model(device, monkeypatch):
    plain = _qwen3_moe(device)
    model = _wrapped_with_every_expert_cached(plain, device)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    _decode(model, ids, 2)  # warm: every routed expert's layout memoized
    built = []
    new = ot.OffloadedTensor.__new__

    def counting_new(cls, host, *args, **kwargs):
        built.append(tuple(host.shape))
        return new(cls, host, *args, **kwargs)

    monkeypatch.setattr(ot.OffloadedTensor, "__new__", counting_new)
    h2d = ot.stats(model).bytes_h2d
    wrapped = _decode(model, ids, 3)
    monkeypatch.undo()
    expected = _decode(plain, ids, 3)
    assert ot.stats(model).bytes_h2d == h2d  # copy-free: every expert a hit
    per_expert = [shape for shape in built if len(shape) == 3 and shape[0] == 1]
    assert per_expert == []  # only the stacks' own transposed views, never one per expert
    for a, b in zip(wrapped, expected):
        assert torch.equal(a, b)


def test_the_layers_second_stack_skips_its_announce_with_the_same_cache_state(device, monkeypatch):
    plain = _qwen3_moe(device)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    fast = _wrapped_with_every_expert_cached(plain, device)
    skipped = []
    repeats = ExpertIssuer.repeats

    def counting_repeats(self, *args):
        answer = repeats(self, *args)
        skipped.append(answer)
        return answer

    monkeypatch.setattr(ExpertIssuer, "repeats", counting_repeats)
    fast_logits = _decode(fast, ids, 4)
    monkeypatch.setattr(ExpertIssuer, "repeats", lambda self, *args: False)  # always the full announce
    slow = _wrapped_with_every_expert_cached(plain, device)
    slow_logits = _decode(slow, ids, 4)
    monkeypatch.undo()
    assert sum(skipped) == plain.config.num_hidden_layers * 4  # each layer's down (after gate_up), each step
    for a, b in zip(fast_logits, slow_logits):
        assert torch.equal(a, b)
    fast_experts, slow_experts = state_of(fast).pager.experts, state_of(slow).pager.experts
    assert ot.stats(fast).bytes_h2d == ot.stats(slow).bytes_h2d
    by_name = lambda experts: {s.name: s.report() for s in experts.by_master.values()}  # noqa: E731
    assert by_name(fast_experts) == by_name(slow_experts)
    frequencies = lambda experts: sorted(  # noqa: E731
        (experts.by_master[k[0]].name, experts.by_master[k[0]].expert_of(k), round(v, 12))
        for k, v in experts.eviction.frequency.items() if k[0] in experts.by_master
    )
    assert frequencies(fast_experts) == frequencies(slow_experts)


def test_a_wrapped_moe_decodes_under_inference_mode_with_one_routing_read_a_layer(device, monkeypatch):
    # transformers makes a layer's grouped-GEMM offsets once and both of its grouped GEMMs (gate_up,
    # down) read them; under torch.inference_mode they are inference tensors, which keep no version
    # counter, so the second call reuses the first's read by the layer (it used to raise there).
    from offtensor.ops import grouped

    plain = _qwen3_moe(device)
    model = copy.deepcopy(plain)
    experts = sum(p.numel() * p.element_size() for n, p in plain.named_parameters() if ".experts." in n)
    weights = sum(p.numel() * p.element_size() for p in plain.parameters())
    ot.wrap_model(model, budget_gb=(weights - experts // 2) / GiB, device=device, policy=["*.experts.*"])
    reads = []
    real = grouped.read_to_host
    monkeypatch.setattr(grouped, "read_to_host", lambda t, pager: reads.append(1) or real(t, pager))
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    got, want = [], []
    with torch.inference_mode():
        for m, out in ((model, got), (plain, want)):
            cache, token = None, ids
            for _ in range(4):
                r = m(input_ids=token, past_key_values=cache, use_cache=True)
                cache, token = r.past_key_values, r.logits[:, -1:].argmax(-1)
                out.append(r.logits)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert len(reads) == 4 * 3  # one routing read per MoE layer per forward


def test_a_recorded_decode_keeps_one_record_per_grouped_gemm_on_cached_experts(device):
    # Under ot.timeline the grouped GEMM takes the same one-record path as without it: each routed
    # expert's kernel is recorded with its own page, and the op gives its record back once, so the
    # replay charges one release per grouped GEMM (the profile's "expert" figure for the rest).
    plain = _qwen3_moe(device)
    model = _wrapped_with_every_expert_cached(plain, device)
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1)).to(device)
    _decode(model, ids, 1)
    token = ids[:, -1:]
    with ot.timeline(model) as tl:
        with torch.no_grad():
            got = model(input_ids=token).logits
    with torch.no_grad():
        want = plain(input_ids=token).logits
    assert torch.equal(got, want)
    ops = [r for r in tl.records if r.kind == "op"]
    grouped = [r for r in ops if r.name == "_grouped_mm"]
    kernels = [r for r in grouped if r.pages == 1]
    k, layers = plain.config.num_experts_per_tok, plain.config.num_hidden_layers
    assert len(kernels) == 2 * layers * k  # gate_up and down: one kernel per routed expert, each its page
    assert sum(r.releases for r in grouped) == 2 * layers  # one record given back per grouped GEMM
    assert not any(r.kind == "copy" for r in tl.records)
