"""Inside a torch.compile graph, an op whose offloaded argument can never be paged whole (larger
than the budget less the resident weights) is cut in slices as eager cuts it: the trace meets the
BudgetError eager meets, and the op's handler records one page per slice. Before, the graph paged
the whole weight at run time and raised at a budget wrap had accepted (``w * 2``, a softmax, a sum
or a sort of such a weight). What decides that cut, the room a page may take, is part of the
weights' tracing metadata, so a graph compiled at a larger budget (in this process or an earlier
one, through Inductor's caches on disk) is never reused at a smaller one. Two processes sharing
Inductor's caches show it with ``OFFTENSOR_SLOW_COMPILE=1`` (about 25 s; off in CI, where a fresh
Inductor C++ build once failed to load a kernel under the other worker's load)."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import offtensor as ot

GiB = 1 << 30
SMALL = 12 * 1024  # room for about a third of the 32 KiB weight


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class _Reads(nn.Module):
    def __init__(self, weight, op):
        super().__init__()
        self.w = nn.Parameter(weight)
        self.op = op

    def forward(self, x):
        return x @ self.op(self.w)


def _weight(transposed=False):
    torch.manual_seed(0)
    return torch.randn(128, 64).t() if transposed else torch.randn(64, 128)  # (64, 128) either way


OPS = {
    "w * 2": (lambda w: w * 2, False, True),
    "softmax(-1)": (lambda w: w.softmax(-1), False, True),
    "sort(0) of a transposed weight": (lambda w: w.sort(0).values, True, True),
    "amax(0) broadcast": (lambda w: w.amax(0, keepdim=True).expand_as(w), False, True),
    # A sum of the weight runs on its host master, which a graph cannot: a graph break, eagerly there.
    "w * w.sum(0) (on the host)": (lambda w: w * w.sum(0, keepdim=True), False, True),
}


def _pair(name, budget, device):
    op, transposed, _ = OPS[name]
    weight = _weight(transposed)
    reference = _Reads(weight.clone() if not transposed else weight.t().clone().t(), op).to(device)
    model = _Reads(weight, op)
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})
    return model, reference


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", sorted(OPS))
def test_an_op_on_a_weight_larger_than_the_room_runs_in_slices_inside_a_compiled_graph(name, backend, device):
    if backend == "inductor" and name not in ("w * 2", "softmax(-1)"):
        pytest.skip("(Inductor compiles slowly on a CPU: two ops show it; aot_eager runs the rest)")
    model, reference = _pair(name, SMALL, device)
    x = torch.randn(3, 64, device=device)
    compiled, expected_fn = torch.compile(model, backend=backend), torch.compile(reference, backend=backend)
    with torch.no_grad():
        expected = expected_fn(x)
        for _ in range(2):  # the second call replays the graph with copies cached
            got = compiled(x)
            if OPS[name][2]:
                assert torch.equal(got, expected)
            else:
                torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    stats = ot.stats(model)
    assert stats.peak_device_bytes <= stats.budget_bytes


_CHILD = """
import sys
import torch
sys.path.insert(0, {tests!r})
import test_compile_slices as t
import offtensor as ot
torch._inductor.config.fx_graph_cache = True
torch._functorch.config.enable_autograd_cache = True
model, reference = t._pair("w * 2", int(sys.argv[1]), {device!r})
x = torch.randn(3, 64, device={device!r})
with torch.no_grad():
    assert torch.equal(torch.compile(model, backend="inductor")(x), reference(x))
stats = ot.stats(model)
assert stats.peak_device_bytes <= stats.budget_bytes
"""


def test_the_room_a_page_may_take_is_part_of_every_offloaded_weights_tracing_metadata(device):
    """What Dynamo guards on and Inductor's caches key by: weights of the same model wrapped at two
    budgets (numbered alike, as a later process numbers them) differ in it, and it follows the
    budget less the resident weights."""
    metadata = {}
    for budget in (96 * 1024, SMALL):
        model, _ = _pair("w * 2", budget, device)
        stats = ot.stats(model)
        _, meta = model.w.__tensor_flatten__()
        assert meta[-1] == stats.budget_bytes - stats.resident_bytes
        metadata[budget] = meta[1:]
    assert metadata[96 * 1024] != metadata[SMALL]


@pytest.mark.skipif(os.environ.get("OFFTENSOR_SLOW_COMPILE") != "1",
                    reason="OFFTENSOR_SLOW_COMPILE=1 runs it (two processes, each compiling with Inductor)")
def test_a_graph_compiled_at_a_larger_budget_is_not_reused_at_a_smaller_one_by_a_later_process(device, tmp_path):
    """Inductor's caches on disk key a graph by what Dynamo traced and the weights' metadata, and a
    later process numbers its weights as the first did: a weight paged whole at a budget that holds
    it must be cut again where the budget does not. (Before, the second process got the first's
    graph and raised BudgetError.)"""
    code = _CHILD.format(tests=str(pathlib.Path(__file__).parent), device=device)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}  # caches of this test alone
    for budget in (96 * 1024, SMALL):
        child = subprocess.run([sys.executable, "-c", code, str(budget)], env=env, capture_output=True, text=True,
                               timeout=300)
        assert child.returncode == 0, child.stderr[-3000:]
