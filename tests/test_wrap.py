"""wrap_model / unwrap_model on a small plain-PyTorch model with tied embeddings, dense MLPs and
stacked MoE experts: identities and ties, state dicts, post-load rewrites, writes that reach the host
master, safetensors round trips. The budget, policies and placement order, unwrap and error
messages, and stacked experts and prefetch are in test_wrap_<topic>.py beside it, on this model."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.pager import resolve_device
from offtensor.model.copies import is_wrapped, state_of

GiB = 1 << 30
VOCAB, HIDDEN, INTER, EXPERTS = 256, 128, 256, 4


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.k_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.v_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.o_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x):
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.up_proj = nn.Linear(HIDDEN, INTER, bias=False)
        self.down_proj = nn.Linear(INTER, HIDDEN, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """Stacked experts as transformers v5 stores them, run one routed expert at a time."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN) * 0.05)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER) * 0.05)

    def forward(self, x, expert_ids):
        out = torch.zeros_like(x)
        for e in expert_ids.unique().tolist():
            rows = (expert_ids == e).nonzero().squeeze(1)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            out[rows] = F.linear(F.silu(gate) * up, self.down_proj[e])
        return out


class MoE(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x):
        flat = x.reshape(-1, HIDDEN)
        return self.experts(flat, self.gate(flat).argmax(-1)).reshape(x.shape)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(HIDDEN)
        self.self_attn = Attention()
        self.post_attention_layernorm = nn.LayerNorm(HIDDEN)
        self.mlp = MLP()
        self.moe = MoE()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        h = self.post_attention_layernorm(x)
        return x + self.mlp(h) + self.moe(h)


class TinyLM(nn.Module):
    def __init__(self, layers: int = 2, tie: bool = True):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _model(seed: int = 0, **kwargs) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(**kwargs).eval()


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights, each storage (host master for offloaded ones) once."""
    seen = {}
    for t in list(model.parameters()) + list(model.buffers()):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _ids(device, seed: int = 1):
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed)).to(device)


def _offloaded_names(model: nn.Module) -> set:
    return {n for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor)}


def _tensors_by_name(model: nn.Module) -> dict:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def _budget_gb(model: nn.Module, fraction: float) -> float:
    return fraction * _weight_bytes(model) / GiB


def _run(model, ids):
    with torch.no_grad():
        return model(ids)


@pytest.fixture
def pair(device):
    """(wrapped at 40% of its weight bytes, unwrapped reference on the device)."""
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device)
    yield model, reference
    if is_wrapped(model):
        ot.unwrap_model(model)


# ---------------------------------------------------------------------------- identity and ties


def test_wrap_keeps_every_parameter_object_and_tied_weights_stay_the_same_object(device):
    model = _model()
    before = _tensors_by_name(model)
    # Offload the tied embedding so the tie has to survive becoming an OffloadedTensor.
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device, policy={"offload": ["embed_tokens.*"]})
    after = _tensors_by_name(model)
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert isinstance(model.embed_tokens.weight, ot.OffloadedTensor)
    assert isinstance(model.embed_tokens.weight, nn.Parameter)


def test_wrapped_model_gives_the_same_outputs(pair, device):
    model, reference = pair
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert _offloaded_names(model)


def test_state_dict_keys_and_values_unchanged_by_wrap(device):
    model = _model()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device)
    state = model.state_dict()
    assert list(state) == list(expected)
    for key, value in state.items():
        assert torch.equal(value.cpu(), expected[key]), key
    kept = model.state_dict(keep_vars=True)
    assert kept["lm_head.weight"] is kept["embed_tokens.weight"]


def test_tied_weights_stay_tied_after_load_state_dict(pair, device):
    model, reference = pair
    tied = model.embed_tokens.weight
    source = _model(seed=7)
    model.load_state_dict(source.state_dict())
    reference.load_state_dict(source.state_dict())
    assert model.embed_tokens.weight is tied and model.lm_head.weight is tied
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes


def test_load_state_dict_assign_true_places_the_new_tensors_under_the_budget(pair, device):
    model, reference = pair
    source = _model(seed=7)
    model.load_state_dict(source.state_dict(), assign=True)
    reference.load_state_dict({k: v.to(device) for k, v in source.state_dict().items()}, assign=True)
    s = ot.stats(model)
    for name, p in model.named_parameters():
        assert isinstance(p, ot.OffloadedTensor) or p.device == resolve_device(device), name
    assert s.resident_bytes <= s.budget_bytes
    assert s.resident_bytes + s.offloaded_bytes == _weight_bytes(model)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_load_state_dict_assign_true_keeps_a_tie_that_the_state_dict_shares(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.4), device=device, policy={"offload": ["embed_tokens.*"]})
    state = _model(seed=7).state_dict()
    assert state["lm_head.weight"].data_ptr() == state["embed_tokens.weight"].data_ptr()
    model.load_state_dict(state, assign=True)
    embed, head = model.embed_tokens.weight, model.lm_head.weight
    assert isinstance(embed, ot.OffloadedTensor) and isinstance(head, ot.OffloadedTensor)
    # Two Parameters (load_state_dict wraps each key in its own) over one host master, as plain
    # PyTorch leaves two Parameters over one storage.
    assert embed._master is head._master
    assert ot.stats(model).offloaded_bytes + ot.stats(model).resident_bytes == _weight_bytes(model)


@pytest.fixture
def swap_on_conversion():
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    yield
    torch.__future__.set_swap_module_params_on_conversion(before)


@pytest.mark.parametrize("assign", [True, False])
def test_load_state_dict_with_swap_tensors_places_what_it_swaps_in(device, swap_on_conversion, assign):
    # This mode swaps loaded values into the existing Parameters: no registration hook sees them.
    model = _model()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device)
    before = _tensors_by_name(model)
    state = _model(seed=7).state_dict()
    model.load_state_dict(state, assign=assign)
    reference.load_state_dict({k: v.to(device) for k, v in state.items()}, assign=assign)
    assert all(_tensors_by_name(model)[n] is t for n, t in before.items())
    assert model.lm_head.weight is model.embed_tokens.weight
    s = ot.stats(model)
    assert s.resident_bytes <= s.budget_bytes
    for name, t in _tensors_by_name(model).items():
        assert isinstance(t, ot.OffloadedTensor) or t.device == resolve_device(device), name
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_assigning_a_new_parameter_after_wrap_places_it_under_the_budget(pair, device):
    model, reference = pair
    s = ot.stats(model)
    new = nn.Parameter(torch.randn(HIDDEN, INTER) * 0.05)
    model.layers[1].mlp.down_proj.weight = new
    reference.layers[1].mlp.down_proj.weight = nn.Parameter(new.detach().to(device))
    placed = model.layers[1].mlp.down_proj.weight
    assert isinstance(placed, ot.OffloadedTensor) or placed.device == resolve_device(device)
    after = ot.stats(model)
    assert after.resident_bytes <= after.budget_bytes
    assert after.resident_bytes + after.offloaded_bytes == _weight_bytes(model)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


def test_a_new_parameter_too_big_to_keep_is_offloaded_not_left_plain(device):
    model = _model()
    ot.wrap_model(model, budget_gb=_budget_gb(model, 0.3), device=device)
    s = ot.stats(model)
    room = s.budget_bytes - s.resident_bytes
    # Too big to keep beside the room paging needs, small enough to be paged.
    rows = (room - state_of(model).working_set_bytes) // (HIDDEN * 4) + 1
    assert rows * HIDDEN * 4 <= room
    assert s.resident_bytes + rows * HIDDEN * 4 + state_of(model).working_set_bytes > s.budget_bytes
    model.extra = nn.Linear(HIDDEN, rows, bias=False)
    assert isinstance(model.extra.weight, ot.OffloadedTensor)
    model.layers[0].mlp.gate_proj.weight = nn.Parameter(torch.randn(INTER, HIDDEN))
    weight = model.layers[0].mlp.gate_proj.weight
    assert isinstance(weight, ot.OffloadedTensor) or weight.device == resolve_device(device)
    assert ot.stats(model).resident_bytes <= s.budget_bytes


def test_reassigning_the_tie_after_wrap_keeps_the_same_object(pair, device):
    model, reference = pair
    model.lm_head.weight = model.embed_tokens.weight
    assert model.lm_head.weight is model.embed_tokens.weight
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))


def test_a_submodule_assigned_after_wrap_has_its_tensors_placed(pair, device):
    model, reference = pair
    torch.manual_seed(3)
    fresh = MLP()
    reference.layers[0].mlp = copy.deepcopy(fresh).to(device)
    model.layers[0].mlp = fresh
    for name, p in model.layers[0].mlp.named_parameters():
        assert isinstance(p, ot.OffloadedTensor) or p.device == resolve_device(device), name
    s = ot.stats(model)
    assert s.resident_bytes + s.offloaded_bytes == _weight_bytes(model)
    ids = _ids(device)
    assert torch.equal(_run(model, ids), _run(reference, ids))
    assert ot.stats(model).peak_device_bytes <= s.budget_bytes


# ---------------------------------------------------------------------------- writes (weight loaders)


def test_param_data_copy_and_narrow_copy_reach_the_host_master(pair, device):
    model, reference = pair
    name = "layers.0.moe.experts.gate_up_proj"
    assert name in _offloaded_names(model)
    ids = _ids(device)
    _run(model, ids)  # fill the cache, so a stale copy would show
    for m in (model, reference):
        p = m.get_parameter(name)
        torch.manual_seed(5)
        p.data.copy_(torch.randn(p.shape))
        with torch.no_grad():  # as weight loaders run
            p.narrow(0, 1, 2).copy_(torch.full((2,) + tuple(p.shape[1:]), 0.01))
            m.get_parameter("embed_tokens.weight").narrow(0, 3, 4).copy_(torch.ones(4, HIDDEN))
    assert torch.equal(model.get_parameter(name).cpu(), reference.get_parameter(name).cpu())
    assert torch.equal(model.lm_head.weight.cpu(), reference.lm_head.weight.cpu())
    assert torch.equal(_run(model, ids), _run(reference, ids))


# ---------------------------------------------------------------------------- safetensors


def test_safetensors_save_and_load_model_on_a_wrapped_model_with_tied_weights(pair, device, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    model, reference = pair
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_model(model, path)
    unique = _weight_bytes(model)
    with safetensors_torch.safe_open(path, "pt") as f:
        keys = set(f.keys())
        loaded = {k: f.get_tensor(k) for k in keys}
    state_keys = set(model.state_dict())
    assert len(keys) == len(state_keys) - 1
    assert keys < state_keys and ({"embed_tokens.weight", "lm_head.weight"} & keys)
    assert sum(t.numel() * t.element_size() for t in loaded.values()) == unique
    assert unique <= os.path.getsize(path) < unique + 64 * 1024
    for key, value in loaded.items():
        assert torch.equal(value, reference.state_dict()[key].cpu()), key

    other = _model(seed=9)
    ot.wrap_model(other, budget_gb=_budget_gb(other, 0.4), device=device)
    tied = other.embed_tokens.weight
    missing, unexpected = safetensors_torch.load_model(other, path)
    assert not missing and not unexpected
    assert other.embed_tokens.weight is tied and other.lm_head.weight is tied
    ids = _ids(device)
    assert torch.equal(_run(other, ids), _run(reference, ids))
