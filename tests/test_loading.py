"""ot.load_safetensors: a meta-built model filled from safetensors files (one file, a directory of
shards, an index), placed for a budget, and refused with a clear error when the checkpoint does
not match, before the model is changed."""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

import offtensor as ot

safetensors_torch = pytest.importorskip("safetensors.torch")


class TinyLM(nn.Module):
    def __init__(self, vocab=256, hidden=32, layers=3, tie=True):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)) for _ in range(layers)
        )
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + self.scale * block(h)
        return self.lm_head(self.norm(h))


def _weight_bytes(model):
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


@pytest.fixture
def reference():
    torch.manual_seed(0)
    return TinyLM().eval()


def _meta_model():
    with torch.device("meta"):
        return TinyLM().eval()


def _save_sharded(model, root, shards=2):
    """Write the state dict as ``shards`` files plus a transformers-style index; tied names once."""
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        part = {n: state[n] for n in names[i::shards]}
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        safetensors_torch.save_file(part, os.path.join(root, file))
        weight_map.update({n: file for n in part})
    index = os.path.join(root, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return index


def test_meta_model_loads_from_one_file_and_matches_the_reference(tmp_path, reference, device):
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_model(reference, str(file))
    model = _meta_model()
    budget = 0.4 * _weight_bytes(reference) / 2**30
    ot.load_safetensors(model, file, budget_gb=budget, device=device)
    assert model.lm_head.weight is model.embed.weight
    assert any(isinstance(p, ot.OffloadedTensor) for p in model.parameters())
    ids = torch.randint(0, 256, (2, 7))
    with torch.no_grad():
        want = reference.to(device)(ids.to(device))
        got = model(ids.to(device))
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes


@pytest.mark.parametrize("form", ["index", "directory"])
def test_sharded_checkpoint_loads_from_an_index_or_its_directory(tmp_path, reference, device, form):
    index = _save_sharded(reference, tmp_path)
    model = _meta_model()
    ot.load_safetensors(model, index if form == "index" else tmp_path, budget_gb=0.4 * _weight_bytes(reference) / 2**30,
                        device=device)
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to(device)), reference.to(device)(ids.to(device)), rtol=0, atol=0)


def test_offloaded_weights_are_read_into_host_masters_without_paging(tmp_path, reference, device):
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_model(reference, str(file))
    model = ot.load_safetensors(_meta_model(), file, budget_gb=0.4 * _weight_bytes(reference) / 2**30, device=device)
    s = ot.stats(model)
    assert s.bytes_h2d == 0 and s.page_ins == 0
    assert s.offloaded_bytes > 0
    assert s.resident_bytes + s.offloaded_bytes == _weight_bytes(reference)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        ot.load_safetensors(_meta_model(), tmp_path / "does-not-exist.safetensors", budget_gb=1, device="cpu")


def test_index_naming_a_missing_shard_is_refused(tmp_path, reference):
    index = _save_sharded(reference, tmp_path)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        ot.load_safetensors(_meta_model(), index, budget_gb=1, device="cpu")


def test_wrong_dtype_is_refused_before_the_model_changes(tmp_path, reference):
    state = {k: v.to(torch.float16) if k == "blocks.0.0.weight" else v for k, v in reference.state_dict().items()
             if k != "lm_head.weight"}
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(file))
    model = _meta_model()
    with pytest.raises(ValueError, match=r"blocks\.0\.0\.weight.*F16.*torch\.float32.*bytes"):
        ot.load_safetensors(model, file, budget_gb=1, device="cpu")
    assert all(p.is_meta for p in model.parameters())


def test_wrong_shape_missing_and_unexpected_tensors_are_all_reported(tmp_path, reference):
    state = {k: v for k, v in reference.state_dict().items() if k not in ("lm_head.weight", "norm.bias")}
    state["blocks.1.2.weight"] = torch.zeros(3, 3)
    state["not.in.the.model"] = torch.zeros(2)
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(file))
    with pytest.raises(ValueError) as info:
        ot.load_safetensors(_meta_model(), file, budget_gb=1, device="cpu")
    message = str(info.value)
    assert "blocks.1.2.weight" in message and "(3, 3)" in message
    assert "norm.bias" in message
    assert "not.in.the.model" in message


def test_unexpected_tensors_are_ignored_when_not_strict(tmp_path, reference, device):
    state = {k: v for k, v in reference.state_dict().items() if k != "lm_head.weight"}
    state["extra.rotary_cache"] = torch.zeros(4)
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_file(state, str(file))
    model = ot.load_safetensors(_meta_model(), file, budget_gb=1, device=device, strict=False)
    ids = torch.randint(0, 256, (1, 4))
    with torch.no_grad():
        torch.testing.assert_close(model(ids.to(device)), reference.to(device)(ids.to(device)), rtol=0, atol=0)


def test_loading_into_an_already_wrapped_model_is_refused(tmp_path, reference):
    file = tmp_path / "model.safetensors"
    safetensors_torch.save_model(reference, str(file))
    model = copy.deepcopy(reference)
    ot.wrap_model(model, budget_gb=1, device="cpu")
    with pytest.raises(RuntimeError, match="already wrapped"):
        ot.load_safetensors(model, file, budget_gb=1, device="cpu")
