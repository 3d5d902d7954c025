"""Ops over the whole of a weight larger than the budget's free room, with no dim to cut across
(``argmax()``, ``std()``, ``median()``, ``unique``, ``histc``, ``nonzero``, a flattened weight's
``sort`` or ``cumsum``, ``torch.cat`` of its slices in ``prod``'s backward, peft's ``index_copy`` of a
trainable token's rows), run from the weight's host master: no weight byte is paged, the result is
the unwrapped op's, and the budget holds. Before, each raised ``BudgetError`` at a budget wrap had
accepted."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.ops import host_compute

from test_lines_in_slices import BUDGET, GiB, _Holder

aten = torch.ops.aten


def _weight():
    torch.manual_seed(0)
    return torch.randn(64, 128).round(decimals=1)  # (rounded: ties and repeats for mode and unique)


def _wrapped(device, weight=None):
    model = _Holder((_weight() if weight is None else weight).clone())
    ot.wrap_model(model, budget_gb=BUDGET / GiB, device=device)
    assert isinstance(model.w, ot.OffloadedTensor)
    assert model.w.host_nbytes > model.w._master.pager.free_bytes()  # (what the test is about)
    return model


# On any device the CPU's result is the device's: they select, count or copy.
SELECT = {
    "argmax()": lambda w: w.argmax(),
    "argmin()": lambda w: w.argmin(),
    "t().argmax()": lambda w: w.t().argmax(),
    "aminmax()": lambda w: torch.aminmax(w),
    "count_nonzero()": lambda w: torch.count_nonzero(w),
    "median()": lambda w: w.median(),
    "t()[::2].nanmedian()": lambda w: w.t()[::2].nanmedian(),
    "unique(return_inverse, return_counts)": lambda w: torch.unique(w, return_inverse=True, return_counts=True),
    "unique(dim=0)": lambda w: torch.unique(w, dim=0),
    "unique_consecutive(flatten)": lambda w: torch.unique_consecutive(w.flatten()),
    "nonzero()": lambda w: w.nonzero(),
    "w[w > 0]": lambda w: w[w > 0],
    "masked_select": lambda w: w.masked_select(w < -1),
    "take": lambda w: w.take(torch.tensor([0, 77, 8191], device=w.device)),
    "flatten().sort(stable=True)": lambda w: w.flatten().sort(stable=True),
    "isin": lambda w: torch.isin(w, torch.tensor([0.5, -0.3], device=w.device)),
    "cat of two slices": lambda w: torch.cat([w[40:], w[:40]]),
    "flip(0)": lambda w: w.flip(0),
    "roll(5)": lambda w: w.roll(5),
    "triu(1)": lambda w: w.triu(1),
    "index_copy(0, rows)": lambda w: w.index_copy(0, torch.tensor([3, 9], device=w.device),
                                                   torch.ones(2, 128, device=w.device)),
    "w[:, reversed columns]": lambda w: w[:, torch.arange(127, -1, -1, device=w.device)],
}
# Ops that compute, or pick among equal elements: the same on the emulated device; a GPU's kernel
# may round or pick otherwise, and there they warn.
COMPUTE = {
    "std()": lambda w: w.std(),
    "var_mean()": lambda w: torch.var_mean(w),
    "logsumexp((0, 1))": lambda w: w.logsumexp((0, 1)),
    "histc(bins=7)": lambda w: torch.histc(w, bins=7),
    "histogram(bins=5)": lambda w: torch.histogram(w, bins=5) if w.device.type == "cpu" else None,
    "flatten().topk(5)": lambda w: w.flatten().topk(5),
    "flatten().kthvalue(100)": lambda w: w.flatten().kthvalue(100),
    "flatten().mode()": lambda w: w.flatten().mode(),
    "flatten().cumsum(0)": lambda w: w.flatten().cumsum(0),
    "flatten().softmax(0)": lambda w: w.flatten().softmax(0),
    "dot(flatten, ones)": lambda w: torch.dot(w.flatten(), torch.ones(w.numel(), device=w.device)),
}


def _outputs(result):
    return list(result) if isinstance(result, (tuple, list)) else [result]


def _check(op, device, exact: bool):
    model = _wrapped(device)
    pager = model.w._master.pager
    expected = op(_weight().to(device))
    if expected is None:
        pytest.skip("no kernel for this op on this device")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = op(model.w)
    for g, e in zip(_outputs(got), _outputs(expected)):
        assert type(g) is torch.Tensor and g.device == e.device and g.shape == e.shape
        if exact == "close":
            torch.testing.assert_close(g, e)
        elif exact or device == "cpu":
            assert torch.equal(g, e)
        else:
            torch.testing.assert_close(g, e)
    assert pager.stats.peak_device_bytes <= pager.budget_bytes
    ours = [w for w in caught if "offtensor" in str(w.message)]
    assert not ours if exact is True or device == "cpu" else ours and "'w'" in str(ours[0].message)
    return model, got


def test_an_op_over_a_whole_weight_larger_than_the_room_pages_none_of_it(device):
    """Computed where the weight lives: its result is the only thing the device receives."""
    model, _ = _check(SELECT["median()"], device, exact=True)
    assert model.w._master.pager.stats.bytes_h2d == 0


@pytest.mark.parametrize("name", sorted(SELECT))
def test_an_op_that_selects_over_a_whole_weight_larger_than_the_room_gives_its_result_bit_for_bit(name, device):
    _check(SELECT[name], device, exact=True)


@pytest.mark.parametrize("name", sorted(COMPUTE))
def test_an_op_that_computes_over_a_whole_weight_larger_than_the_room_gives_its_result(name, device):
    _check(COMPUTE[name], device, exact=False)


def test_a_result_computed_on_the_host_is_not_the_weights_memory(device):
    """On the emulated device the host is the device: a result that came out as the master's own
    bytes would let a write to it change the weight unseen."""
    model, got = _check(lambda w: torch.cat([w]), device, exact=True)
    got.fill_(7.0)
    assert torch.equal(model.w.materialize(), _weight().to(device))


@pytest.mark.parametrize("name, op", [
    ("median()", lambda w: w.median()),
    ("prod()", lambda w: w.prod()),  # its backward cats slices of the flattened weight
    ("flatten().sort()", lambda w: w.flatten().sort().values[-10:].sum()),
    ("w[w > 0]", lambda w: w[w > 0].square().sum()),
])
def test_gradients_through_an_op_over_a_whole_weight_larger_than_the_room_are_the_unwrapped_ones(name, op, device):
    weight = (_weight() * 0.1 + 1).to(device)
    model = _wrapped(device, weight.cpu())
    plain = weight.clone().requires_grad_()
    op(model.w).backward()
    op(plain).backward()
    if name == "prod()":
        # Autograd's prod backward takes its zero-safe branch (cumprod) for any tensor subclass,
        # whatever the budget: it rounds otherwise than the plain tensor's ``result / input``.
        torch.testing.assert_close(model.w.grad, plain.grad)
    else:
        assert torch.equal(model.w.grad, plain.grad)
    pager = model.w._master.pager
    assert pager.stats.peak_device_bytes <= pager.budget_bytes


def test_a_lazy_cast_of_a_weight_larger_than_the_room_is_read_on_the_host_in_its_dtype(device):
    """``w.half()`` with grad on is a cast view of the master's float32 bytes (cast_views)."""
    model = _wrapped(device)
    cast = model.w.half()
    assert isinstance(cast, ot.OffloadedTensor) and cast.dtype == torch.float16
    expected = _weight().to(device).half()
    assert torch.equal(torch.unique(cast), torch.unique(expected))
    assert torch.equal(cast.argmax(), expected.argmax())


def test_only_ops_that_compute_or_pick_among_equals_warn_on_a_gpu():
    """Which ops a GPU's kernel gives bit for bit from the CPU's (this machine has no GPU to run
    them): selections, counts and copies do; sums, and picks among equal elements, may not."""
    exact = host_compute._exact_anywhere
    w = torch.zeros(2)
    for func in (aten.argmax.default, aten.median.default, aten.nonzero.default, aten.cat.default,
                 aten.index_copy.default, aten.count_nonzero.default):
        assert exact(func, (w,), {})
    for func in (aten.std.correction, aten.histc.default, aten.topk.default, aten.mode.default,
                 aten.cumsum.default, aten.dot.default, aten.index_add.default, aten.sort.default):
        assert not exact(func, (w,), {})
    assert exact(aten.sort.stable, (w,), {"stable": True}) and not exact(aten.sort.stable, (w,), {"stable": False})
    assert exact(aten._unique2.default, (w, True), {}) and not exact(aten._unique2.default, (w, False), {})


def test_peft_trainable_token_indices_train_with_the_table_larger_than_the_room(device):
    """peft builds a whole copy of the table with its trained rows put in, every forward
    (``W.index_copy(0, rows, deltas)``): on the host, where the table does not fit the room."""
    peft = pytest.importorskip("peft")
    from transformers import LlamaConfig, LlamaForCausalLM

    def build():
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=2048, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
        lora = peft.LoraConfig(r=2, target_modules=["q_proj"], trainable_token_indices=[3, 7, 100])
        return peft.get_peft_model(LlamaForCausalLM(config), lora).to(device)

    plain, model = build(), build()
    ot.wrap_model(model, budget_gb=200e3 / GiB, device=device)
    table = model.base_model.model.model.embed_tokens.token_adapter.base_layer.weight
    assert isinstance(table, ot.OffloadedTensor) and table.host_nbytes > table._master.pager.free_bytes()
    ids = torch.randint(0, 2048, (2, 6), device=device)
    for m in (plain, model):
        optimizer = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1)
        for _ in range(2):
            m(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert torch.equal(model(ids).logits, plain(ids).logits)
    stats = ot.stats(model)
    assert stats.peak_device_bytes <= stats.budget_bytes


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")
def test_an_interrupt_at_any_point_of_an_op_on_the_host_leaves_the_pager_free_for_the_next(device):
    """Ctrl-C anywhere between the slices' attempt and the host's result: the same op run again
    gives the result, within the budget."""
    from test_interrupts_more import _Points, _points

    model = _wrapped(device)
    pager = model.w._master.pager
    expected = _weight().to(device).flatten().sort(stable=True)

    def run():
        with torch.no_grad():
            return model.w.flatten().sort(stable=True)

    def ours(code) -> bool:
        return "offtensor" in code.co_filename and "ops" in code.co_filename

    points = _points(run, ours)
    assert points > 5
    for n in range(1, points + 1):
        _Points(n, ours).run(run)
        got = run()
        assert torch.equal(got.values, expected.values) and torch.equal(got.indices, expected.indices)
        assert pager.stats.peak_device_bytes <= pager.budget_bytes


# Linear algebra, FFTs and other ops every element of the weight feeds (a spectral norm logged,
# singular values analysed): on the host too.
ANALYSIS = {
    "linalg.svdvals": lambda w: torch.linalg.svdvals(w),
    "linalg.matrix_norm(ord=2)": lambda w: torch.linalg.matrix_norm(w, ord=2),
    "linalg.matrix_rank": lambda w: torch.linalg.matrix_rank(w),
    "linalg.qr": lambda w: torch.linalg.qr(w),
    "fft.rfft(flatten)": lambda w: torch.fft.rfft(w.flatten()),
    "trace": lambda w: torch.trace(w),
    "renorm": lambda w: w.renorm(2, 0, 1.0),
    "addr": lambda w: torch.addr(w, torch.ones(64, device=w.device), torch.ones(128, device=w.device)),
    "_foreach_norm": lambda w: torch._foreach_norm([w]),
    "get_total_norm": lambda w: torch.nn.utils.get_total_norm([w, w[:3]]),
}


# For a tensor subclass torch's composite ``svdvals`` computes the singular vectors too (they
# might be needed for a gradient), whatever the budget: the values agree to float32's precision.
_SUBCLASS_BRANCH = ("linalg.svdvals", "linalg.matrix_norm(ord=2)")


@pytest.mark.parametrize("name", sorted(ANALYSIS))
def test_linear_algebra_and_ffts_of_a_weight_larger_than_the_room_give_the_unwrapped_result(name, device):
    _check(ANALYSIS[name], device, exact="close" if name in _SUBCLASS_BRANCH else False)


# Elementwise ops without torch's pointwise tag: in slices on the device, bit for bit anywhere.
ELEMENTWISE = {
    "1 - w": lambda w: 1 - w,
    "rsub(w, x)": lambda w: torch.rsub(w, torch.ones(128, device=w.device), alpha=3),
    "w // 0.3": lambda w: w // 0.3,
    "complex(w, w)": lambda w: torch.complex(w, w),
    "polar(|w|, w)": lambda w: torch.polar(w.abs(), w),
    "frexp": lambda w: torch.frexp(w),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_an_elementwise_op_without_the_pointwise_tag_runs_on_a_weight_larger_than_the_room(name, device):
    _check(ELEMENTWISE[name], device, exact=name != "frexp")


def test_a_foreach_product_of_one_weight_larger_than_the_room_is_not_cut_as_elementwise(device):
    """``_foreach_mm``'s one element cut in slices along rows multiplied mismatched halves: torch's
    shape error for a valid call. Its element runs whole, on the host."""
    if not hasattr(torch, "_foreach_mm"):
        pytest.skip("no _foreach_mm in this torch")
    other = torch.randn(128, 8, device=device)
    _check(lambda w: torch._foreach_mm([w], [other]), device, exact=False)


def test_distances_to_a_codebook_larger_than_the_room_train_the_queries(device):
    """A vector quantiser's ``torch.cdist(z, codebook)`` with the codebook frozen and offloaded: the
    forward runs in tiles of its rows, and the backward, which reads the codebook whole, on the host."""
    torch.manual_seed(0)
    codebook = torch.randn(96, 96)  # 36 KiB
    model = _Holder(codebook.clone().requires_grad_(False))
    ot.wrap_model(model, budget_gb=12 * 1024 / GiB, device=device)
    assert model.w.host_nbytes > model.w._master.pager.free_bytes()
    z = torch.randn(5, 96, device=device)
    got, want = z.clone().requires_grad_(), z.clone().requires_grad_()
    torch.cdist(got, model.w).min(1).values.sum().backward()
    torch.cdist(want, codebook.to(device)).min(1).values.sum().backward()
    torch.testing.assert_close(got.grad, want.grad)
    if device == "cpu":
        assert torch.equal(got.grad, want.grad)


# In-place ops on a weight larger than the room: those that write by index, by mask or by position
# run their out-of-place form on the host and write the result back; the in-place forms of
# pointwise ops that torch leaves untagged (``abs_``, ``eq_``...) run in slices.
IN_PLACE = {
    "index_copy_": lambda w: w.index_copy_(0, torch.tensor([3, 9], device=w.device), torch.ones(2, 128, device=w.device)),
    "index_fill_": lambda w: w.index_fill_(1, torch.tensor([0, 5], device=w.device), -2.0),
    "index_add_": lambda w: w.index_add_(0, torch.tensor([1, 1], device=w.device), torch.ones(2, 128, device=w.device)),
    "masked_scatter_": lambda w: w.masked_scatter_(w > 1, torch.zeros(64, 128, device=w.device)),
    "scatter_": lambda w: w.scatter_(0, torch.zeros(1, 128, dtype=torch.long, device=w.device), 5.0),
    "scatter_add_": lambda w: w.scatter_add_(1, torch.zeros(64, 1, dtype=torch.long, device=w.device),
                                             torch.ones(64, 1, device=w.device)),
    "tril_": lambda w: w.tril_(-3),
    "cumsum_": lambda w: w.cumsum_(0),
    "renorm_": lambda w: w.renorm_(2, 0, 1.0),
    "abs_": lambda w: w.abs_(),
    "eq_": lambda w: w.eq_(0.5),
    "threshold_": lambda w: torch.nn.functional.threshold_(w, 0.1, -1.0),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_an_in_place_op_on_a_weight_larger_than_the_room_writes_what_the_unwrapped_op_writes(name, device):
    model = _wrapped(device)
    pager = model.w._master.pager
    model.w.detach().abs().max()  # (a read first: a cached copy the write must drop)
    plain = _weight().to(device)
    with torch.no_grad():
        IN_PLACE[name](plain)
        returned = IN_PLACE[name](model.w)
    assert returned is model.w
    assert torch.equal(model.w.materialize(), plain)
    with torch.no_grad():
        assert torch.equal(model.w * 1, plain)  # through the device: no stale cached copy
    assert pager.stats.peak_device_bytes <= pager.budget_bytes


IN_PLACE_PRODUCTS = {
    "addmm_": lambda w, a: w.addmm_(a, a.t().repeat(1, 2), beta=0.5, alpha=2.0),
    "addr_": lambda w, a: w.addr_(a[:, 0], a[0].repeat(8)),
    "baddbmm_ of its 3-D view": lambda w, a: w.view(4, 16, 128).baddbmm_(a.view(4, 16, 16),
                                                                          a.t().repeat(1, 2).expand(4, 16, 128)),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE_PRODUCTS))
def test_an_in_place_product_into_a_weight_larger_than_the_room_runs_its_out_of_place_form_on_the_host(name, device):
    """``w.addmm_(a, b)``: no tile rule writes a weight, so before this it raised ``BudgetError``;
    now any in-place op that writes its first argument alone and has an out-of-place form of the
    same name and arguments runs that form on the host and writes the result back in one copy."""
    model = _wrapped(device)
    plain = _weight().to(device)
    a = torch.randn(64, 16, generator=torch.Generator().manual_seed(3)).to(device)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a GPU's warning that the CPU's kernel may round otherwise)
        IN_PLACE_PRODUCTS[name](plain, a)
        IN_PLACE_PRODUCTS[name](model.w, a)
    got = model.w.materialize()
    assert torch.equal(got, plain) if device == "cpu" else torch.allclose(got, plain, atol=1e-4)
    pager = model.w._master.pager
    assert pager.stats.host_ops >= 1 and pager.stats.peak_device_bytes <= pager.budget_bytes


def test_an_interrupt_at_any_point_of_an_in_place_op_on_the_host_leaves_the_weight_whole_or_written(device):
    """The result is written back in one copy: a Ctrl-C leaves the weight as it was or as written."""
    from test_interrupts_more import _whole_or_written

    model = _wrapped(device)
    before = _weight().to(device)
    after = before.clone().tril_(-3)

    def run():
        with torch.no_grad():
            model.w.tril_(-3)

    def ours(code) -> bool:
        return "offtensor" in code.co_filename and "ops" in code.co_filename

    def next_runs(n):
        run()
        assert torch.equal(model.w.materialize(), after)

    assert _whole_or_written(model.w, before, after, run, ours, each=next_runs) > 5


SAME_MASTER = {
    # name: (op, whether torch refuses it on the plain weight)
    "w[:40].index_copy_(0, rows, w[40:42])": (lambda w, i: w[:40].index_copy_(0, i, w[40:42]), False),
    "w[:40].index_add_(0, rows, w[40:42])": (lambda w, i: w[:40].index_add_(0, i, w[40:42], alpha=2), False),
    "w[:40].masked_scatter_(mask, w[40:])": (lambda w, i: w[:40].masked_scatter_(w[:40] > 0, w[40:]), False),
    "w.index_copy_(0, rows, w[:2])": (lambda w, i: w.index_copy_(0, i, w[:2]), True),
    "w.scatter_(0, index, w[:2])": (lambda w, i: w.scatter_(0, torch.zeros_like(w[:2], dtype=torch.long), w[:2]), True),
    "w[40:][rows] = w[:2]": (lambda w, i: w[40:].__setitem__(i, w[:2]), False),
    "w[:40].index_put_((rows,), w[40:42], accumulate)": (lambda w, i: w[:40].index_put_((i,), w[40:42], True), False),
    "w[rows] = w[:2]": (lambda w, i: w.__setitem__(i, w[:2]), True),
    "w.index_put_((rows,), w[:2], accumulate)": (lambda w, i: w.index_put_((i,), w[:2], True), True),
}


@pytest.mark.parametrize("name", sorted(SAME_MASTER))
def test_an_in_place_write_on_the_host_reading_another_view_of_the_weight_runs_or_is_refused_as_torch_does(name, device):
    """Its out-of-place form reads the source from the master before the write: right where the
    source's bytes are disjoint from the written ones (before, ``BudgetError``); a source that
    overlaps part of them gets torch's refusal (before, ``BudgetError`` too), the weight whole.
    ``w[rows] = v`` (``index_put_``) writes the master and reads an offloaded ``v`` from its own."""
    model = _wrapped(device)
    plain = _weight().to(device)
    op, refused = SAME_MASTER[name]
    rows = torch.tensor([3, 9], device=device)
    with torch.no_grad():
        if refused:
            for w in (plain, model.w):
                with pytest.raises(RuntimeError, match="some elements of the input tensor and the written-to tensor"):
                    op(w, rows)
            assert torch.equal(model.w.materialize(), _weight().to(device))
        else:
            op(plain, rows)
            op(model.w, rows)
            assert torch.equal(model.w.materialize(), plain)


class _OwnTensor(nn.Module):
    """A model's own tensor read by an op placement does not plan for (``forward`` calls ``op``)."""

    def __init__(self, shape, op):
        super().__init__()
        self.w = nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))
        self.op = op

    def forward(self, x):
        return self.op(self.w, x)


_IMAGE = (1, 4, 32, 32)
ANY_OP = {
    # name: (the tensor's shape, the op on it and an input)
    "grid_sample": (_IMAGE, lambda w, x: F.grid_sample(w, x.reshape(1, 2, 3, 2).tanh(), align_corners=False)),
    "interpolate(bilinear)": (_IMAGE, lambda w, x: F.interpolate(w, scale_factor=0.5, mode="bilinear") * x.sum()),
    "interpolate(nearest)": (_IMAGE, lambda w, x: F.interpolate(w, scale_factor=2.0) * x.sum()),
    "avg_pool2d": (_IMAGE, lambda w, x: F.avg_pool2d(w, 2) * x.sum()),
    "max_pool2d": (_IMAGE, lambda w, x: F.max_pool2d(w, 2) * x.sum()),
    "adaptive_avg_pool2d": (_IMAGE, lambda w, x: F.adaptive_avg_pool2d(w, 3) * x.sum()),
    "pixel_shuffle": (_IMAGE, lambda w, x: F.pixel_shuffle(w, 2) * x.sum()),
    "unfold": (_IMAGE, lambda w, x: F.unfold(w, 3) * x.sum()),
    "conv2d of it as the input": (_IMAGE, lambda w, x: F.conv2d(w, x.reshape(3, 4, 1, 1))),
    "instance_norm of it": (_IMAGE, lambda w, x: F.instance_norm(w) * x.sum()),
    "batch_norm of it, no running stats": (_IMAGE, lambda w, x: F.batch_norm(w, None, None, training=True) * x.sum()),
    "layer_norm of it": ((32, 128), lambda w, x: F.layer_norm(w, (128,)) * x.sum()),
    "mse_loss": ((32, 128), lambda w, x: F.mse_loss(w, x.sum() * torch.ones(32, 128, device=x.device))),
}


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("name", sorted(ANY_OP))
def test_any_op_on_a_tensor_larger_than_the_room_that_no_slice_covers_runs_on_its_host_master(name, grad, device):
    """wrap accepts a third of the tensor's bytes (placement plans products, convolutions of it as
    a weight and index ops, not these), so the forward must run: before, each raised
    ``BudgetError``. It runs on the host master, the unwrapped result and gradient on the emulated
    device, counted as a host op, within the budget."""
    shape, op = ANY_OP[name]
    plain, model = _OwnTensor(shape, op).to(device), _OwnTensor(shape, op)
    nbytes = model.w.numel() * model.w.element_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a GPU's warning that the CPU's kernel may round otherwise)
        ot.wrap_model(model, budget_gb=nbytes / 3 / GiB, device=device)
        assert isinstance(model.w, ot.OffloadedTensor)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1)).to(device)
        with torch.set_grad_enabled(grad):
            want, got = plain(x), model(x)
            if grad:
                want.sum().backward()
                got.sum().backward()
    exact = device == "cpu"
    assert torch.equal(got, want) if exact else torch.allclose(got, want, atol=1e-5)
    if grad:
        g = model.w.grad.materialize() if isinstance(model.w.grad, ot.OffloadedTensor) else model.w.grad
        assert torch.equal(g, plain.w.grad) if exact else torch.allclose(g, plain.w.grad, atol=1e-5)
    s = ot.stats(model)
    assert s.host_ops >= 1 and s.peak_device_bytes <= s.budget_bytes


def test_a_bag_or_an_index_write_with_other_offloaded_arguments_runs_on_the_host_masters(device):
    """``embedding_bag`` over a table larger than the room with its indices and per-sample weights
    offloaded too (the by-rows path takes plain ones only), and ``index_put_`` with offloaded
    indices: each raised ``BudgetError`` before; on the host masters, the plain results."""
    from offtensor.pager import Pager

    pager = Pager(torch.device(device), budget_bytes=100)
    table, rows = torch.randn(10, 5), torch.tensor([1, 2, 4, 5, 4])
    offsets, weights = torch.tensor([0, 2]), torch.randn(5)
    offloaded = [ot.offload(t, device, pager=pager) for t in (table, rows, offsets, weights)]
    got = F.embedding_bag(offloaded[1], offloaded[0], offloaded[2], mode="sum", per_sample_weights=offloaded[3])
    want = F.embedding_bag(rows, table, offsets, mode="sum", per_sample_weights=weights)
    assert torch.equal(got.cpu(), want) if device == "cpu" else torch.allclose(got.cpu(), want, atol=1e-6)
    values = torch.randn(5, 5)
    offloaded[0].index_put_((offloaded[1],), ot.offload(values, device, pager=pager), accumulate=True)
    table.index_put_((rows,), values, accumulate=True)
    assert torch.equal(offloaded[0].materialize().cpu(), table)
    assert pager.stats.host_ops == 2 and pager.stats.peak_device_bytes <= 100
