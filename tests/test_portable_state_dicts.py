"""Portable state dicts.

``torch.save(wrapped.state_dict())`` writes plain CPU tensors that a process without offtensor
loads with ``torch.load(weights_only=True)``, each tie stored once, values bit-identical, and
nothing is paged to make them; the state dict's values stay detached OffloadedTensor views of the
masters, so ``load_state_dict`` and in-place writes through them keep working. ``import offtensor``
widens nothing in torch's weights_only allow-list: saving an OffloadedTensor itself keeps its class,
and loading one with weights_only needs ``ot.safe_globals()`` (or ``ot.add_safe_globals()``).
"""

from __future__ import annotations

import copy
import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile

import torch
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor

GiB = 1 << 30


class Tied(nn.Module):
    def __init__(self, vocab=64, hidden=32, layers=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.full((hidden,), 0.5))

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = torch.tanh(layer(h)) * self.scale
        return self.head(self.norm(h))


def _weight_bytes(model) -> int:
    return sum({t.untyped_storage().data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}.values())


def _wrapped(device, fraction=0.4):
    torch.manual_seed(0)
    reference = Tied().eval()
    model = copy.deepcopy(reference)
    budget = int(_weight_bytes(reference) * fraction)
    ot.wrap_model(model, budget_gb=budget / GiB, device=device, policy={"offload": ["embed.weight", "layers.*"]})
    assert isinstance(model.embed.weight, OffloadedTensor) and model.head.weight is model.embed.weight
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        model(ids)  # a warm cache: the state dict must still come from the host masters
    return reference, model, ids


def _storages(buffer) -> list:
    archive = zipfile.ZipFile(buffer)
    return sorted(i.file_size for i in archive.infolist() if "/data/" in i.filename and "/.data/" not in i.filename)


def _run(code: str, cwd, with_offtensor: bool = False) -> dict:
    """Runs ``code`` in a fresh interpreter (it prints JSON). Without ``with_offtensor`` its sys.path
    cannot reach offtensor and the run fails if anything imported it."""
    script = "import sys, json\n"
    if with_offtensor:
        script += f"sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.abspath(ot.__file__)))!r})\n"
    script += textwrap.dedent(code)
    if not with_offtensor:
        script += "\nassert 'offtensor' not in sys.modules\n"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", script], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_saved_state_dict_loads_weights_only_in_a_process_without_offtensor(tmp_path, device):
    reference, model, _ = _wrapped(device)
    before = ot.stats(model)
    state = model.state_dict()
    assert isinstance(state["embed.weight"], OffloadedTensor)  # still views of the masters, as values go
    path = tmp_path / "state.pt"
    torch.save(state, path)
    after = ot.stats(model)
    assert (after.bytes_h2d, after.page_ins) == (before.bytes_h2d, before.page_ins)  # nothing paged to save
    # The tie is one storage in the file, and each offloaded master is stored once at its exact size.
    with open(path, "rb") as f:
        sizes = _storages(io.BytesIO(f.read()))
    distinct = {v.untyped_storage().data_ptr(): v for v in state.values()}
    assert len(sizes) == len(distinct)
    assert model.embed.weight.host_nbytes in sizes
    torch.save({k: v.cpu().clone() for k, v in reference.state_dict().items()}, tmp_path / "reference.pt")

    got = _run("""
        import torch
        state = torch.load("state.pt", weights_only=True, map_location="cpu")
        reference = torch.load("reference.pt", weights_only=True)
        print(json.dumps({
            "keys": sorted(state) == sorted(reference),
            "plain": sorted({type(v).__name__ for v in state.values()}),
            "tied": state["embed.weight"].untyped_storage().data_ptr() == state["head.weight"].untyped_storage().data_ptr(),
            "identical": all(state[k].dtype == v.dtype and state[k].shape == v.shape and state[k].stride() == v.stride()
                             and torch.equal(state[k].contiguous().view(torch.uint8), v.contiguous().view(torch.uint8))
                             for k, v in reference.items()),
            "devices": sorted({str(v.device) for v in state.values()}),
        }))
    """, tmp_path)
    assert got == {"keys": True, "plain": ["Tensor"], "tied": True, "identical": True, "devices": ["cpu"]}


def test_state_dict_values_stay_views_for_load_state_dict_and_in_place_writes(tmp_path, device):
    reference, model, ids = _wrapped(device)
    weight = model.layers[0].weight
    state = model.state_dict()
    # keep_vars=True gives the Parameters themselves, as torch does.
    assert model.state_dict(keep_vars=True)["layers.0.weight"] is weight
    # An in-place write through a state dict value reaches the master and drops the cached copy.
    with torch.no_grad():
        state["layers.0.weight"].mul_(2)
        reference.layers[0].weight.mul_(2)
        torch.testing.assert_close(model(ids), reference.to(device)(ids), rtol=0, atol=0)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert type(loaded["layers.0.weight"]) is torch.Tensor
    assert torch.equal(loaded["layers.0.weight"], reference.layers[0].weight.detach().cpu())
    # Loading the plain file back into the wrapped model writes through; identities and the tie stay.
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    params = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    model.load_state_dict(loaded)
    assert {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)} == params
    assert model.head.weight is model.embed.weight and isinstance(model.embed.weight, OffloadedTensor)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference.to(device)(ids), rtol=0, atol=0)


def test_submodules_modules_attached_later_and_deepcopies_save_plain_tensors(device):
    _, model, ids = _wrapped(device)
    model.layers[2] = nn.Linear(32, 32)  # attached after wrapping: offloaded by the policy ("layers.*"), hooked
    assert isinstance(model.layers[2].weight, OffloadedTensor)
    copied = copy.deepcopy(model)
    with torch.no_grad():
        copied(ids)  # the copy is adopted as a wrapped model on its first use
    for state in (model.layers[1].state_dict(), model.layers[2].state_dict(), model.state_dict(), copied.state_dict()):
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=True)  # no opt-in: nothing offtensor is in the file
        assert all(type(v) is torch.Tensor for v in loaded.values())
        for k, v in state.items():
            assert torch.equal(loaded[k], v.cpu())
    # The copy carries one state_dict hook per module, not the original's plus its own.
    def hooks(module):
        return [h for h in module._state_dict_hooks.values() if getattr(h, "__name__", "") == "portable_state_dict"]

    assert len(hooks(copied.layers[0])) == 1
    ot.unwrap_model(model)
    assert not hooks(model.embed) and not hooks(model.layers[2])


def test_import_widens_no_weights_only_allow_list_and_safe_globals_opts_in(tmp_path, device):
    got = _run(f"""
        import io, pickle, torch
        import offtensor as ot
        from offtensor.tensor import _rebuild_offloaded
        widened = _rebuild_offloaded in torch.serialization.get_safe_globals()
        x = ot.offload(torch.arange(6.0).view(2, 3), device={device!r})
        buffer = io.BytesIO()
        torch.save({{"x": x, "t": x.t()}}, buffer)
        try:
            buffer.seek(0)
            torch.load(buffer, weights_only=True)
            refused = ""
        except pickle.UnpicklingError as e:
            refused = str(e)
        buffer.seek(0)
        with ot.safe_globals():
            loaded = torch.load(buffer, weights_only=True)
        after_context = _rebuild_offloaded in torch.serialization.get_safe_globals()
        ot.add_safe_globals()
        buffer.seek(0)
        again = torch.load(buffer, weights_only=True)
        print(json.dumps({{
            "widened_by_import": widened,
            "refused_without_opt_in": "_rebuild_offloaded" in refused,
            "class_kept": type(loaded["x"]).__name__,
            "aliases": loaded["x"]._master is loaded["t"]._master,
            "values": torch.equal(loaded["t"].cpu(), torch.arange(6.0).view(2, 3).t()),
            "widened_after_context": after_context,
            "process_wide_opt_in": type(again["x"]).__name__,
        }}))
    """, tmp_path, with_offtensor=True)
    assert got == {"widened_by_import": False, "refused_without_opt_in": True, "class_kept": "OffloadedTensor",
                   "aliases": True, "values": True, "widened_after_context": False,
                   "process_wide_opt_in": "OffloadedTensor"}
