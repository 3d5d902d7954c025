"""The fast load path: safetensors headers parsed and checked by offtensor, bytes read straight into
unfaulted host masters (or through the staging buffers), corrupt and mismatching files refused with
the file and the tensor named and the model untouched, progress reporting, and ot.from_pretrained on
tiny transformers checkpoints saved by save_pretrained."""

from __future__ import annotations

import json
import os
import sys
import threading

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import _ext
from offtensor import safetensors_files as loading_files
from offtensor.loading import read as loading_read
from offtensor.model.copies import is_wrapped

safetensors_torch = pytest.importorskip("safetensors.torch")

GiB = 1 << 30


class Net(nn.Module):
    def __init__(self, hidden=48, layers=3, vocab=96):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def _bytes(model) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in model.state_dict().values()}.values())


@pytest.fixture
def reference():
    torch.manual_seed(0)
    return Net().eval()


def _meta():
    with torch.device("meta"):
        return Net().eval()


def _unchanged(model) -> bool:
    return all(p.is_meta and not isinstance(p, ot.OffloadedTensor) for p in model.parameters()) \
        and not is_wrapped(model)


def _check_same(model, reference, device):
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to(device)), reference.to(device)(ids.to(device)), rtol=0, atol=0)


def _corrupt(path, mutate):
    """Rewrite the header of a safetensors file through ``mutate(header dict)`` (data untouched)."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    mutate(header)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw + data)


# ---------------------------------------------------------------------------- the read paths


@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_chunked_threaded_reads_fill_masters_and_device_weights_exactly(tmp_path, reference, device, monkeypatch, staged):
    # Tiny chunks: every tensor spans several reads on several threads, and two staging slots are
    # reused many times, so a slot refilled before its copy finished would corrupt the values.
    monkeypatch.setattr(loading_read, "CHUNK_BYTES", 4096)
    if staged:
        monkeypatch.setattr(loading_read, "_stages_resident", lambda device: True)
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_model(reference, str(file))
    model = ot.load_safetensors(_meta(), file, budget_gb=0.5 * _bytes(reference) / GiB, device=device, threads=3)
    s = ot.stats(model)
    assert s.offloaded_bytes > 0 and s.resident_bytes > 0
    assert s.bytes_h2d == 0
    _check_same(model, reference, device)


def test_masters_are_allocated_unfaulted_and_exact_size(tmp_path, reference, monkeypatch):
    calls = []
    real = _ext.alloc_host

    def spy(nbytes, *, pin, touch=True):
        calls.append((nbytes, touch))
        return real(nbytes, pin=pin, touch=touch)

    monkeypatch.setattr(_ext, "alloc_host", spy)
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_model(reference, str(file))
    model = ot.load_safetensors(_meta(), file, budget_gb=0.5 * _bytes(reference) / GiB, device="cpu")
    offloaded = [p for p in model.parameters() if isinstance(p, ot.OffloadedTensor)]
    assert offloaded
    assert all(touch is False for _, touch in calls)
    sizes = sorted(n for n, _ in calls)
    for p in offloaded:
        assert p.host_nbytes == p.numel() * p.element_size()
        assert p.host_nbytes in sizes


def test_floating_tensors_of_another_dtype_are_converted_on_request(tmp_path, reference, device):
    state = {k: v.to(torch.bfloat16) for k, v in reference.state_dict().items()}
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(file))
    with pytest.raises(ot.CheckpointError, match=r"BF16"):
        ot.load_safetensors(_meta(), file, budget_gb=1, device=device)
    model = ot.load_safetensors(_meta(), file, budget_gb=0.5 * _bytes(reference) / GiB, device=device,
                                convert_dtypes=True)
    expected = Net().eval()
    expected.load_state_dict({k: v.float() for k, v in state.items()})
    _check_same(model, expected, device)


# Every dtype safetensors.torch writes (its _TYPES and the sub-byte ones its Rust core adds).
SAFETENSORS_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz, torch.float8_e8m0fnu,
    torch.float4_e2m1fn_x2,
]


class Holder(nn.Module):
    """Weights of one dtype: a large one (offloaded), a small one (resident), a 0-d one and an empty one."""

    def __init__(self, dtype):
        super().__init__()
        for name, shape in (("big", (64, 32)), ("small", (5, 2)), ("scalar", ()), ("empty", (0, 4))):
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False))


def _random_bits(shape, dtype, generator):
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, tuple(shape) + (dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def _bits(t):
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("dtype", SAFETENSORS_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_safetensors_writes_loads_bit_for_bit_as_load_file_loads_it(tmp_path, device, dtype):
    generator = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        shapes = Holder(dtype)
    # A 0-d float4_e2m1fn_x2 is two 4-bit values under a shape of one: safetensors cannot write it.
    state = {name: _random_bits(p.shape, dtype, generator) for name, p in shapes.named_parameters()
             if p.dim() or dtype is not torch.float4_e2m1fn_x2}
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(file))
    expected = safetensors_torch.load_file(str(file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    for budget, offloaded in ((0.5 * total / GiB, True), (1.0, False)):  # big offloaded, then all resident
        with torch.device("meta"):
            model = Holder(dtype)
        if "scalar" not in state:
            del model.scalar
        ot.load_safetensors(model, file, budget_gb=budget, device=device)
        assert isinstance(model.big, ot.OffloadedTensor) is offloaded
        for name, p in model.named_parameters():
            want = expected[name]
            assert p.dtype == want.dtype and p.shape == want.shape, name
            copies = [p.cpu()] + ([p.materialize().cpu()] if isinstance(p, ot.OffloadedTensor) else [])
            for got in copies:
                assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), name


def test_alloc_host_without_touch_is_exact_zeroed_and_passes_opcheck():
    if not _ext.NATIVE:
        pytest.skip("the native extension is not built")
    t = _ext.alloc_host(3 * 4096 + 5, pin=False, touch=False)
    assert t.numel() == 3 * 4096 + 5 and t.data_ptr() % 4096 == 0
    assert int(t.sum()) == 0  # fresh anonymous memory reads as zeros
    torch.library.opcheck(torch.ops.offtensor.alloc_host.default, (8192, False, False))


def test_pin_host_pins_in_place_only_when_a_gpu_is_present():
    if not _ext.NATIVE:
        pytest.skip("the native extension is not built")
    t = _ext.alloc_host(2 << 20, pin=False, touch=False)
    t.fill_(7)
    pinned = _ext.pin_host(t)
    assert pinned == _ext.can_pin_after_fill()
    if pinned:
        assert t.is_pinned()
        assert _ext.pin_host(t)  # pinning twice is harmless
    assert int(t[123]) == 7
    del t  # freeing a late-pinned allocation unregisters it first
    numpy = pytest.importorskip("numpy")
    odd = torch.from_numpy(numpy.zeros(3 * 4096, dtype=numpy.uint8)[1:])  # its storage starts off a page boundary
    with pytest.raises(RuntimeError, match="page-aligned"):
        # Where it can pin, pin_host refuses before the extension; elsewhere the extension refuses.
        _ext.pin_host(odd) if pinned else torch.ops.offtensor.pin_host(odd)


# ---------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("damage, message", [
    ("short", r"too short for the 8-byte header"),
    ("header_length", r"says its header is \d+ bytes, but the file has \d+ bytes"),
    ("json", r"header of .* is not a safetensors JSON header"),
    ("offsets_past_end", r"'layers\.1\.weight' .* past the end of the file .* truncated"),
    ("offsets_size", r"'layers\.1\.weight' .* spans bytes .* needs \d+ bytes"),
    ("truncated", r"past the end of the file"),
])
def test_corrupt_or_truncated_file_is_refused_naming_file_and_tensor(tmp_path, reference, damage, message):
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_model(reference, str(file))
    size = os.path.getsize(file)
    if damage == "short":
        with open(file, "r+b") as f:
            f.truncate(5)
    elif damage == "header_length":
        with open(file, "r+b") as f:
            f.write((size * 3).to_bytes(8, "little"))
    elif damage == "json":
        with open(file, "r+b") as f:
            f.seek(8)
            f.write(b"{not json")
    elif damage == "offsets_past_end":
        _corrupt(file, lambda h: h["layers.1.weight"].update(data_offsets=[size, size + 48 * 48 * 4]))
    elif damage == "offsets_size":
        _corrupt(file, lambda h: h["layers.1.weight"].update(
            data_offsets=[h["layers.1.weight"]["data_offsets"][0], h["layers.1.weight"]["data_offsets"][1] - 4]))
    elif damage == "truncated":
        with open(file, "r+b") as f:
            f.truncate(size - 1000)
    model = _meta()
    with pytest.raises(ot.CheckpointError, match=message) as info:
        ot.load_safetensors(model, file, budget_gb=1, device="cpu")
    assert "model.safetensors" in str(info.value)
    assert _unchanged(model)


def test_file_truncated_while_loading_fails_and_leaves_the_model_unchanged(tmp_path, reference, monkeypatch):
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_model(reference, str(file))
    real = loading_read.open_unchanged

    def then_truncate(source):
        fd = real(source)  # the checks passed and the reader holds the file (a truncation before is
        with open(source.file, "r+b") as f:  # refused at the open); the bytes go away before they are read
            f.truncate(loading_files.read_header(source.file)["head.weight"].begin + 8)
        return fd

    monkeypatch.setattr(loading_read, "open_unchanged", then_truncate)
    model = _meta()
    with pytest.raises(ot.CheckpointError, match=r"reading '[\w.]+' in .*model\.safetensors.* bytes short") as info:
        ot.load_safetensors(model, file, budget_gb=1, device="cpu", threads=2)
    assert "truncated while loading" in str(info.value)
    assert _unchanged(model)


def test_missing_shard_names_the_shard_and_its_tensors(tmp_path, reference):
    state = reference.state_dict()
    names = sorted(state)
    files = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for file, keys in files.items():
        safetensors_torch.save_file({k: state[k] for k in keys}, str(tmp_path / file))
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {k: file for file, keys in files.items() for k in keys}}, f)
    os.remove(tmp_path / "b.safetensors")
    model = _meta()
    with pytest.raises(FileNotFoundError, match=r"b\.safetensors.*" + files["b.safetensors"][0].replace(".", r"\.")):
        ot.load_safetensors(model, tmp_path, budget_gb=1, device="cpu")
    assert _unchanged(model)


def test_shape_mismatch_names_file_tensor_and_bytes(tmp_path, reference):
    state = dict(reference.state_dict())
    state["layers.2.weight"] = torch.zeros(48, 40)
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(file))
    model = _meta()
    with pytest.raises(ot.CheckpointError, match=r"layers\.2\.weight: 'layers\.2\.weight' in .*model\.safetensors.* "
                                                r"shape \(48, 40\) \(7680 bytes\).*\(48, 48\) \(9216 bytes\)"):
        ot.load_safetensors(model, file, budget_gb=1, device="cpu")
    assert _unchanged(model)


# ---------------------------------------------------------------------------- progress


def test_progress_reports_bytes_and_rate_and_can_be_silenced(tmp_path, reference, capsys, monkeypatch):
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_model(reference, str(file))
    monkeypatch.setattr(loading_read, "PROGRESS_MIN_BYTES", 1)  # this small checkpoint counts as large
    ot.load_safetensors(_meta(), file, budget_gb=1, device="cpu")
    assert "GB/s" in capsys.readouterr().err
    monkeypatch.setenv("OFFTENSOR_PROGRESS", "0")
    ot.load_safetensors(_meta(), file, budget_gb=1, device="cpu")
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("OFFTENSOR_PROGRESS")
    ot.load_safetensors(_meta(), file, budget_gb=1, device="cpu", progress=False)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(loading_read, "PROGRESS_MIN_BYTES", 1 << 40)
    ot.load_safetensors(_meta(), file, budget_gb=1, device="cpu")
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------------------- from_pretrained

transformers = pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))
from test_transformers_models import _config  # noqa: E402  (the tiny configs sized for a 30% budget)


def _saved(name, root):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(name)).eval()
    # Several shards, each of a few tensors, written the way users get checkpoints.
    model.save_pretrained(root, max_shard_size="200KB")
    return model


def _weight_bytes(model) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}.values())


@pytest.mark.parametrize("name", ["llama_tied", "mixtral", "deepseek_v3"])
def test_from_pretrained_matches_transformers(tmp_path, device, name):
    reference = _saved(name, tmp_path)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    budget = 0.3 * _weight_bytes(reference) / GiB
    # grouped_mm, transformers' default MoE kernel, takes only bfloat16 on CUDA: convert while loading.
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else None
    model = ot.from_pretrained(tmp_path, budget_gb=budget, device=device, dtype=dtype, progress=False)
    # While wrapped, a module's class is a same-named subclass of its own (model/assignment.py).
    assert isinstance(model, type(reference)) and type(model).__name__ == type(reference).__name__
    assert type(model).__mro__[1] is type(reference) and not model.training
    assert ot.stats(model).offloaded_bytes > 0
    if name == "llama_tied":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    if name != "llama_tied":
        # The files hold one tensor per expert; the model holds them stacked in one master each.
        experts = [p for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
        assert experts and all(isinstance(p, ot.OffloadedTensor) for p in experts)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    expected_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype or torch.float32)
    expected_model = expected_model.eval().to(device)
    with torch.no_grad():
        expected = expected_model(input_ids=ids.to(device)).logits
        got = model(input_ids=ids.to(device)).logits
    assert torch.equal(got, expected)
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes


def test_from_pretrained_converts_dtype_on_request(tmp_path):
    _saved("llama_tied", tmp_path)
    model = ot.from_pretrained(tmp_path, budget_gb=1, device="cpu", dtype=torch.bfloat16, progress=False)
    expected_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, expected_model(input_ids=ids).logits)


def test_tensors_the_model_declares_ignorable_are_skipped(tmp_path, monkeypatch):
    reference = _saved("llama_tied", tmp_path)
    safetensors_torch.save_file({"model.layers.9.mtp.weight": torch.ones(3)}, str(tmp_path / "extra.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"]["model.layers.9.mtp.weight"] = "extra.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(ot.CheckpointError, match=r"model\.layers\.9\.mtp\.weight"):
        ot.from_pretrained(tmp_path, budget_gb=1, device="cpu", progress=False)
    monkeypatch.setattr(type(reference), "_keys_to_ignore_on_load_unexpected", [r"model\.layers\.9\..*"])
    model = ot.from_pretrained(tmp_path, budget_gb=1, device="cpu", progress=False)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    _saved("llama_tied", tmp_path)
    with torch.device("meta"):
        mixtral = transformers.AutoModelForCausalLM.from_config(_config("mixtral"))
    with pytest.raises(ot.CheckpointError, match=r"config\.json.*'llama'.*'mixtral'") as info:
        ot.load_safetensors(mixtral, tmp_path, budget_gb=1, device="cpu")
    assert "another architecture" in str(info.value)
    assert all(p.is_meta for p in mixtral.parameters())
    os.remove(tmp_path / "config.json")  # without a config, the names alone give it away
    with pytest.raises(ot.CheckpointError, match=r"another architecture"):
        ot.load_safetensors(mixtral, tmp_path, budget_gb=1, device="cpu")
    assert all(p.is_meta for p in mixtral.parameters())


def test_from_pretrained_without_transformers_says_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install transformers.*ot\.load_safetensors"):
        ot.from_pretrained(tmp_path, budget_gb=1, device="cpu")


# ---------------------------------------------------------------------------- no process-wide patches


def _registration_state():
    """What torch keeps process-wide about module registration: nn.Module's own methods and the
    global registration hooks."""
    from torch.nn.modules import module as module_mod

    hooks = (module_mod._global_parameter_registration_hooks, module_mod._global_buffer_registration_hooks,
             module_mod._global_module_registration_hooks)
    return dict(vars(nn.Module)), [dict(h) for h in hooks]


def _from_pretrained_calling(tmp_path, on_build, budget):
    """``load(key)``: from_pretrained into ``results[key]`` with a model class that calls
    ``on_build()`` while it is being built on meta."""
    llama = type(transformers.AutoModelForCausalLM.from_config(_config("llama_tied")))

    class Building(llama):
        def __init__(self, config):
            super().__init__(config)
            on_build()

    results = {}

    def load(key):
        results[key] = ot.from_pretrained(tmp_path, budget_gb=budget, device="cpu", progress=False,
                                          model_class=Building)

    return load, results


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_a_module_built_in_another_thread_during_from_pretrained_is_an_ordinary_cpu_module(tmp_path):
    reference = _saved("llama_tied", tmp_path)
    budget = 0.3 * _weight_bytes(reference) / GiB
    inside, built = threading.Event(), threading.Event()

    def on_build():
        inside.set()  # the meta build is running in the loading thread now
        assert built.wait(30)

    load, results = _from_pretrained_calling(tmp_path, on_build, budget)
    loader = threading.Thread(target=load, args=("model",))
    loader.start()
    assert inside.wait(30)
    other = nn.Linear(16, 16)  # built in this thread while the loader's model is being built on meta
    built.set()
    loader.join(60)
    assert other.weight.device.type == "cpu" and not other.weight.is_meta and not other.bias.is_meta
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(_logits(results["model"], ids), _logits(reference, ids))


def test_concurrent_from_pretrained_calls_both_load_and_leave_no_patch_behind(tmp_path):
    reference = _saved("llama_tied", tmp_path)
    budget = 0.3 * _weight_bytes(reference) / GiB
    before = _registration_state()
    # "a" starts building first and finishes first, while "b" is still building: the order in which
    # a save-and-restore patch of nn.Module is left in place for good.
    a_inside, b_inside, a_done = threading.Event(), threading.Event(), threading.Event()

    def on_build():
        if threading.current_thread().name == "a":
            a_inside.set()
            assert b_inside.wait(30)
        else:
            b_inside.set()
            assert a_done.wait(30)

    load, results = _from_pretrained_calling(tmp_path, on_build, budget)

    def load_a():
        try:
            load("a")
        finally:
            a_done.set()

    loader_a = threading.Thread(target=load_a, name="a")
    loader_b = threading.Thread(target=load, args=("b",), name="b")
    loader_a.start()
    assert a_inside.wait(30)
    loader_b.start()
    for t in (loader_a, loader_b):
        t.join(120)
    assert sorted(results) == ["a", "b"] and results["a"] is not results["b"]
    assert _registration_state() == before
    assert not nn.Linear(4, 4).weight.is_meta
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    expected = _logits(reference, ids)
    assert torch.equal(_logits(results["a"], ids), expected) and torch.equal(_logits(results["b"], ids), expected)
