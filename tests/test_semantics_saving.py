"""OffloadedTensor semantics, the table's pickling and saving rows (docs/design.md, "The tensor and
its semantics"): pickle, ``torch.save`` and a weights-only load round trip values, types and
devices; tied weights are saved once by ``state_dict`` and safetensors; ``load_state_dict`` writes
through to an offloaded parameter."""

from __future__ import annotations

import io
import pickle
import zipfile

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor

from test_semantics import assert_same_values, host_values


# ------------------------------------------------------------------------------------------------
# pickling and saving
# ------------------------------------------------------------------------------------------------


def _storages_in_torch_save(buffer: io.BytesIO) -> list:
    """Byte size of every storage record in a torch.save archive."""
    archive = zipfile.ZipFile(buffer)
    return [info.file_size for info in archive.infolist() if "/data/" in info.filename and "/.data/" not in info.filename]


@pytest.mark.parametrize("weights_only", [True, False])
def test_pickle_torch_save_and_weights_only_load_round_trip(device, weights_only):
    reference = torch.randn(16, 8)
    x = ot.offload(reference, device=device)
    saved = {
        "weight": x,
        "rows": x[2:6],
        "transposed": x.t(),
        "parameter": nn.Parameter(x, requires_grad=False),
        "trainable": nn.Parameter(x[0]),
    }
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    # Five aliases of one master are stored as one storage of exactly the master's bytes.
    assert _storages_in_torch_save(buffer) == [x.host_nbytes]
    buffer.seek(0)
    with ot.safe_globals():  # weights_only rebuilds OffloadedTensors only where the user allows it
        loaded = torch.load(buffer, weights_only=weights_only)

    for name, original in saved.items():
        got = loaded[name]
        assert isinstance(got, OffloadedTensor), name
        assert got.device == x.device
        assert (got.shape, got.stride(), got.storage_offset()) == (original.shape, original.stride(), original.storage_offset())
        assert got.requires_grad == original.requires_grad
        assert isinstance(got, nn.Parameter) == isinstance(original, nn.Parameter)
        assert_same_values(host_values(got), original._host)
    # They come back as aliases of one (new) master: a write through one is seen by all.
    assert len({id(t._master) for t in loaded.values()}) == 1
    loaded["rows"].fill_(0)
    assert_same_values(host_values(loaded["weight"])[2:6], torch.zeros(4, 8))
    assert_same_values(host_values(loaded["transposed"])[:, 2:6], torch.zeros(8, 4))
    assert_same_values(host_values(x), reference)


def test_pickle_round_trip_keeps_values_types_and_device(device):
    # Plain pickle copies a storage per tensor (as it does for plain tensors); values, type and
    # device must still survive.
    reference = torch.randn(4, 3)
    x = ot.offload(reference, device=device)
    parameter = nn.Parameter(ot.offload(reference, device=device))
    loaded_x, loaded_param = pickle.loads(pickle.dumps((x.t(), parameter)))
    assert type(loaded_x) is OffloadedTensor and loaded_x.device == x.device
    assert loaded_x.stride() == x.t().stride()
    assert_same_values(host_values(loaded_x), reference.t())
    assert isinstance(loaded_param, nn.Parameter) and loaded_param.requires_grad
    assert_same_values(loaded_param.cpu(), reference)


def test_state_dict_of_a_model_with_offloaded_tied_weights_saves_them_once(device):
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32, bias=False))
    model[0].weight = nn.Parameter(ot.offload(model[0].weight.detach(), device=device), requires_grad=False)
    model[1].weight = model[0].weight
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert _storages_in_torch_save(buffer) == [model[0].weight.host_nbytes]
    buffer.seek(0)
    with ot.safe_globals():  # not a wrapped model: its state dict holds OffloadedTensors as they are
        loaded = torch.load(buffer, weights_only=True)
    assert loaded["0.weight"]._master is loaded["1.weight"]._master
    fresh = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32, bias=False))
    fresh.load_state_dict(loaded)
    tokens = torch.tensor([3, 31], device=device)
    assert_same_values(fresh.to(device)(tokens), model(tokens))


def test_safetensors_save_stores_tied_tensors_once(device, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model = nn.Sequential(nn.Embedding(12, 4), nn.Linear(4, 12, bias=False))
    model[0].weight = nn.Parameter(ot.offload(model[0].weight.detach(), device=device), requires_grad=False)
    model[1].weight = model[0].weight
    reference = model[0].weight._host.clone()
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_model(model, str(path))
    loaded = safetensors_torch.load_file(str(path))
    assert len(loaded) == 1  # the tie is detected through the host storage and stored once
    assert_same_values(next(iter(loaded.values())), reference)


def test_load_state_dict_writes_through_to_offloaded_parameter(device):
    module = nn.Linear(4, 3).to(device)
    parameter = nn.Parameter(ot.offload(module.weight.detach(), device=device), requires_grad=False)
    module.weight = parameter
    alias = parameter.t()
    new_weight, new_bias = torch.randn(3, 4), torch.randn(3)
    module.load_state_dict({"weight": new_weight, "bias": new_bias})
    assert module.weight is parameter  # identity kept, so ties and optimizer references survive
    assert_same_values(host_values(parameter), new_weight)
    assert_same_values(host_values(alias), new_weight.t())
    x = torch.randn(2, 4)
    assert_same_values(module(x.to(device)), F.linear(x, new_weight, new_bias))
