"""Budgets found by searching near the smallest one ``wrap_model`` accepts (a bisection on the bytes
of tiny models: dense, convolutional, attention, tied), each with its case: a budget that wrap
accepts runs, and gives the unwrapped model's outputs bit for bit (or wrap warned that it may not)."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offtensor as ot

GiB = 1 << 30


def _wrapped_pair(model: nn.Module, budget_bytes: int, device, fast_path: bool = False):
    """(wrapped, reference): ``model`` wrapped at exactly ``budget_bytes`` with every weight
    offloaded, and an unwrapped copy on ``device``; wrap must not warn that bits may differ (but for
    a skipped fused fast path, with ``fast_path``: the caller runs the composite path)."""
    reference = copy.deepcopy(model).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if fast_path:
            warnings.filterwarnings("ignore", message=".*fast path")
        ot.wrap_model(model, budget_gb=budget_bytes / GiB, device=device, policy={"offload": ["*"]})
    return model, reference


class _ConvThenMatmul(nn.Module):
    """A convolution and an ``x @ w.T`` (torch.matmul), each weight larger than the budget's room."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 64, 3, padding=1)
        self.head = nn.Parameter(torch.randn(64, 1024) / 32)

    def forward(self, x):
        return self.conv(x).flatten(1) @ self.head.T


def test_conv2d_and_matmul_under_inference_mode_run_in_tiles_within_an_accepted_budget(device):
    # Under torch.inference_mode composite ops (conv2d, matmul) reach __torch_dispatch__ whole, where
    # they paged each weight whole instead of meeting convolution's and mm's tiles: a BudgetError
    # at a budget that wrap accepted, and that no_grad runs.
    torch.manual_seed(0)
    model, reference = _wrapped_pair(_ConvThenMatmul().eval(), 64 * 1024 * 4 // 2, device)
    x = torch.randn(2, 4, 4, 4, device=device)
    with torch.no_grad():
        expected = reference(x)
        assert torch.equal(model(x), expected)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_multihead_attention_under_inference_mode_runs_within_an_accepted_budget(device):
    # nn.MultiheadAttention's slow path calls linear on each third of in_proj_weight with torch
    # functions off; under inference mode that composite linear reached dispatch whole, and its
    # matmul broadcast the weight into a bmm instead of folding the 3-D input into one tiled mm.
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(64, 4, batch_first=True)  # training: no fused fast path, no dropout
    model, reference = _wrapped_pair(attention, 16 * 1024, device, fast_path=True)
    x = torch.randn(5, 1, 64, device=device).expand(-1, 3, -1)  # not contiguous: no fold by copy
    with torch.no_grad():
        expected = reference(x, x, x)[0]
        assert torch.equal(model(x, x, x)[0], expected)
    with torch.inference_mode():
        assert torch.equal(model(x, x, x)[0], expected)


class _NormedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(512, 64, max_norm=1.0)
        self.out = nn.Linear(64, 8)

    def forward(self, ids):
        return self.out(self.embed(ids).mean(1))


def test_an_embedding_with_max_norm_runs_at_a_budget_of_a_few_of_its_rows(device):
    # Its lookup renormalises the rows it reads in place (embedding_renorm_): placement once took the
    # table for one that linear reads in tiles and accepted budgets of a few rows, whose first
    # forward then raised BudgetError, as the renorm paged the whole table. The renorm pages only
    # the rows it looks up now (ops.row_writes), so the table is planned by rows as a plain one is.
    table = 512 * 64 * 4
    ids = torch.randint(0, 512, (4, 6), generator=torch.Generator().manual_seed(1)).to(device)
    for budget in (table // 4, table):
        model, reference = _wrapped_pair(_NormedEmbedding(), budget, device)
        assert isinstance(model.embed.weight, ot.OffloadedTensor)
        with torch.no_grad():
            assert torch.equal(model(ids), reference(ids))
        assert torch.equal(model.embed.weight.cpu(), reference.embed.weight.cpu())  # the rows it renormalised
        stats = ot.stats(model)
        assert stats.peak_device_bytes <= stats.budget_bytes


class _SpectralNormed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.utils.parametrizations.spectral_norm(nn.Linear(64, 256))
        self.out = nn.Linear(256, 8)

    def forward(self, x):
        return self.out(self.layer(x))


@pytest.mark.parametrize("training", [False, True])
def test_spectral_norm_runs_at_the_smallest_budget_wrap_accepts(training, device):
    # The parametrized weight is mv(original, _v) / ...: _u and _v live in the parametrization's own
    # module, which placement counted apart, so the smallest budget it accepted held the original
    # weight alone and the first forward raised BudgetError paging '_v' beside it.
    def build():
        torch.manual_seed(0)
        return _SpectralNormed().train(training)

    def accepts(nbytes):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                ot.wrap_model(build(), budget_gb=nbytes / GiB, device=device, policy={"offload": ["*"]})
        except (ot.BudgetError, UserWarning):
            return False
        return True

    low, high = 0, 256 * 64 * 4 * 2
    while low + 1 < high:  # the smallest budget wrap accepts without warning that bits may differ (tiles of one row)
        middle = (low + high) // 2
        low, high = (low, middle) if accepts(middle) else (middle, high)
    model, reference = _wrapped_pair(build(), high, device)
    x = torch.randn(5, 64, device=device)
    for _ in range(2):  # in training each forward runs a power iteration, writing _u and _v
        with torch.no_grad():
            assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


class _ProductOfTwoWeights(nn.Module):
    """One op reading weights of two modules at once: ``a.weight.T @ b.weight.T`` (an absorbed
    projection, a LoRA merge's ``B @ A``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 128, bias=False)
        self.b = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return x @ torch.mm(self.a.weight.t(), self.b.weight.t())


@pytest.mark.parametrize("budget_bytes", [16 * 1024, 32 * 1024 + 896])
def test_an_op_reading_two_offloaded_weights_tiles_both_within_an_accepted_budget(budget_bytes, device):
    # mm paged its first operand whole beside each column tile of the second: at 16 KiB (room for
    # 16 rows of one and 16 columns of the other) it raised BudgetError; at 32.9 KiB it cut the
    # columns one wide, which sums in another order than the whole op, without a warning.
    torch.manual_seed(0)
    model, reference = _wrapped_pair(_ProductOfTwoWeights().eval(), budget_bytes, device)
    x = torch.randn(5, 64, device=device)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes


def test_a_budget_given_as_any_real_number_is_taken_in_gib(device):
    # np.float64 was taken but np.float32, np.int64 and Fraction were refused as "not a
    # non-negative number of GiB", though a budget computed with numpy is one of them.
    import fractions

    np = pytest.importorskip("numpy")
    for budget in (np.float32(0.5), np.int64(1), fractions.Fraction(1, 2), np.float64(0.5)):
        model = nn.Linear(8, 8)
        ot.wrap_model(model, budget_gb=budget, device=device)
        assert ot.stats(model).budget_bytes == int(float(budget) * GiB)
    for bad in (np.float32("nan"), np.int64(-1), True):
        with pytest.raises(ValueError, match="budget_gb"):
            ot.wrap_model(nn.Linear(8, 8), budget_gb=bad, device=device)


@pytest.mark.parametrize("arguments, words", [
    ({"prefetch": "yes"}, "prefetch must be True or False, got 'yes'"),
    ({"prefetch": None}, "prefetch must be True or False, got None"),
    ({"policy": {"offload": 3}}, "policy\\['offload'\\] must be a glob pattern of weight names or a list of them"),
    ({"policy": {"keep": [0]}}, "policy\\['keep'\\] must be a glob pattern"),
    ({"policy": 3}, "policy must be a glob pattern of weight names or a list of them .*got 3"),
])
def test_a_wrong_argument_is_refused_naming_it_before_anything_moves(arguments, words, device):
    # A policy of the wrong type raised "'int' object is not iterable" from inside placement; a
    # prefetch of "yes" (or None) was taken for its truth value, without a word.
    model = nn.Linear(8, 8)
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=words):
        ot.wrap_model(model, budget_gb=1e-3, device=device, **arguments)
    assert type(model.weight) is nn.Parameter and torch.equal(model.weight.detach(), before)


def test_a_forward_under_inference_mode_leaves_pages_that_later_forwards_can_use(device):
    # The arena's ranges keep their typed views for the next copy; made under inference_mode those
    # were inference tensors, so a later no_grad forward raised on F.linear of a 3-D input that does
    # not fold (its tile must require grad, as the unwrapped weight does, to take matmul's kernel).
    torch.manual_seed(0)
    model, reference = _wrapped_pair(nn.Linear(64, 256), 32 * 1024, device)
    x = torch.randn(5, 1, 64, device=device).expand(-1, 3, -1)
    with torch.no_grad():
        expected = reference(x)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    assert torch.equal(model(x), reference(x))


def test_a_model_wrapped_under_inference_mode_trains_and_loads_after_it(device):
    # Wrapped inside torch.inference_mode (a setup function under @torch.inference_mode()), every
    # master and wrapper was an inference tensor: an optimizer step or load_state_dict outside it
    # raised "Inplace update to inference tensor outside InferenceMode", where the plain model runs.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 64))
    reference = copy.deepcopy(model).to(device)
    with torch.inference_mode():
        ot.wrap_model(model, budget_gb=40 * 1024 / GiB, device=device)
    assert any(isinstance(p, ot.OffloadedTensor) for p in model.parameters())
    ids = torch.randint(0, 64, (3, 5), device=device)
    for m in (reference, model):
        optimizer = torch.optim.AdamW(m.parameters(), lr=1e-2)
        m(ids).pow(2).mean().backward()
        optimizer.step()
    for (name, want), got in zip(reference.state_dict().items(), model.state_dict().values()):
        assert torch.equal(got.cpu(), want.cpu()), name
    model.load_state_dict(reference.state_dict())


class _CosineHead(nn.Module):
    """A classifier on normalised weights: F.normalize ends in ``norm.expand_as(weight)``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(256, 64))

    def forward(self, x):
        return F.linear(F.normalize(x), F.normalize(self.weight))


def test_composite_views_shaped_by_an_offloaded_weight_run_under_inference_mode(device):
    # Under inference_mode expand_as (view_as, reshape_as) reaches dispatch whole, with a plain
    # tensor first and the weight second, and the view handler read the plain tensor's host view:
    # F.normalize(weight) raised AttributeError.
    torch.manual_seed(0)
    model, reference = _wrapped_pair(_CosineHead().eval(), 128 * 1024, device)
    x = torch.randn(5, 64, device=device)
    with torch.no_grad():
        expected = reference(x)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)


class _OwnProduct(nn.Module):
    """A model's own module whose forward multiplies two of its own weights (a low-rank factorised
    projection, an absorbed attention): ``mm``, or ``einsum`` (bmm on a batch of one), of 2-D
    weights, or ``bmm`` / ``einsum`` of 3-D ones."""

    def __init__(self, product: str):
        super().__init__()
        self.product = product
        batch = (4,) if product.endswith("3d") else ()
        self.w1 = nn.Parameter(torch.randn(*batch, 48, 128) / 8)
        self.w2 = nn.Parameter(torch.randn(*batch, 128, 80) / 8)

    def forward(self, x):
        if self.product == "mm":
            w = self.w1 @ self.w2
        elif self.product == "bmm3d":
            w = torch.bmm(self.w1, self.w2)
        else:
            w = torch.einsum("...ij,...jk->...ik", self.w1, self.w2)
        return x @ w


def _smallest_accepted(build, high: int, device) -> int:
    """The smallest budget in bytes that wrap_model accepts for ``build()`` with every weight offloaded."""
    low = 0
    while low + 1 < high:
        middle = (low + high) // 2
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ot.wrap_model(build(), budget_gb=middle / GiB, device=device, policy={"offload": ["*"]})
        except ot.BudgetError:
            low = middle
        else:
            high = middle
    return high


@pytest.mark.parametrize("product", ["mm", "einsum", "bmm3d", "einsum3d"])
def test_a_module_multiplying_two_of_its_weights_runs_at_every_budget_wrap_accepts(product, device):
    # Placement counted a model's own module at its largest weight's tile, as if its forward read
    # one weight per op: a budget of one slice of w1 was accepted, and w1 @ w2, which pages a tile of
    # each, raised BudgetError in forward (as an einsum of them did: bmm on a batch of one).
    def build():
        torch.manual_seed(0)
        return _OwnProduct(product)

    smallest = _smallest_accepted(build, 10**7, device)
    assert smallest >= 128 * 4 * 2  # a row of w1 and a column of w2: what one tile of w1 @ w2 pages
    with pytest.raises(ot.BudgetError, match=rf"'w[12]' \(one op of the model itself, 2 offloaded tensors\) needs .*\({smallest} bytes\)"):
        ot.wrap_model(build(), budget_gb=(smallest - 1) / GiB, device=device, policy={"offload": ["*"]})
    whole = sum(p.numel() * 4 for p in build().parameters())
    x = torch.randn(4, 3, 48, device=device) if product.endswith("3d") else torch.randn(3, 48, device=device)
    for budget in sorted({smallest, smallest + 700, 3 * smallest, whole // 3, whole // 2 + 4096, whole}):
        model, reference = build(), build().to(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})
        exact = not any("in the last bits" in str(w.message) for w in caught)
        out, expected = model(x), reference(x)
        out.square().sum().backward()
        expected.square().sum().backward()
        for got, want in ((out, expected), (model.w1.grad, reference.w1.grad), (model.w2.grad, reference.w2.grad)):
            if exact:
                assert torch.equal(got, want), budget
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        s = ot.stats(model)
        assert s.peak_device_bytes <= s.budget_bytes, budget


# ---------------------------------------------------------------------------- a model's own tensors read by convolutions
# A model's own module may read its tensors by ops other than a product: a convolution of any form
# (F.conv1d on a bare 3-D Parameter, grouped, depthwise, dilated, strided, transposed), an einsum
# that permutes a stacked weight, an index op. Placement counted a bare tensor of three or more
# dims at a slice of one matrix of the stack, as bmm reads it, and convolution paged at least one
# whole output channel (grouped and transposed ones the whole weight), an index op at least one
# whole row (a matrix of the stack), embedding_bag the whole table: every budget near the smallest
# accepted raised BudgetError in forward.


def _index_input(device):
    return torch.randint(0, 200, (7,), generator=torch.Generator().manual_seed(3)).to(device)


READERS = {
    # name: (weight shape, bias size or None, forward(module, x), input shape, or a function of the device)
    "conv1d": ((32, 16, 5), 32, lambda m, x: F.conv1d(x, m.w, m.b, stride=2, padding=1, dilation=2), (2, 16, 24)),
    "conv1d grouped": ((32, 4, 5), 32, lambda m, x: F.conv1d(x, m.w, m.b, padding=2, groups=4), (2, 16, 24)),
    "conv1d depthwise": ((16, 1, 4), None, lambda m, x: F.conv1d(x, m.w, padding=3, groups=16), (2, 16, 24)),
    "conv2d": ((32, 8, 3, 3), 32, lambda m, x: F.conv2d(x, m.w, m.b, padding=1), (2, 8, 9, 9)),
    "conv2d grouped": ((32, 2, 3, 3), None, lambda m, x: F.conv2d(x, m.w, stride=2, groups=4), (2, 8, 9, 9)),
    "conv3d": ((16, 4, 3, 3, 3), 16, lambda m, x: F.conv3d(x, m.w, m.b, padding=1, dilation=(1, 2, 1)), (2, 4, 5, 6, 5)),
    "conv_transpose1d": ((16, 32, 5), 32, lambda m, x: F.conv_transpose1d(x, m.w, m.b, stride=2, output_padding=1),
                         (2, 16, 12)),
    "conv_transpose2d": ((8, 32, 3, 3), None, lambda m, x: F.conv_transpose2d(x, m.w, stride=2, padding=1), (2, 8, 6, 6)),
    "conv_transpose2d grouped": ((8, 8, 3, 3), 16, lambda m, x: F.conv_transpose2d(x, m.w, m.b, groups=2), (2, 8, 6, 6)),
    "conv_transpose3d": ((4, 16, 3, 3, 3), None, lambda m, x: F.conv_transpose3d(x, m.w, dilation=2), (2, 4, 4, 4, 4)),
    "einsum by heads": ((8, 32, 48), None, lambda m, x: torch.einsum("bhi,hio->bho", x, m.w), (5, 8, 32)),
    "einsum permuted": ((32, 8, 48), None, lambda m, x: torch.einsum("bhi,iho->bho", x, m.w), (5, 8, 32)),
    "index_select": ((200, 32), None, lambda m, x: m.w.index_select(0, x), _index_input),
    "index_select of a stack": ((200, 16, 24), None, lambda m, x: m.w.index_select(0, x), _index_input),
    "indexing a stack": ((200, 24, 20), None, lambda m, x: m.w[x] * 2, _index_input),
    "embedding_bag": ((200, 32), None, lambda m, x: F.embedding_bag(x, m.w, _offsets(x), padding_idx=int(x[1])),
                      _index_input),
    "embedding_bag max": ((200, 32), None, lambda m, x: F.embedding_bag(x, m.w, _offsets(x), mode="max"), _index_input),
}


def _offsets(x):
    return torch.tensor([0, 3, 3], device=x.device)  # three bags, one of them empty


class _OwnReader(nn.Module):
    """A model's own module holding a bare weight (and bias) that its forward reads by ``READERS[case]``."""

    def __init__(self, case: str):
        super().__init__()
        shape, bias, self.read, _ = READERS[case]
        self.w = nn.Parameter(torch.randn(*shape) / 8)
        self.b = nn.Parameter(torch.randn(bias) / 8) if bias else None

    def forward(self, x):
        return self.read(self, x)


def _reader_input(case: str, device, seed: int = 2):
    shape = READERS[case][3]
    if callable(shape):
        return shape(device)
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _same(got, want, exact: bool, what):
    if got is None and want is None:  # no gradient on either side (an index input)
        return
    if exact:
        assert torch.equal(got, want), what
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _refused_below_then_budgets(build, device) -> tuple:
    """The smallest budget wrap accepts for ``build()`` (every weight offloaded), after checking that
    one byte less is refused naming the weight and those bytes; and the budgets to run it at, from
    there to the whole model."""
    smallest = _smallest_accepted(build, 10**7, device)
    with pytest.raises(ot.BudgetError, match=rf"paging '[wb]'.* \({smallest} bytes\) in all"):
        ot.wrap_model(build(), budget_gb=(smallest - 1) / GiB, device=device, policy={"offload": ["*"]})
    whole = sum(p.numel() * 4 for p in build().parameters())
    return smallest, {smallest, smallest + 700, 3 * smallest, whole // 3, whole // 2 + 4096, whole}


@pytest.mark.parametrize("case", list(READERS))
def test_a_model_tensor_read_by_a_convolution_einsum_or_index_op_runs_at_every_budget_wrap_accepts(case, device):
    def build():
        torch.manual_seed(0)
        return _OwnReader(case)

    smallest, budgets = _refused_below_then_budgets(build, device)
    for budget in sorted(budgets):
        model, reference = build(), build().to(device)
        x = _reader_input(case, device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["*"]})
            with torch.no_grad():
                _same(model(x), reference(x), not any("last bits" in str(w.message) for w in caught), budget)
            if x.is_floating_point():
                x.requires_grad_()  # the input's gradient too: the backward's other half
            out = model(x)
            out.square().sum().backward()
        exact = not any("last bits" in str(w.message) for w in caught)
        grad = x.grad if x.is_floating_point() else None
        x.grad = None
        expected = reference(x)
        expected.square().sum().backward()
        _same(out, expected, exact, budget)
        for got, want in ((model.w.grad, reference.w.grad), (grad, x.grad),
                          *(((model.b.grad, reference.b.grad),) if model.b is not None else ())):
            _same(got, want, exact, budget)
        s = ot.stats(model)
        assert s.peak_device_bytes <= s.budget_bytes, budget
