"""Nothing lost under races and faults.

- Threads: concurrent forwards on one wrapped model give the unwrapped model's outputs and stay
  within the budget; ``unwrap_model``, ``load_state_dict`` and re-placement racing forwards wait
  for the op in flight and never give wrong values (the pager's lock, ``pager.Pager``).
- Atomicity: a ``wrap_model`` or ``load_safetensors`` that fails at any step (an allocation, a
  read, a swap, a registration) leaves the model exactly as it was and frees what it allocated.
  Failures are injected by monkeypatching the step's function from here, never by a switch in
  the library.
- Budget: assignment, ``load_state_dict(assign=True)``, re-placement and deletion on a warm cache
  evict cached copies before new resident bytes are counted: ``peak_device_bytes <= budget``.
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor, _ext
from offtensor import tensor as _tensor
from offtensor.loading import read as _loading_read
from offtensor.model import copies as _copies
from offtensor.model import moves as _moves
from offtensor.model import prepare as _prepare
from offtensor.model.state import pager_of

GiB = 1 << 30
HIDDEN = 32


class Net(nn.Module):
    """Four 32-wide linear layers with a norm buffer: 17 KB of weights, eight offloadable groups."""

    def __init__(self, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x)) * self.scale
        return x


def _nbytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _reference():
    torch.manual_seed(0)
    return Net().eval()


def _inputs(device, n=6):
    return [torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(i)).to(device) for i in range(n)]


def _wrapped(device, fraction=0.4, **kwargs):
    reference = _reference()
    model = copy.deepcopy(reference)
    budget = int(_nbytes(reference) * fraction)
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["layers.*"]}, **kwargs)
    return reference, model, budget


def _on(device, reference):
    """A copy of the unwrapped ``reference`` on ``device``: outputs are compared with the plain model
    on the same device, since a GPU's kernels need not round as the host's do."""
    return copy.deepcopy(reference).to(device)


def _run_threads(work, n):
    errors = []
    threads_per_op = torch.get_num_threads()

    def guarded(k):
        # OpenMP's thread count is per thread: a new thread would use one per core, which on a
        # loaded 2-core machine makes each tiny op 100x slower (conftest sets the main thread's).
        torch.set_num_threads(threads_per_op)
        try:
            work(k)
        except BaseException as error:  # noqa: BLE001 - every failure of a thread is the test's
            errors.append(f"thread {k}: {error!r}")

    threads = [threading.Thread(target=guarded, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a thread hung"
    return errors


# ---------------------------------------------------------------------------- threads (item 1)


def test_concurrent_forwards_agree_with_the_unwrapped_model_within_budget(device):
    """Two threads x 150 no_grad forwards at a 40% budget: on main within a few forwards one thread
    got a BudgetError with negative bytes left, the other a KeyError in the cache, the peak passed
    the budget and every later forward raised."""
    reference, model, budget = _wrapped(device)
    xs = _inputs(device)
    plain = _on(device, reference)
    with torch.no_grad():
        want = [plain(x).cpu() for x in xs]
    mismatches = []

    def work(k):
        for i in range(150):
            j = (i + k) % len(xs)
            with torch.no_grad():
                y = model(xs[j]).cpu()
            if not torch.equal(y, want[j]):
                mismatches.append((k, i))

    errors = _run_threads(work, 2)
    assert errors == [] and mismatches == []
    s = ot.stats(model)
    assert 0 < s.peak_device_bytes <= budget and s.hits > 0
    with torch.no_grad():  # the pager is sound afterwards
        assert torch.equal(model(xs[0]).cpu(), want[0])
    assert ot.stats(model).cached_bytes + ot.stats(model).resident_bytes <= budget


def test_unwrap_racing_forwards_waits_for_the_op_in_flight(device):
    """unwrap_model while another thread runs forwards: each op sees the offloaded weight or the
    plain one, the same values; on main strict mode gave NaN (a cached copy freed under an op)."""
    reference, model, _ = _wrapped(device)
    xs = _inputs(device)
    plain = _on(device, reference)
    with torch.no_grad():
        want = [plain(x).cpu() for x in xs]
    started, bad = threading.Event(), []

    def work(k):
        if k == 1:
            started.wait(10)
            ot.unwrap_model(model)
            return
        for i in range(100):
            with torch.no_grad():
                y = model(xs[i % len(xs)]).cpu()
            if not torch.equal(y, want[i % len(xs)]):
                bad.append(i)
            started.set()

    assert _run_threads(work, 2) == [] and bad == []
    assert not any(isinstance(p, OffloadedTensor) for p in model.parameters())


def _forwards_racing(model, reference, device, mutate) -> list:
    """100 forwards in one thread while another calls ``mutate()`` until they finish (sleeping
    0.5 ms between calls, so the forward thread takes the GIL): the steps whose outputs differ
    from ``reference``'s."""
    xs = _inputs(device)
    plain = _on(device, reference)
    with torch.no_grad():
        want = [plain(x).cpu() for x in xs]
    done, bad = threading.Event(), []

    def work(k):
        if k == 1:
            while not done.is_set():
                mutate()
                time.sleep(0.0005)
            return
        try:
            for i in range(100):
                with torch.no_grad():
                    y = model(xs[i % len(xs)]).cpu()
                if not torch.equal(y, want[i % len(xs)]):
                    bad.append(i)
        finally:
            done.set()

    assert _run_threads(work, 2) == []
    return bad


def test_load_state_dict_racing_forwards_never_gives_wrong_values(device):
    """load_state_dict of the model's own values, repeatedly, while another thread forwards: on
    main the forward raised 'deque mutated during iteration' and strict mode gave NaN."""
    reference, model, _ = _wrapped(device)
    values = {k: v.clone() for k, v in reference.state_dict().items()}
    assert _forwards_racing(model, reference, device, lambda: model.load_state_dict(values)) == []


def test_replacement_racing_forwards_never_gives_wrong_values(device):
    """Weights re-assigned (same values, new Parameters, kept resident or offloaded as they fit)
    while another thread forwards: each op reads the old placement or the new one,
    never a copy freed or half-placed under it, and the budget holds throughout."""
    reference, model, budget = _warm_wrapped(device)
    count = [0]

    def reassign():
        layer, source = model.layers[count[0] % 4], reference.layers[count[0] % 4]
        layer.bias = nn.Parameter(source.bias.detach().clone().to(device))
        layer.weight = nn.Parameter(source.weight.detach().clone().to(device))
        count[0] += 1

    assert _forwards_racing(model, reference, device, reassign) == []
    assert ot.stats(model).peak_device_bytes <= budget


# ---------------------------------------------------------------------------- atomic wrap and load (item 4)


class _FailAt:
    """Wraps ``function`` so that its call number ``k`` (0-based) raises ``error`` after (``after``)
    or instead of running; counts calls when ``k`` is None."""

    def __init__(self, function, k, error=MemoryError, after=False):
        self.function, self.k, self.error, self.after, self.calls = function, k, error, after, 0

    def __call__(self, *args, **kwargs):
        call, self.calls = self.calls, self.calls + 1
        if call == self.k and not self.after:
            raise self.error(f"injected failure at call {call}")
        result = self.function(*args, **kwargs)
        if call == self.k:
            raise self.error(f"injected failure after call {call}")
        return result


# (module, attribute, error, after): the steps of a wrap. ``new_host_master`` after its call is a
# read that fails once the master is allocated; ``join`` and ``Prefetcher`` are registration.
_WRAP_STEPS = {
    "allocation": (_ext, "alloc_host", MemoryError, False),
    "read": (_moves, "new_host_master", RuntimeError, True),
    "master": (_moves, "master_for", RuntimeError, False),
    "swap": (_moves, "swap", RuntimeError, True),
    "registration": (_copies, "join", RuntimeError, True),
    "prefetcher": (_copies, "Prefetcher", RuntimeError, False),
}


def _count_calls(module, attribute, wrap_once):
    counter = _FailAt(getattr(module, attribute), None)
    original = getattr(module, attribute)
    setattr(module, attribute, counter)
    try:
        wrap_once()
    finally:
        setattr(module, attribute, original)
    return counter.calls


def _wrap_for_faults(model, device="cpu"):
    budget = int(_nbytes(model) * 0.4)
    return ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["layers.*"]})


def _wrap_cases():
    cases = []
    for step, (module, attribute, _, _) in _WRAP_STEPS.items():
        calls = _count_calls(module, attribute, lambda: _wrap_for_faults(_reference()))
        assert calls >= 1, f"a wrap no longer calls {attribute}"
        cases += [(step, k) for k in range(calls)]
    return cases


def _snapshot(model):
    """Everything "exactly as it was" means: each slot's object, its class, storage and values,
    each module's class."""
    tensors = {name: (t, type(t), t.untyped_storage().data_ptr() if t.layout == torch.strided else None,
                      t.detach().clone()) for name, t in [*model.named_parameters(), *model.named_buffers()]}
    return tensors, [(m, type(m)) for m in model.modules()]


def _assert_unchanged(model, before):
    tensors, modules = before
    now = dict([*model.named_parameters(), *model.named_buffers()])
    assert now.keys() == tensors.keys()
    for name, (t, cls, ptr, values) in tensors.items():
        assert now[name] is t and type(t) is cls and not isinstance(t, OffloadedTensor), name
        if values.is_meta:  # a model built for loading: still without values
            assert t.is_meta, name
            continue
        if ptr is not None:
            assert t.untyped_storage().data_ptr() == ptr, name
        assert torch.equal(t.detach().to_dense(), values.to_dense()), name
    assert all(type(m) is cls for m, cls in modules)
    assert not _copies.is_wrapped(model) and pager_of(model) is None
    assert not any(hook for m in model.modules() for hook in m._load_state_dict_post_hooks.values())
    assert not model._forward_pre_hooks


def _fail_and_check(monkeypatch, step, k, run, model, before, live_before):
    module, attribute, error, after = _WRAP_STEPS.get(step, (None, None, None, None)) if isinstance(step, str) else step
    monkeypatch.setattr(module, attribute, _FailAt(getattr(module, attribute), k, error, after))
    failed = None
    try:
        run()
    except error as e:  # caught here, so its traceback (and the frames holding new tensors) goes now
        failed = str(e)
    assert failed is not None and "injected failure" in failed
    monkeypatch.undo()
    _assert_unchanged(model, before)
    assert _ext.live_host_bytes() == live_before, "the failed placement kept host memory"


@pytest.mark.parametrize("step,k", _wrap_cases())
def test_a_failed_wrap_leaves_the_model_exactly_as_it_was(monkeypatch, device, step, k):
    """A failure injected at call k of each step of wrap_model: the model keeps its tensors, classes
    and values, is not wrapped, holds no host memory from the attempt and wraps fine afterwards. On
    main a MemoryError at the 10th host allocation left 9-10 of 20 parameters offloaded."""
    model = _reference()
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = model(x)  # on the host, where the model stays when its wrap fails
        want_on_device = _on(device, model)(x.to(device))
    live_before = _ext.live_host_bytes()
    before = _snapshot(model)
    _fail_and_check(monkeypatch, step, k, lambda: _wrap_for_faults(model, device), model, before, live_before)
    with torch.no_grad():
        assert torch.equal(model(x), want)
    _wrap_for_faults(model, device)  # not "already wrapped"
    with torch.no_grad():
        assert torch.equal(model(x.to(device)), want_on_device)


def test_an_unoffloadable_buffer_is_refused_before_anything_moves(device):
    """A sparse buffer among offloaded weights: refused with the buffer's name before any weight is
    offloaded (on main the weights before it were already OffloadedTensors)."""
    model = _reference()
    model.layers[3].register_buffer("mask", torch.eye(HIDDEN).to_sparse())
    before = _snapshot(model)
    budget = int(_nbytes(_reference()) * 0.4)
    with pytest.raises(ValueError, match="layers.3.mask"):
        ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["layers.*"]})
    _assert_unchanged(model, before)


def _checkpoint(tmp_path):
    from safetensors.torch import save_file

    reference = _reference()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    return reference, path


def _meta_model():
    with torch.device("meta"):
        return Net()


_LOAD_STEPS = {
    "allocation": (_ext, "alloc_host", MemoryError, False),
    "read": (_loading_read, "pread_into", OSError, False),
    "swap": (_prepare, "swap", RuntimeError, True),
    "registration": (_copies, "join", RuntimeError, True),
}


@pytest.mark.parametrize("step", sorted(_LOAD_STEPS))
def test_a_failed_load_leaves_the_model_exactly_as_it_was(monkeypatch, tmp_path, device, step):
    """load_safetensors with a failure injected at every call of each step: the meta model is
    untouched and not wrapped, the host memory read so far is freed, and the next load works."""
    pytest.importorskip("safetensors")
    reference, path = _checkpoint(tmp_path)
    budget = int(_nbytes(reference) * 0.4)

    def load(model):
        return ot.load_safetensors(model, path, budget_gb=budget / GiB, device=device, policy={"offload": ["layers.*"]},
                                   threads=1, progress=False)

    module, attribute, error, after = _LOAD_STEPS[step]
    calls = _count_calls(module, attribute, lambda: load(_meta_model()))
    assert calls >= 2
    for k in range(calls):
        model = _meta_model()
        live_before = _ext.live_host_bytes()
        before = _snapshot(model)
        _fail_and_check(monkeypatch, _LOAD_STEPS[step], k, lambda: load(model), model, before, live_before)
    load(model)
    x = _inputs(device, 1)[0]
    with torch.no_grad():
        assert torch.equal(model(x), _on(device, reference)(x))


# ---------------------------------------------------------------------------- the budget on every path (item 5)


class _OffloadLayersAtFirst:
    """A callable policy that offloads every layer while ``forcing`` and has no opinion after: the
    wrap offloads all layers, so the warm cache holds copies well beyond one working set; a weight
    placed afterwards is kept resident when it fits beside the resident weights and a working set,
    which is room the cached copies hold until they are evicted."""

    def __init__(self):
        self.forcing = True

    def __call__(self, name):
        return "offload" if self.forcing and name.startswith("layers.") else None


def _warm_wrapped(device):
    reference = _reference()
    model = copy.deepcopy(reference)
    budget = int(_nbytes(reference) * 0.7)
    policy = _OffloadLayersAtFirst()
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy=policy, prefetch=False)
    with torch.no_grad():
        for x in _inputs(device, 2):
            model(x)
    s = ot.stats(model)
    assert s.cached_bytes >= 2 * HIDDEN * HIDDEN * 4  # more than one layer's weight is cached
    policy.forcing = False
    return reference, model, budget


def _agrees(model, reference, device):
    x = _inputs(device, 1)[0]
    with torch.no_grad():
        return torch.equal(model(x), _on(device, reference)(x))


def test_assigning_a_resident_weight_to_a_warm_model_stays_within_budget(device):
    """A new weight kept resident on a warm cache: on main it was counted beside the cached copies
    whose room it took (peak over the budget); now those copies go first."""
    _, model, budget = _warm_wrapped(device)
    model.register_parameter("extra", nn.Parameter(torch.randn(HIDDEN, HIDDEN).to(device)))
    assert not isinstance(model.extra, OffloadedTensor)
    assert ot.stats(model).peak_device_bytes <= budget


def test_load_state_dict_assign_on_a_warm_model_stays_within_budget(device):
    """load_state_dict(assign=True) of plain tensors on a warm cache: on main the new resident
    weights were counted while the old cached copies were still held."""
    reference, model, budget = _warm_wrapped(device)
    model.load_state_dict({k: v.clone().to(device) for k, v in reference.state_dict().items()}, assign=True)
    assert not isinstance(model.layers[0].weight, OffloadedTensor)  # kept: the case this is about
    assert ot.stats(model).peak_device_bytes <= budget
    assert _agrees(model, reference, device) and ot.stats(model).peak_device_bytes <= budget


def test_replacing_a_submodule_of_a_warm_model_stays_within_budget(device):
    """A submodule swapped in (its tensors placed) on a warm cache stays within the budget."""
    reference, model, budget = _warm_wrapped(device)
    fresh = nn.Linear(HIDDEN, HIDDEN).to(device)
    fresh.load_state_dict(reference.layers[1].state_dict())
    model.layers[1] = fresh
    assert not isinstance(model.layers[1].weight, OffloadedTensor)
    assert ot.stats(model).peak_device_bytes <= budget
    assert _agrees(model, reference, device) and ot.stats(model).peak_device_bytes <= budget


def test_deleting_then_assigning_on_a_warm_model_stays_within_budget(device):
    """``del`` of an offloaded weight still referenced elsewhere (an optimizer, a saved state dict:
    its master and cached copy live on), then a new weight in its place on a warm cache: on main
    the new resident bytes were counted beside the deleted weight's cached copy."""
    reference, model, budget = _warm_wrapped(device)
    layer = model.layers[2]
    kept_elsewhere = layer.weight  # noqa: F841 - what keeps the old master alive
    del layer.weight
    layer.weight = nn.Parameter(reference.layers[2].weight.detach().clone().to(device))
    assert not isinstance(layer.weight, OffloadedTensor)
    assert ot.stats(model).peak_device_bytes <= budget
    assert _agrees(model, reference, device) and ot.stats(model).peak_device_bytes <= budget


def test_concurrent_forwards_of_a_moe_model_with_routing_guesses_agree_within_budget(device):
    """Routed experts add state outside any op: the router hooks' guesses and their scores, and
    the expert cache's statistics. Two threads x 40 forwards of the reference DeepSeek at 40% of
    its weight bytes (its routed experts offloaded, guesses scored) agree with the unwrapped model."""
    from offtensor.models.deepseek import CONFIGS, DeepSeekForCausalLM, weight_bytes

    reference = DeepSeekForCausalLM.empty(CONFIGS["tiny"]).init_weights(seed=0).eval()
    model = copy.deepcopy(reference)
    budget = int(0.4 * weight_bytes(reference))
    ot.wrap_model(model, budget_gb=budget / GiB, device=device)
    assert any(isinstance(p, OffloadedTensor) and "experts" in n for n, p in model.named_parameters())
    ids = [torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(i)).to(device) for i in range(4)]
    plain = _on(device, reference)
    with torch.no_grad():
        want = [plain(x).cpu() for x in ids]
    mismatches = []

    def work(k):
        for i in range(40):
            j = (i + k) % len(ids)
            with torch.no_grad():
                if not torch.equal(model(ids[j]).cpu(), want[j]):
                    mismatches.append((k, i))

    assert _run_threads(work, 2) == []
    assert mismatches == []
    s = ot.stats(model)
    assert s.peak_device_bytes <= budget and s.experts is not None
