"""The meta-op memo of a plan (``offtensor.sim.meta_memo``): an op on meta tensors seen with the
same arguments is answered with fresh meta tensors of the metadata its kernel gave, and only where
that is what the kernel would give; a plan with it records the same timeline as without it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from offtensor.sim import meta_memo
from offtensor.sim.meta_memo import MetaMemo

transformers = pytest.importorskip("transformers")


def _meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (type(a) is type(b) and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype
                and a.device == b.device and a.storage_offset() == b.storage_offset())
    return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


CASES = {
    "mul by a resident weight (a Parameter)": lambda: nn.Parameter(_meta(64)) * _meta(1, 1, 64),
    "mean over a dim": lambda: _meta(2, 8, 64).pow(2).mean(-1, keepdim=True),
    "softmax": lambda: torch.softmax(_meta(4, 16), -1),
    "a transposed result's strides": lambda: _meta(8, 4).t().contiguous() + _meta(4, 8).t().t(),
    "channels-last": lambda: _meta(2, 3, 8, 8).contiguous(memory_format=torch.channels_last) * 2,
    "layer norm (three results)": lambda: torch.ops.aten.native_layer_norm(_meta(2, 8), [8], None, None, 1e-5),
    "topk (a named tuple's values)": lambda: tuple(torch.topk(_meta(4, 16), 2)),
    "foreach (a list)": lambda: torch._foreach_mul([_meta(3), _meta(4, 2)], 2.0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_remembered_op_gives_the_kernels_metadata_on_fresh_tensors(case):
    fn = CASES[case]
    want = fn()
    memo = MetaMemo()
    with memo:
        first, second = fn(), fn()
    assert memo.hits > 0 and _same(first, want) and _same(second, want), case
    flat = lambda r: [r] if isinstance(r, torch.Tensor) else list(r)  # noqa: E731
    assert not {id(t) for t in flat(first)} & {id(t) for t in flat(second)}  # fresh tensors each time


def test_the_key_tells_python_numbers_apart_by_type():
    """``1``, ``1.0`` and ``True`` are equal as dictionary keys, but an int tensor times each is an
    int, a float and an int tensor: the key holds each argument's type too."""
    x = _meta(4, dtype=torch.int64)
    with MetaMemo() as memo:
        dtypes = [torch.mul(x, 1).dtype, torch.mul(x, 1.0).dtype, torch.mul(x, True).dtype]
    assert dtypes == [torch.int64, torch.float32, torch.int64]
    assert memo.misses == 3


def test_views_in_place_ops_and_host_tensors_always_run_their_kernels():
    """A view shares its argument's storage and an in-place op returns its argument: remade tensors
    would be neither. A host tensor's values may decide the result's shape (an index mask)."""
    x = _meta(4, 8)
    with MetaMemo() as memo:
        for _ in range(2):
            v = x.view(8, 4)
            assert v._base is x
            assert x.add_(1) is x
            assert x[torch.tensor([True, False, True, False])].shape == (2, 8)
    assert memo.hits == 0


def test_an_op_that_fails_is_not_remembered():
    a, b = _meta(2, 3), _meta(4, 5)
    with MetaMemo() as memo:
        for _ in range(2):
            with pytest.raises(RuntimeError):
                torch.mm(a, b)
    assert memo.hits == 0 and memo.misses == 0


def _records(tl) -> list:
    names = {}

    def key(k):  # a copy names its pager and master by id: numbered in order of first use
        if k is None:
            return None
        return (names.setdefault(("p", k[0]), len(names)), names.setdefault(("m", k[1]), len(names))) + k[2:]

    return [dataclasses.replace(r, policy_ms=0.0, key=key(r.key)) for r in tl.records]


def _plans(model, budget, routing, policy):
    from offtensor.sim.plan import plan

    x = torch.zeros(1, 1, dtype=torch.long, device="meta")
    out = []
    for on in (False, True):
        meta_memo.ENABLED = on
        try:
            out.append(plan(model, budget_gb=budget, example_inputs=(x,), steps=2, warmup=3, policy=policy,
                            routing=routing))
        finally:
            meta_memo.ENABLED = True
    return out


@pytest.mark.parametrize("policy", [None, "paged"], ids=["default-placement", "every-stack-paged"])
def test_a_plan_with_the_memo_records_the_same_timeline_as_without_it(policy):
    """The placement decision's two plans of the test Qwen3-MoE: every record (ops, copies, waits,
    pages, bytes, flops) the same, so the same replay and the same decision."""
    import test_moe_placement as placement_tests
    from offtensor.placement import EXPERTS_PAGED

    model = placement_tests._meta_model("cpu")
    budget = placement_tests._budget_gb(model)
    without, with_memo = _plans(model, budget, placement_tests._skewed(), EXPERTS_PAGED if policy else None)
    assert len(without.records) > 500
    assert _records(with_memo) == _records(without)
    assert with_memo.replay("h200").step_ms == without.replay("h200").step_ms


def test_a_dense_model_plans_the_same_with_the_memo():
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    without, with_memo = _plans(model, 0.5 * total / 2**30, None, None)
    assert _records(with_memo) == _records(without) and len(without.records) > 100
