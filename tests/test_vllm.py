"""vLLM-style models: Parameter subclasses, their methods and the attributes set on Parameters
(``weight_loader``, ``output_dim``...) survive wrap, re-placement and unwrap; loaders write the host
master without paging; and the vLLM-style DeepSeek model runs the seed's path end to end (build,
wrap at 30 % before loading, load through its loaders from a sharded checkpoint, post-process,
generate)."""

from __future__ import annotations

import dataclasses
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import offtensor as ot
from offtensor.models import vllm_deepseek as vd
from offtensor.models import vllm_layers as vl
from offtensor.models.deepseek import CONFIGS, DeepSeekConfig, weight_bytes

GiB = 1 << 30
ROWS, COLS, EXPERTS, INTER = 8, 16, 4, 6


# ------------------------------------------------------------------------------------ a toy vLLM layer


class ShardedWeight(nn.Parameter):
    """A Parameter subclass shaped like vLLM's ``ModelWeightParameter``: a constructor that demands a
    loader, state in ``__dict__`` read through properties, and load methods writing through ``self.data``."""

    def __new__(cls, data, **kwargs):
        return super().__new__(cls, data, requires_grad=False)

    def __init__(self, data, weight_loader, output_dim=0):
        self._weight_loader = weight_loader
        self._output_dim = output_dim

    @property
    def weight_loader(self):
        return self._weight_loader

    @property
    def output_dim(self):
        return self._output_dim

    def load_shard(self, loaded, shard_offset, shard_size):
        self.data.narrow(self.output_dim, shard_offset, shard_size).copy_(loaded)

    def load_whole(self, loaded):
        assert self.data.shape == loaded.shape
        self.data.copy_(loaded)


def _default_loader(param, loaded):
    param.data.copy_(loaded)


class ToyLayer(nn.Module):
    """A subclass weight, a plain Parameter with vLLM attributes, and a fused ``[E, 2I, H]`` expert stack."""

    def __init__(self, seed: int = 0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(shape, generator=generator)

        self.weight = ShardedWeight(randn(ROWS, COLS), weight_loader=self.weight_loader)
        # set_weight_attrs-style attributes, including values that compare equal but are distinct objects.
        self.weight.input_dim = 1
        self.weight.is_metadata = False
        self.weight.ignore_warning = True
        self.weight.packed_dim = None
        self.bias = nn.Parameter(randn(ROWS), requires_grad=False)
        self.bias.weight_loader = _default_loader
        self.bias.output_dim = 0
        self.w13_weight = nn.Parameter(randn(EXPERTS, 2 * INTER, COLS), requires_grad=False)
        self.w13_weight.weight_loader = self.expert_loader
        self.w13_weight.is_transposed = False

    def weight_loader(self, param, loaded, shard_id=None):
        if shard_id is None:
            param.load_whole(loaded)
        else:
            param.load_shard(loaded, shard_id * (ROWS // 2), ROWS // 2)

    def expert_loader(self, param, loaded, expert_id, shard_id):
        # vLLM's fused MoE layout: w1 (gate) in the first half of w13, w3 (up) in the second.
        start = 0 if shard_id == "w1" else INTER
        param[expert_id].narrow(0, start, INTER).copy_(loaded)

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        gate_up = torch.stack([F.linear(x, self.w13_weight[e]) for e in range(EXPERTS)])
        return y, gate_up


PARAMS = ("weight", "bias", "w13_weight")


def wrap_toy(layer, device, placement="offload"):
    nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
    # Room for every weight: the placement is the policy's choice, not the budget's.
    return ot.wrap_model(layer, budget_gb=2 * nbytes / GiB, device=device, policy={placement: ["*"]})


def snapshot(layer):
    """Each Parameter's object, class and attribute objects."""
    return {name: (getattr(layer, name), type(getattr(layer, name)), dict(getattr(layer, name).__dict__)) for name in PARAMS}


def assert_same_attribute_objects(param, expected: dict):
    own = {"_host", "_master", "_layout", "_is_param"}
    actual = {k: v for k, v in param.__dict__.items() if k not in own}
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert actual[key] is value, key


# ------------------------------------------------------------------------------------ item 1 and 2


@pytest.mark.parametrize("placement", ["offload", "keep"])
def test_parameter_subclass_keeps_class_methods_and_attributes_through_wrap_and_unwrap(device, placement):
    layer = ToyLayer()
    before = snapshot(layer)
    wrap_toy(layer, device, placement)
    for name, (obj, cls, attrs) in before.items():
        param = getattr(layer, name)
        assert param is obj, f"{name} lost its identity"
        assert isinstance(param, cls) and isinstance(param, nn.Parameter)
        assert isinstance(param, ot.OffloadedTensor) == (placement == "offload")
        assert param.device.type == torch.device(device).type
        assert_same_attribute_objects(param, attrs)
    weight = layer.weight
    assert weight.weight_loader == layer.weight_loader and weight.output_dim == 0  # properties read __dict__
    if placement == "offload":
        assert type(weight).__name__ == "OffloadedShardedWeight"
        assert type(layer.bias) is ot.OffloadedTensor  # a plain Parameter keeps today's class
        # One combined class per user class, not per Parameter.
        other = ToyLayer()
        wrap_toy(other, device)
        assert type(other.weight) is type(weight)

    with torch.no_grad():
        layer(torch.randn(3, COLS, device=device))  # memoizes paging state on the offloaded weights
    ot.unwrap_model(layer)
    for name, (obj, cls, attrs) in before.items():
        param = getattr(layer, name)
        assert param is obj and type(param) is cls
        assert not isinstance(param, ot.OffloadedTensor)
        # Nothing of the offloaded tensor stays behind in the user's __dict__.
        assert param.__dict__.keys() == attrs.keys()
        assert_same_attribute_objects(param, attrs)


def test_attributes_survive_a_second_wrap_after_unwrap(device):
    layer = ToyLayer()
    before = snapshot(layer)
    for _ in range(2):
        wrap_toy(layer, device)
        assert isinstance(layer.weight, ShardedWeight) and isinstance(layer.weight, ot.OffloadedTensor)
        ot.unwrap_model(layer)
    for name, (obj, cls, attrs) in before.items():
        assert getattr(layer, name) is obj and type(obj) is cls
        assert_same_attribute_objects(obj, attrs)


def test_parameter_that_cannot_be_swapped_in_place_is_replaced_keeping_class_and_attributes(device):
    layer = ToyLayer()
    before = snapshot(layer)
    # A weak reference makes torch.utils.swap_tensors refuse; wrap then registers a new object.
    keep_alive = weakref.ref(layer.weight)
    wrap_toy(layer, device)
    obj, cls, attrs = before["weight"]
    assert layer.weight is not obj and keep_alive() is obj
    assert isinstance(layer.weight, cls) and isinstance(layer.weight, ot.OffloadedTensor)
    assert_same_attribute_objects(layer.weight, attrs)
    ot.unwrap_model(layer)
    assert type(layer.weight) is cls
    assert_same_attribute_objects(layer.weight, attrs)


class RewrappingWeight(ShardedWeight):
    """A subclass with torch's default __torch_function__, which makes op results instances of the
    subclass (newer vLLM Parameter classes override __torch_function__ too)."""

    __torch_function__ = classmethod(torch.Tensor.__torch_function__.__func__)


def test_subclass_with_its_own_torch_function_computes_through_the_offloaded_weight(device):
    layer = ToyLayer()
    expected_weight = layer.weight.detach().clone()
    layer.weight = RewrappingWeight(layer.weight.detach().clone(), weight_loader=layer.weight_loader)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(4))
    wrap_toy(layer, device)
    assert isinstance(layer.weight, RewrappingWeight) and isinstance(layer.weight, ot.OffloadedTensor)
    with torch.no_grad():
        out = F.linear(x.to(device), layer.weight)
        doubled = layer.weight * 2
    # OffloadedTensor's __torch_function__ comes first: results are plain device tensors.
    assert type(out) is torch.Tensor and type(doubled) is torch.Tensor
    # The plain weight on the same device: a GPU's kernels need not round as the host's do.
    torch.testing.assert_close(out, F.linear(x.to(device), expected_weight.to(device)), rtol=0, atol=0)
    torch.testing.assert_close(doubled.cpu(), expected_weight * 2, rtol=0, atol=0)
    layer.weight.load_shard(torch.zeros(ROWS // 2, COLS), 0, ROWS // 2)
    assert not layer.weight.cpu()[: ROWS // 2].any()


def test_subclass_assigned_after_wrap_is_placed_keeping_class_and_attributes(device):
    layer = ToyLayer()
    wrap_toy(layer, device)
    loader = layer.weight_loader
    new = ShardedWeight(torch.randn(ROWS, COLS), weight_loader=loader, output_dim=1)
    new.input_dim = 0
    attrs = dict(new.__dict__)
    layer.weight = new  # a post-load rewrite: the registration hook places it
    assert layer.weight is new
    assert isinstance(new, ShardedWeight) and isinstance(new, ot.OffloadedTensor)
    assert_same_attribute_objects(new, attrs)
    assert new.output_dim == 1


def test_load_state_dict_assign_keeps_the_assigned_subclass_and_its_attributes(device):
    source = ToyLayer(seed=1)
    layer = ToyLayer()
    wrap_toy(layer, device)
    # keep_vars: the state dict holds source's Parameter objects, which assign=True registers as they are.
    state = source.state_dict(keep_vars=True)
    attrs = {name: dict(t.__dict__) for name, t in state.items()}
    layer.load_state_dict(state, assign=True)
    for name in PARAMS:
        param = getattr(layer, name)
        assert param is state[name] and isinstance(param, ot.OffloadedTensor) and isinstance(param, nn.Parameter)
        assert_same_attribute_objects(param, attrs[name])
    assert isinstance(layer.weight, ShardedWeight)


# ------------------------------------------------------------------------------------ item 3: loader writes


def _write(layer, form: str, values: torch.Tensor):
    """One of the writes vLLM's loaders make, with ``values`` (a CPU tensor from a checkpoint)."""
    if form == "data.copy_":
        layer.weight.data.copy_(values)
    elif form == "data.narrow.copy_":
        layer.weight.data.narrow(0, 2, 3).copy_(values[2:5])
    elif form == "expert.narrow.copy_":
        layer.w13_weight[2].narrow(0, INTER, INTER).copy_(values[:INTER, :COLS])
    elif form == "data[int] =":
        layer.weight.data[5] = values[5]
    elif form == "data[slice] =":
        layer.weight.data[1:3] = values[1:3]
    elif form == "data[tensor] =":
        layer.weight.data[torch.tensor([0, 6])] = values[[0, 6]]
    elif form == "subclass load method":
        layer.weight.load_shard(values[: ROWS // 2], ROWS // 2, ROWS // 2)
    elif form == "weight_loader attribute":
        layer.weight.weight_loader(layer.weight, values[ROWS // 2 :], 1)
        layer.w13_weight.weight_loader(layer.w13_weight, values[:INTER, :COLS], 3, "w1")
        layer.bias.weight_loader(layer.bias, values[:, 0])
    else:
        raise AssertionError(form)


WRITE_FORMS = [
    "data.copy_", "data.narrow.copy_", "expert.narrow.copy_", "data[int] =", "data[slice] =", "data[tensor] =",
    "subclass load method", "weight_loader attribute",
]


@pytest.mark.parametrize("form", WRITE_FORMS)
def test_loader_writes_reach_the_master_and_invalidate_cached_copies_without_paging(device, form):
    # Built twice rather than deep-copied: torch's Parameter.__deepcopy__ calls type(self)(data,
    # requires_grad), which a vLLM-style constructor refuses.
    layer = ToyLayer(seed=0).to(device)
    reference = ToyLayer(seed=0).to(device)
    wrap_toy(layer, device)
    x = torch.randn(3, COLS, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.no_grad():
        layer(x)  # every weight now has a cached device copy that a write must drop
    s = ot.stats(layer)
    assert s.cached_bytes > 0
    values = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))
    ot.reset_stats(layer)
    with torch.no_grad():
        _write(layer, form, values)
        _write(reference, form, values.to(device))
    s = ot.stats(layer)
    assert (s.bytes_h2d, s.page_ins, s.hits) == (0, 0, 0), f"{form} paged: {s}"
    for name in PARAMS:
        # The host master holds what the same write made of a plain tensor.
        assert torch.equal(getattr(layer, name).cpu(), getattr(reference, name).cpu()), name
    with torch.no_grad():
        for actual, expected in zip(layer(x), reference(x)):
            # A stale cached copy would give the old values here.
            torch.testing.assert_close(actual, expected, rtol=0, atol=0)


# ------------------------------------------------------------------------------------ item 5: the seed's path


def tiny_config(**overrides) -> DeepSeekConfig:
    return dataclasses.replace(CONFIGS["tiny"], **overrides)


def attribute_snapshot(model) -> dict:
    return {name: (p, type(p), dict(p.__dict__)) for name, p in model.named_parameters()}


@pytest.mark.parametrize(
    "q_lora_rank, dtype", [(0, torch.float32), (24, torch.float32), (24, torch.bfloat16)],
    ids=["q_proj", "fused_qkv_a", "fused_qkv_a-bf16-sigmoid"],
)
def test_vllm_deepseek_wrapped_before_loading_through_its_loaders_gives_unwrapped_tokens(
    device, tmp_path, q_lora_rank, dtype
):
    bf16 = dtype == torch.bfloat16
    config = tiny_config(q_lora_rank=q_lora_rank, dtype=dtype, scoring_func="sigmoid" if bf16 else "softmax",
                         norm_topk_prob=bf16)
    checkpoint = vd.random_checkpoint(config, seed=0)
    assert vd.write_sharded_checkpoint(checkpoint, tmp_path, shard_bytes=256 << 10) > 1
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1)).to(device)

    # The reference: built on the device, loaded the same way, never wrapped.
    with torch.device(device):
        reference = vd.DeepseekForCausalLM(config)
    reference.load_weights(vd.iterate_checkpoint(str(tmp_path)))
    reference.process_weights_after_loading()
    expected = reference.generate(ids, max_new_tokens=6)

    # As vLLM's cpu_offload_gb does: build (uninitialised, on the CPU), place for the budget, then load.
    model = vd.DeepseekForCausalLM(config)
    before = attribute_snapshot(model)
    budget = 0.3 * weight_bytes(model) / GiB
    ot.wrap_model(model, budget_gb=budget, device=device)
    offloaded = {name for name, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor)}
    assert any("experts.w13_weight" in name for name in offloaded)
    assert any(isinstance(model.get_parameter(name), vl.ModelWeightParameter) for name in offloaded)

    ot.reset_stats(model)
    loaded = model.load_weights(vd.iterate_checkpoint(str(tmp_path)))
    assert loaded == set(before)
    s = ot.stats(model)
    assert (s.bytes_h2d, s.page_ins) == (0, 0), f"loading paged weights to the device: {s}"

    model.process_weights_after_loading()
    tokens = model.generate(ids, max_new_tokens=6)
    assert torch.equal(tokens, expected)
    s = ot.stats(model)
    assert s.bytes_h2d > 0
    assert s.peak_device_bytes <= s.budget_bytes == int(budget * GiB)

    # Every weight the loaders filled is the same object, of its class, with the same attribute
    # objects; only o_proj's int8 weight and scale were replaced, by its dequantised Parameter.
    replaced = {name for name in before if ".o_proj." in name}
    for name, (obj, cls, attrs) in before.items():
        if name in replaced:
            continue
        param = model.get_parameter(name)
        assert param is obj and isinstance(param, cls), name
        assert isinstance(param, ot.OffloadedTensor) == (name in offloaded), name
        assert_same_attribute_objects(param, attrs)
    for layer in model.model.layers:
        o_proj = layer.self_attn.o_proj
        assert not hasattr(o_proj, "weight_scale") and o_proj.weight.dtype == config.dtype
        assert o_proj.weight.device.type == torch.device(device).type  # placed by the registration hook


def test_load_weights_names_a_checkpoint_tensor_it_cannot_place():
    model = vd.DeepseekForCausalLM(tiny_config())
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.bogus\.weight.*\(4, 4\).*64 bytes"):
        model.load_weights([("model.layers.0.self_attn.bogus.weight", torch.zeros(4, 4))])


def test_attribute_named_like_offloaded_bookkeeping_is_refused_before_anything_moves(device):
    layer = ToyLayer()
    layer.bias._master = "user value"
    with pytest.raises(ValueError, match=r"'bias' of shape \(8,\) \(32 bytes\).*_master.*rename"):
        wrap_toy(layer, device)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in layer.parameters())
    assert layer.bias._master == "user value"
