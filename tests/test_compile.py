"""torch.compile and CUDA graphs on wrapped models (ops/compile.py): no crash, the unwrapped outputs,
no graph break caused by offloading, and paging that still happens at run time (cache, prefetch,
budget and statistics as in eager mode, no recompilation from step to step).

Compiles are slow on a small CPU machine: most tests use the ``aot_eager`` backend (Dynamo plus
AOTAutograd's subclass desugaring, the part that must trace OffloadedTensor) and small models; one
test runs Inductor.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.ops import compile as ot_compile

GiB = 1 << 30


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class GraphCounter:
    """A backend that counts the graphs it is given (compiles and recompiles) and runs them with
    aot_eager."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.debugging import aot_eager

        self.graphs += 1
        return aot_eager(gm, example_inputs)


def _stack(layers: int = 6, width: int = 32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*mods).eval()


def _weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _wrap_weights_offloaded(model, device, cache_fraction: float = 0.5):
    """Every Linear weight offloaded; the cache holds ``cache_fraction`` of them, so each step pages
    again and the prefetcher has room to copy ahead."""
    offloaded = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.endswith("weight"))
    budget = _weight_bytes(model) - offloaded + cache_fraction * offloaded
    return ot.wrap_model(model, budget_gb=budget / GiB, device=device,
                         policy=lambda name: "offload" if name.endswith("weight") else "keep")


def _explain(fn, *args):
    # Through a lambda, as torch.compile(model) traces a module call: explain(module) alone traces
    # forward() and compiles the forward pre-hooks (wrap_model's prefetch step mark) as a graph of
    # their own, which it counts as a break.
    with torch.no_grad():
        return torch._dynamo.explain(lambda *a: fn(*a))(*args)


# ---------------------------------------------------------------------------- no crash, same outputs


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_wrapped_model_gives_the_unwrapped_outputs_without_graph_breaks(device, backend):
    model = _stack()
    reference = copy.deepcopy(model).to(device)
    x = torch.randn(4, 32).to(device)
    ot.wrap_model(model, budget_gb=0.4 * _weight_bytes(model) / GiB, device=device)
    assert any(isinstance(p, ot.OffloadedTensor) for p in model.parameters())
    assert _explain(model, x).graph_break_count == 0
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


@pytest.mark.parametrize("strict", [False, True])
def test_exported_wrapped_model_gives_the_unwrapped_outputs_and_pages_at_run_time(device, strict):
    """torch.export, non-strict (the default: parameters faked by FakeTensorMode.from_tensor outside
    any tracing context) and strict (Dynamo): the program's module pages its weights when it runs."""
    model = _stack(layers=2)
    reference = copy.deepcopy(model).to(device)
    x = torch.randn(4, 32).to(device)
    _wrap_weights_offloaded(model, device)
    program = torch.export.export(model, (x,), strict=strict)
    ot.reset_stats(model)
    with torch.no_grad():
        assert torch.equal(program.module()(x), reference(x))
    s = ot.stats(model)
    assert s.bytes_h2d > 0 and s.peak_device_bytes <= s.budget_bytes


@pytest.mark.parametrize("how", ["trace", "script"])
def test_torchscript_of_a_wrapped_model_is_refused_naming_an_offloaded_weight(device, how):
    """TorchScript records ops on plain tensors: it would record the pager's own copies (or fail on
    them) instead of paging. Refused before it traces, naming a weight; unwrapped, it scripts."""
    model = _stack(layers=2)
    x = torch.randn(4, 32).to(device)
    _wrap_weights_offloaded(model, device)
    script = getattr(torch.jit, how)  # (looked up now: imports during other tests may rebind it)
    args = (model, x) if how == "trace" else (model,)
    with pytest.raises(RuntimeError, match=r"torch.jit.trace / torch.jit.script of a wrapped model .* '0.weight', 4096 bytes"):
        script(*args)
    ot.unwrap_model(model)
    script(*args)


def test_compiling_a_module_inside_a_wrapped_model(device):
    model = _stack()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=0.4 * _weight_bytes(model) / GiB, device=device)
    # placement decides which layers are offloaded: compile one that is
    index = next(i for i, m in enumerate(model) if isinstance(getattr(m, "weight", None), ot.OffloadedTensor))
    model[index] = torch.compile(model[index], backend="aot_eager")
    x = torch.randn(3, 32).to(device)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)


def test_compiled_function_of_offloaded_tensors_and_their_views(device):
    w = torch.randn(16, 8)
    b = torch.randn(16)
    ow, ob = ot.offload(w, device), ot.offload(b, device)

    def f(x, w, b):
        # a transposed view, a row view, a column slice and a reduction, all over offloaded tensors
        return (x @ w.t() + b).relu() + w[3].sum() + w[:, :4].mean()

    x = torch.randn(5, 8).to(device)
    expected = f(x, w.to(device), b.to(device))
    assert _explain(f, x, ow, ob).graph_break_count == 0
    torch.testing.assert_close(torch.compile(f, backend="aot_eager")(x, ow, ob), expected)


def test_eager_ops_after_a_compile_do_not_look_for_traced_arguments(device, monkeypatch):
    from offtensor import ops as ot_ops

    w = ot.offload(torch.randn(16, 8), device)
    x = torch.randn(5, 8).to(device)
    compiled = torch.compile(lambda x, w: (x @ w.t()).relu(), backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), (x @ w.t()).relu())  # the compiled graph is still alive
    looked = []
    real = ot_ops._traced
    monkeypatch.setattr(ot_ops, "_traced", lambda args, kwargs: looked.append(1) or real(args, kwargs))
    torch.testing.assert_close(w * 2, w.cpu().to(device) * 2)
    assert looked == []


def test_values_written_to_a_master_after_compiling_are_read_by_the_graph_without_recompiling(device):
    w = ot.offload(torch.randn(8, 8), device)
    counter = GraphCounter()
    f = torch.compile(lambda x, w: x @ w, backend=counter)
    x = torch.randn(2, 8).to(device)
    f(x, w)
    new = torch.randn(8, 8)
    w.copy_(new)  # eager write to the host master
    torch.testing.assert_close(f(x, w), x @ new.to(device))
    assert counter.graphs == 1


# ---------------------------------------------------------------------------- paging at run time


def test_compiled_graph_pages_at_run_time_with_the_same_cache_and_prefetch_as_eager(device):
    """The compiled model moves exactly the bytes, hits and prefetches of the eager one: the
    pager, not the graph, decides what is copied, every step."""
    x = torch.randn(4, 32).to(device)
    results = {}
    for mode in ("eager", "compiled"):
        model = _wrap_weights_offloaded(_stack(8), device)
        run = torch.compile(model, backend="aot_eager") if mode == "compiled" else model
        with torch.no_grad():
            for _ in range(6):
                out = run(x)
        results[mode] = (out, ot.stats(model))
    (eager_out, eager), (compiled_out, compiled) = results["eager"], results["compiled"]
    torch.testing.assert_close(compiled_out, eager_out, rtol=0, atol=0)
    assert eager.prefetch_hits > 0  # the setting exercises the prefetcher
    for field in ("bytes_h2d", "page_ins", "hits", "prefetches", "prefetch_hits"):
        assert getattr(compiled, field) == getattr(eager, field), field
    assert compiled.peak_device_bytes <= compiled.budget_bytes


def test_no_recompilation_from_step_to_step(device):
    model = _wrap_weights_offloaded(_stack(4), device)
    counter = GraphCounter()
    compiled = torch.compile(model, backend=counter)
    with torch.no_grad():
        for step in range(4):
            compiled(torch.randn(4, 32).to(device))
    assert counter.graphs == 1


class _SlicedLayers(nn.Module):
    """A forward that slices its ModuleList, as transformers' decoders do (``self.layers[:n]``): the
    slice is a new module of the wrapped module's class, built inside the traced forward."""

    def __init__(self, layers: int = 3, width: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers[: len(self.layers)]:
            x = layer(x)
        return x


def test_another_wrapped_model_collected_between_calls_does_not_recompile(device):
    model = _wrap_weights_offloaded(_SlicedLayers().eval(), device)
    counter = GraphCounter()
    compiled = torch.compile(model, backend=counter)
    x = torch.randn(4, 32).to(device)
    with torch.no_grad():
        expected = compiled(x)
        graphs = counter.graphs
        other = _wrap_weights_offloaded(_SlicedLayers().eval(), device)
        torch.testing.assert_close(compiled(x), expected)
        del other
        gc.collect()
        torch.testing.assert_close(compiled(x), expected)
    assert counter.graphs == graphs


class _Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.Embedding(64, 16)
        self.proj = nn.Linear(16, 16)

    def forward(self, ids):
        return self.proj(self.table(ids))


def test_embedding_stays_in_the_graph_and_pages_only_the_rows_it_looks_up(device):
    model = _Embedder().eval()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_weight_bytes(model) / GiB, device=device,
                  policy=lambda name: "offload" if name.startswith("table") else "keep")
    assert isinstance(model.table.weight, ot.OffloadedTensor)
    ids = torch.tensor([[3, 7, 7, 40]]).to(device)
    assert _explain(model, ids).graph_break_count == 0
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        compiled(ids)
        ot.reset_stats(model)
        torch.testing.assert_close(compiled(ids), reference(ids), rtol=0, atol=0)
    # 3 distinct rows of 16 float32 each, not the 64-row table
    assert ot.stats(model).bytes_h2d == 3 * 16 * 4


def test_expert_index_ops_stay_in_the_graph(device):
    experts = torch.randn(8, 16, 16)
    stack = ot.offload(experts, device)

    def f(x, stack, ids):
        chosen = stack[ids]  # aten.index.Tensor on the stack
        picked = stack.index_select(0, ids)
        return torch.einsum("nh,nih->ni", x, chosen) + picked.sum(-1)

    ids = torch.tensor([5, 1, 5]).to(device)
    x = torch.randn(3, 16).to(device)
    assert _explain(f, x, stack, ids).graph_break_count == 0
    torch.testing.assert_close(torch.compile(f, backend="aot_eager")(x, stack, ids), f(x, experts.to(device), ids))


def test_writing_an_offloaded_tensor_inside_a_compiled_function_graph_breaks_and_writes_the_master(device):
    original = torch.randn(8, 8)
    w = ot.offload(original, device)

    def f(x, w):
        w.mul_(2)
        return x @ w

    x = torch.randn(2, 8).to(device)
    counters = torch._dynamo.utils.counters
    counters.clear()
    out = torch.compile(f, backend="aot_eager")(x, w)
    torch.testing.assert_close(out, x @ (2 * original).to(device))
    breaks = list(counters["graph_break"])
    assert len(breaks) == 1 and "offtensor: aten.mul_.Tensor" in breaks[0]
    torch.testing.assert_close(w.cpu(), 2 * original)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_copy_into_an_offloaded_weight_is_traced_and_its_cached_copy_is_not_read_stale(device, backend):
    """``copy_`` into an offloaded weight broke the graph (an error under ``fullgraph=True``); it is
    traced now (``offtensor::write``, ops/compiled_writes.py). An op before the write reads the old
    values, ops after it the new ones, the host master holds them after the call, and the copy the
    pager had cached of the weight is dropped: the next eager read pages the new values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16, bias=False), nn.Linear(16, 16, bias=False))
    ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / GiB, device=device, policy={"offload": ["*"]})
    w, old, new = model[0].weight, model[0].weight.detach().cpu(), torch.randn(16, 16)

    def f(p, v):
        before = p * 3
        p.copy_(v * 0.5)
        return before, p * 2

    counters = torch._dynamo.utils.counters
    counters.clear()
    with torch.no_grad():
        assert torch.equal(w * 1, old) and ot.stats(model).cached_bytes > 0  # a cached copy of the weight
        before, after = torch.compile(f, backend=backend, fullgraph=True)(w, new.to(device))
        assert not counters["graph_break"]
        assert torch.equal(before, old * 3) and torch.equal(after, new)
        assert torch.equal(w._host, new * 0.5) and torch.equal(w * 1, new * 0.5)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes, s


def test_page_op_schema_and_fake_kernel(device):
    w = ot.offload(torch.randn(6, 4), device)
    view = w.t()
    for t in (w, view, w[1:3]):
        torch.library.opcheck(
            torch.ops.offtensor.page.default, (t._host, t._master.id, t.device),
            test_utils=("test_schema", "test_faketensor"),
        )
        out = torch.ops.offtensor.page(t._host, t._master.id, t.device)
        assert type(out) is torch.Tensor and out.device == t.device
        torch.testing.assert_close(out, t.materialize())


def test_write_op_schema_and_fake_kernel(device):
    """``offtensor::write`` declares the host view it writes (opcheck runs it and checks that only
    declared arguments change); run on the view it writes the master through the pager."""
    w = ot.offload(torch.randn(6, 4), device)
    for t, value in ((w, torch.randn(6, 4)), (w.t()[1:3], torch.randn(2, 6))):
        torch.library.opcheck(torch.ops.offtensor.write.default, (t._host, t._master.id, value.to(device), False),
                              test_utils=("test_schema", "test_faketensor"))
        torch.ops.offtensor.write(t._host, t._master.id, value.to(device), False)
        assert torch.equal(t.cpu(), value) and torch.equal(t * 1, value.to(device))


def test_linear_runs_as_one_opaque_op_on_the_host_view_without_an_extra_copy(device):
    """F.linear of an offloaded weight reaches dispatch as t + addmm: the addmm becomes one
    offtensor::compute op (page, compute, release at run time), not a page into a graph-owned copy
    followed by the addmm."""
    from torch._dynamo.backends.common import aot_autograd

    seen = []

    def forward_compiler(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm

    w, b = torch.randn(8, 6), torch.randn(8)
    ow, ob = ot.offload(w, device), ot.offload(b, device)
    x = torch.randn(3, 6).to(device)
    f = torch.compile(lambda x, w, b: F.linear(x, w, b).relu(), backend=aot_autograd(fw_compiler=forward_compiler))
    torch.testing.assert_close(f(x, ow, ob), F.linear(x, w.to(device), b.to(device)).relu())
    assert "offtensor.compute.default" in seen
    assert "offtensor.page.default" not in seen


def test_inductor_never_reuses_a_cached_copy_for_its_own_buffers(device):
    """Inductor recycles dead buffers for later results; the page op hands the graph its own copy,
    so outputs stay right on steps that hit the cache."""
    model = _stack(3, width=16)
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_weight_bytes(model) / GiB, device=device,
                  policy=lambda name: "offload" if name.endswith("weight") else "keep")
    compiled = torch.compile(model, backend="inductor")
    x = torch.randn(16, 16).to(device)  # activations of a weight's shape, candidates for reuse
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(compiled(x), reference(x))
    assert ot.stats(model).hits > 0


def test_inductor_training_step_of_a_wrapped_conv_net_gives_the_unwrapped_gradients(device):
    """The graph's step op took no tensor, so Inductor gave it no device and did not flush its
    pending fused kernel (a conv's layout change of its input and weight) before it: it freed that
    kernel's inputs first, and the kernel read freed names (UnboundLocalError) whenever the weights
    need gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, offload_gb=1e-9, device=device)
    x = torch.randn(2, 3, 8, 8).to(device)
    loss = torch.compile(model, backend="inductor")(x).square().sum()
    loss.backward()
    reference_loss = reference(x).square().sum()
    reference_loss.backward()
    torch.testing.assert_close(loss, reference_loss)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


# ---------------------------------------------------------------------------- CUDA graphs


class _ToyLM(nn.Module):
    """A decoder-shaped toy: resident embedding, offloaded MLP blocks, a tied-free lm_head."""

    def __init__(self, vocab=64, width=32, layers=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))
                                    for _ in range(layers))
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, token):
        h = self.embed(token)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _greedy(step, token, steps):
    tokens = []
    for _ in range(steps):
        token = step(token).argmax(-1)
        tokens.append(token.clone())
    return torch.cat(tokens, -1)


def _wrap_blocks(model, device):
    return ot.wrap_model(model, budget_gb=0.6 * _weight_bytes(model) / GiB, device=device,
                         policy=lambda name: "offload" if name.startswith(("blocks", "head")) else "keep")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_of_a_wrapped_decode_step_replays_the_unwrapped_tokens():
    model = _ToyLM().eval()
    reference = copy.deepcopy(model).cuda()
    _wrap_blocks(model, "cuda")
    start = torch.tensor([[5]], device="cuda")
    with torch.no_grad():
        expected = _greedy(reference, start, 8)
        step = torch.compile(model, backend="aot_eager")
        static_token = start.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step(static_token)  # warm-up: compile and page eagerly
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = step(static_token)
        tokens = []
        static_token.copy_(start)
        for _ in range(8):
            graph.replay()
            static_token.copy_(static_logits.argmax(-1))
            tokens.append(static_token.clone())
    assert torch.equal(torch.cat(tokens, -1), expected)


def test_capture_path_copies_from_the_master_without_the_cache(device, monkeypatch):
    """What a CUDA graph records, run on the emulated device: each page is a copy from the host
    master into graph memory (a replay reads the master's current bytes), the pager's cache is
    not consulted, and row-selective paging refuses with an error that says what to do."""
    model = _ToyLM().eval()
    reference = copy.deepcopy(model).to(device)
    _wrap_blocks(model, device)
    step = torch.compile(model, backend="aot_eager")
    token = torch.tensor([[5]]).to(device)
    with torch.no_grad():
        step(token)  # compiled, with the ordinary paging
        monkeypatch.setattr(ot_compile, "capturing", lambda pager: True)
        before = ot.stats(model)
        torch.testing.assert_close(step(token), reference(token), rtol=0, atol=0)
        after = ot.stats(model)
        assert after.page_ins == before.page_ins and after.hits == before.hits
        assert after.bytes_h2d > before.bytes_h2d
        # a write to a master is seen by the next "replay"
        model.head.weight.mul_(2)
        reference.head.weight.mul_(2)
        torch.testing.assert_close(step(token), reference(token), rtol=0, atol=0)

        table = ot.offload(torch.randn(10, 4), device)
        with pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
            ot_compile.embedding(table._host, table._master.id, table.device, torch.tensor([1]).to(device), -1,
                                 False, False)


# ---------------------------------------------------------------------------- transformers


transformers = pytest.importorskip("transformers")
from offtensor.models.tiny import tiny_transformers as _tiny  # noqa: E402




@pytest.mark.parametrize("name", ["llama", "qwen3_moe"])
def test_static_cache_generate_on_a_compiled_wrapped_transformers_model(device, name):
    base = _tiny(name)
    if torch.device(device).type == "cuda":
        base = base.to(torch.bfloat16)  # grouped_mm, the default MoE kernel, is bfloat16-only on CUDA
    reference = copy.deepcopy(base).to(device)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0)).to(device)
    kwargs = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    expected = reference.generate(ids, **kwargs)
    ot.wrap_model(base, budget_gb=0.4 * _weight_bytes(base) / GiB, device=device)
    counter = GraphCounter()
    base.forward = torch.compile(base.forward, backend=counter)
    assert torch.equal(base.generate(ids, **kwargs), expected)
    assert counter.graphs <= 2  # prefill and decode shapes; no graph per step
    s = ot.stats(base)
    assert s.bytes_h2d > 0 and s.peak_device_bytes <= s.budget_bytes
