"""Flows users run on a wrapped model that broke, each against the same model unwrapped, bit for
bit (``torch.equal``), within the budget: a channels-last move of a model with 1x1
convolutions, ``torch.nn.utils.prune`` trained and removed, the error for a weight refused for
the room the model's largest op pages, a boolean row mask of an offloaded table, and the base
model peft's ``merge_and_unload`` returns from a wrapped PeftModel. Tiny models built offline."""

from __future__ import annotations

import contextlib
import copy
import gc

import pytest
import torch
from torch import nn

import offtensor as ot
from test_engines_clients import GiB, _ids, _llama, _logits, _weight_bytes, _within_budget


def _wrap(model: nn.Module, device, fraction=0.3, everything=False) -> None:
    """Wrapped at ``fraction`` of its bytes; ``everything``: every weight offloaded, so the
    budget is below the largest weight and ops run in tiles and slices."""
    policy = {"offload": ["*"]} if everything else None
    ot.wrap_model(model, budget_gb=fraction * _weight_bytes(model) / GiB, device=device, policy=policy)
    assert ot.stats(model).offloaded_bytes > 0


def _same_steps(model, reference, device, steps=2, optimizer=torch.optim.AdamW):
    """``steps`` optimizer steps of each model's trainable weights: equal losses at every step."""
    optimizers = [optimizer([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, reference)]
    for step in range(steps):
        ids, _ = _ids(device, length=8, seed=10 + step)
        losses = []
        for m, opt in zip((model, reference), optimizers):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses), (step, losses)


# ---------------------------------------------------------------------------- memory format


def test_a_channels_last_move_keeps_a_1x1_convolution_weight_channels_last_so_outputs_stay_bit_identical(device):
    """A 1x1 convolution weight in channels-last (strides (C, 1, C, C)) is also contiguous by
    ``is_contiguous()``, so its new host master got contiguous strides, (C, 1, 1, 1). A
    convolution reads its output's memory format off its weight's strides: the wrapped one
    returned a contiguous output where the unwrapped one returned a channels-last one, and the
    group norm after it summed in another order (a diffusers UNet moved to channels-last, as its
    docs advise, differed in the last bits). Masters keep a dense tensor's own strides now."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 32, 1), nn.GroupNorm(4, 32), nn.Conv2d(32, 8, 3)).eval()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device, 0.5, everything=True)
    for m in (model, reference):
        m.to(memory_format=torch.channels_last)
    assert model[0].weight.stride() == reference[0].weight.stride() == (8, 1, 8, 8)
    assert isinstance(model[0].weight, ot.OffloadedTensor)
    x = torch.randn(2, 8, 16, 16, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        assert model[0](x).stride() == reference[0](x).stride()
        assert torch.equal(model(x), reference(x))
    _within_budget(model)


def test_a_diffusers_unet_moved_to_channels_last_after_wrapping_gives_the_unwrapped_noise_prediction(device):
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    ).eval()
    reference = copy.deepcopy(unet).to(device)
    _wrap(unet, device, everything=True)
    for m in (unet, reference):
        m.to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 8, 8, generator=g).to(device), torch.randn(2, 7, 32, generator=g).to(device)
    timesteps = torch.tensor([10, 500], device=device)
    with torch.no_grad():
        assert torch.equal(unet(sample, timesteps, text).sample, reference(sample, timesteps, text).sample)
    _within_budget(unet)


@pytest.mark.parametrize("dims", [2, 3])
def test_depthwise_and_pointwise_convolutions_moved_to_channels_last_train_like_the_unwrapped_ones(dims, device):
    """A depthwise weight (C, 1, k, k) has a size-1 dim too: in channels-last its strides are
    (k*k, 1, k, 1), and its master kept contiguous ones. So do channels_last_3d weights."""
    conv, norm = (nn.Conv2d, nn.BatchNorm2d) if dims == 2 else (nn.Conv3d, nn.BatchNorm3d)
    memory_format = torch.channels_last if dims == 2 else torch.channels_last_3d
    torch.manual_seed(0)
    model = nn.Sequential(conv(4, 16, 1), norm(16), nn.GELU(), conv(16, 16, 3, padding=1, groups=16),
                          nn.GroupNorm(4, 16), conv(16, 8, 1), nn.GroupNorm(2, 8))
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device, 0.9, everything=True)  # room for every weight whole: no tiles
    for m in (model, reference):
        m.to(memory_format=memory_format)
    x = torch.randn(2, 4, *(6,) * dims, generator=torch.Generator().manual_seed(1)).to(device)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference)]
    for step in range(2):
        outputs = []
        for m, optimizer in zip((model, reference), optimizers):
            out = m(x)
            out.square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            outputs.append(out)
        assert torch.equal(*outputs), step
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.stride() == q.stride() and torch.equal(p, q), name
    _within_budget(model)


# ---------------------------------------------------------------------------- torch.nn.utils.prune


def test_torch_prune_on_a_wrapped_model_trains_like_the_unwrapped_one_and_prune_remove_keeps_it(device):
    """prune's forward pre-hook sets ``module.weight = weight_orig * weight_mask`` before every
    forward: with grad on, a tensor autograd computed (it cannot be offloaded), held as a plain
    attribute. It was counted as a resident weight, which left the budget short of the room its
    largest op pages, so pruning the next weight was refused (a BudgetError claiming 8192 bytes
    did not fit in 117024). Such a tensor is counted as activations are now."""
    import torch.nn.utils.prune as prune

    model = _llama()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    for m in (model, reference):
        attention = m.model.layers[0].self_attn
        for name in ("q_proj", "v_proj"):
            prune.l1_unstructured(getattr(attention, name), "weight", amount=0.3)
        mlp = m.model.layers[1].mlp
        prune.global_unstructured([(mlp.up_proj, "weight"), (mlp.down_proj, "weight")],
                                  pruning_method=prune.L1Unstructured, amount=0.2)
    _same_steps(model, reference, device, optimizer=torch.optim.SGD)
    for m in (model, reference):
        for name in ("q_proj", "v_proj"):
            prune.remove(getattr(m.model.layers[0].self_attn, name), "weight")
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _within_budget(model)


def test_a_weight_refused_for_the_room_the_largest_op_needs_says_so(device):
    """Where a weight assigned after wrapping would fit the free room by itself but not beside
    the bytes the model's largest op pages at once, the BudgetError named only the weight's own
    need (256 bytes) and a larger free room, which read as a contradiction. It names the largest
    op's bytes too now."""
    model = _llama()
    _wrap(model, device)
    s = ot.stats(model)
    model.model.layers[0].scratch = torch.zeros(3000, device=device)  # a small attribute, counted as resident
    with pytest.raises(ot.BudgetError, match=r"needs \d+ bytes .*the room must still hold the \d+ bytes the model's "
                                             r"largest op pages, but only \d+ of the budget's"):
        model.model.layers[1].mlp.extra = nn.Parameter(torch.randn(64, 64, device=device))
    assert ot.stats(model).resident_bytes == s.resident_bytes + 12000


# ---------------------------------------------------------------------------- boolean masks


def test_a_boolean_row_mask_of_an_offloaded_table_larger_than_the_room_pages_only_the_rows_it_selects(device):
    """Textual inversion keeps a copy of the embedding table and, after every step, puts back the
    rows it does not train: ``weight[keep] = orig[keep]``. ``orig[keep]``, a boolean mask over
    dim 0 of an offloaded table larger than the room, paged the whole table and raised
    BudgetError; integer indices paged only their rows. A mask now selects its rows as they do."""
    model = _llama(vocab=512)
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=0.06 * _weight_bytes(model) / GiB, device=device)
    table, expected_table = model.model.embed_tokens.weight, reference.model.embed_tokens.weight
    assert isinstance(table, ot.OffloadedTensor) and table.nbytes > ot.stats(model).budget_bytes
    keep = torch.ones(512, dtype=torch.bool, device=device)
    keep[500:] = False
    with torch.no_grad():
        assert torch.equal(table[keep], expected_table[keep])
        for weight in (table, expected_table):
            original = weight.detach().clone()
            weight.add_(1.0)  # a step that moved every row
            weight[keep] = original[keep]
    assert torch.equal(table, expected_table)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _within_budget(model)


# ---------------------------------------------------------------------------- peft's merge_and_unload


def test_the_base_model_merge_and_unload_returns_from_a_wrapped_peft_model_is_counted_unwrapped_and_wrapped_again(device):
    """A wrapped PeftModel's ``merge_and_unload()`` returns its base model, whose weights stay
    offloaded on the PeftModel's pager. While the PeftModel lived, ``ot.stats(base)`` said "not
    wrapped; call ot.wrap_model first" and ``ot.wrap_model(base)`` said it was a module of a
    wrapped PeftModel; once the caller dropped the PeftModel, stats and unwrap still said "not
    wrapped" and wrap said "already wrapped; call ot.unwrap_model": the model ran offloaded, but
    could be neither counted nor given back. Now the first error names the PeftModel, and the base
    model takes the dropped PeftModel's wrap over: counted, unwrapped and wrapped again."""
    peft = pytest.importorskip("peft")
    model, reference = _llama(), _llama()
    config = dict(r=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(1)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(**config))
    torch.manual_seed(1)
    reference = peft.get_peft_model(reference.to(device), peft.LoraConfig(**config)).merge_and_unload()
    _wrap(peft_model, device, everything=True)
    merged = peft_model.merge_and_unload()
    with pytest.raises(ValueError, match="is a module of a wrapped PeftModel .* pass that PeftModel instead"):
        ot.stats(merged)
    del peft_model
    gc.collect()
    ids, _ = _ids(device)
    with torch.no_grad():
        assert torch.equal(merged.generate(ids, max_new_tokens=4, do_sample=False),
                           reference.generate(ids, max_new_tokens=4, do_sample=False))
    assert ot.stats(merged).offloaded_bytes == _weight_bytes(merged)
    _within_budget(merged)
    ot.unwrap_model(merged)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in merged.parameters())
    assert torch.equal(_logits(merged, device), _logits(reference, device))
    _wrap(merged, device)
    assert torch.equal(_logits(merged, device), _logits(reference, device))
    _within_budget(merged)


def test_stats_of_a_peft_model_made_around_a_wrapped_base_model_names_the_base_model_to_pass(device):
    """``get_peft_model`` of a wrapped model makes a PeftModel around it; ``ot.stats`` and
    ``ot.unwrap_model`` of the PeftModel said "not wrapped; call ot.wrap_model first", while
    ``ot.wrap_model`` of it is refused, as the base model is wrapped. They name the base model now."""
    peft = pytest.importorskip("peft")
    model = _llama()
    _wrap(model, device)
    peft_model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    for call in (ot.stats, ot.unwrap_model):
        with pytest.raises(ValueError, match=r"this PeftModel is not wrapped, but its LlamaForCausalLM 'base_model.model' "
                                             r"is .*pass model.get_submodule\('base_model.model'\) instead"):
            call(peft_model)
    assert ot.stats(peft_model.get_submodule("base_model.model")).offloaded_bytes > 0


# ---------------------------------------------------------------------------- accelerate's loaders


@pytest.mark.parametrize("call", ["load_checkpoint_in_model", "load_checkpoint_and_dispatch"])
def test_a_checkpoint_loaded_into_a_wrapped_model_by_accelerate_with_a_device_map_stays_offloaded(call, tmp_path, device):
    """With a device map, accelerate loads each key with ``set_module_tensor_to_device``, which
    re-creates the parameter as ``type(p)(value)`` and writes it into ``module._parameters`` itself,
    past the wrapping class: every offloaded weight became a plain resident Parameter, the resident
    bytes 3.3 times the budget, and nothing said so. The values now go into the host masters, as
    ``load_state_dict`` puts them, and the same Parameter objects stay offloaded."""
    accelerate = pytest.importorskip("accelerate")
    reference = _llama().to(device)
    reference.save_pretrained(tmp_path)
    model = _llama()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    _wrap(model, device)
    before = ot.stats(model)
    offloaded = {n: p for n, p in model.named_parameters() if isinstance(p, ot.OffloadedTensor)}
    loaded = getattr(accelerate, call)(model, str(tmp_path), device_map={"": device})
    model = loaded if loaded is not None else model
    after = ot.stats(model)
    assert (after.offloaded_bytes, after.resident_bytes) == (before.offloaded_bytes, before.resident_bytes)
    assert all(model.get_parameter(name) is p for name, p in offloaded.items())  # (resident ones are new, as unwrapped)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _within_budget(model)


def test_accelerate_loading_another_dtype_into_an_offloaded_weight_is_refused_naming_it(tmp_path, device):
    accelerate = pytest.importorskip("accelerate")
    _llama().save_pretrained(tmp_path)
    model = _llama()
    _wrap(model, device, everything=True)
    with pytest.raises(RuntimeError, match=r"set_module_tensor_to_device would replace '[\w.]+' \(\d+ bytes, "
                                           r"torch.float32, offloaded .*torch.bfloat16 .*This weight was not changed"):
        accelerate.load_checkpoint_in_model(model, str(tmp_path), device_map={"": device}, dtype=torch.bfloat16)
    assert all(isinstance(p, ot.OffloadedTensor) for p in model.parameters())


# ---------------------------------------------------------------------------- writes under fullgraph=True


def test_a_write_to_an_offloaded_weight_under_fullgraph_compile_says_it_cannot_run_eagerly_and_names_the_weight(device):
    """An in-place op on an offloaded weight breaks the graph and runs eagerly, but under
    ``fullgraph=True`` the break is an error, which said "it runs eagerly" and named no weight.
    (``copy_`` into it is traced: the next test.)"""
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    _wrap(model, device, everything=True)
    step = torch.compile(lambda p, v: p.mul_(0.5).add_(v), fullgraph=True, backend="eager")
    with torch.no_grad(), pytest.raises(torch._dynamo.exc.Unsupported,
                                        match=r"aten.mul_.Tensor on an OffloadedTensor of '0.weight' .*\(24576 bytes\) "
                                              r"cannot be traced, and this graph may not break .*cannot run eagerly either"):
        step(model[0].weight, torch.ones(96, 64, device=device))


def _leaves(t: torch.Tensor) -> list:
    """A tensor's values as plain tensors: a torchao optimizer state's quantised leaves (codes,
    scales), an offloaded weight read through its pager."""
    if isinstance(t, ot.OffloadedTensor) or not hasattr(t, "__tensor_flatten__"):
        return [t.detach().cpu()]
    return [leaf for name in t.__tensor_flatten__()[0] for leaf in _leaves(getattr(t, name))]


@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_torchao_low_bit_adamw_steps_offloaded_weights_as_it_steps_the_unwrapped_model(name, device):
    """torchao's low-bit AdamW compiles each parameter's step with ``fullgraph=True`` and ends it
    with ``p.copy_(new_value)``: that write into an offloaded weight could not be traced, so the
    step was refused. It is traced now (``offtensor::write``, ops/compiled_writes.py). Every tensor
    is offloaded: the weights (32 KiB each, quantised states) are larger than the room, so the graph
    pages them in slices; the biases (plain states) fit and are cached by each forward, so the step
    has to drop those copies for the next forward to read the new values. Three steps give the
    unwrapped model's losses, parameters and optimizer states bit for bit, within the budget."""
    optim = pytest.importorskip("torchao.optim")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device, everything=True)
    s = ot.stats(model)
    assert s.resident_bytes == 0 and s.budget_bytes < model[0].weight.numel() * 4 and s.budget_bytes > 512
    optimizers = [getattr(optim, name)(m.parameters(), lr=1e-2) for m in (model, reference)]
    for step in range(3):
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step)).to(device)
        losses = []
        for m, opt in zip((model, reference), optimizers):
            loss = m(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(*losses), (step, losses)
    for (label, p), q in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p, ot.OffloadedTensor) and torch.equal(p.detach().cpu(), q.detach().cpu()), label
        states = [opt.state[t] for opt, t in zip(optimizers, (p, q))]
        assert sorted(states[0]) == sorted(states[1]) == ["exp_avg", "exp_avg_sq", "step"]
        for key in states[0]:
            ours, theirs = _leaves(states[0][key]), _leaves(states[1][key])
            assert len(ours) == len(theirs) and all(map(torch.equal, ours, theirs)), (label, key)
    assert type(optimizers[0].state[model[0].weight]["exp_avg"]) is type(optimizers[1].state[reference[0].weight]["exp_avg"])
    s = ot.stats(model)
    assert s.bytes_h2d > 0 and s.peak_device_bytes <= s.budget_bytes, s


# ---------------------------------------------------------------------------- layers inserted


def test_layers_inserted_into_a_wrapped_model_with_insert_are_placed_as_appended_ones_are(device):
    """``ModuleList.insert`` (and ``Sequential.insert``) write the ``_modules`` table themselves,
    past ``add_module``: two decoder layers inserted into a wrapped Llama (depth up-scaling) stayed
    plain resident tensors, 3.3 times the budget, leaving no room to page, unsaid; what was assigned
    into them later was not placed. Their tensors are placed now, as an appended layer's are, and
    they join the wrapped model."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = _llama()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    for m in (model, reference):
        for seed in (7, 8):
            torch.manual_seed(seed)
            m.model.layers.insert(1, LlamaDecoderLayer(m.config, layer_idx=1).to(device).eval())
        for i, layer in enumerate(m.model.layers):
            layer.self_attn.layer_idx = i
        m.config.num_hidden_layers = len(m.model.layers)
    s = ot.stats(model)
    assert s.resident_bytes <= s.budget_bytes and isinstance(model.model.layers[1].mlp.down_proj.weight, ot.OffloadedTensor)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    model.model.layers[2].mlp.extra = nn.Parameter(torch.randn(256, 128, device=device))  # larger than the room
    assert isinstance(model.model.layers[2].mlp.extra, ot.OffloadedTensor)
    _within_budget(model)
    # An insert torch refuses (an index out of range) leaves the layer and the model as they were.
    container = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 64))
    _wrap(container, device, 0.5, everything=True)
    layer, s = nn.Linear(64, 64).to(device), ot.stats(container)
    weight = layer.weight
    with pytest.raises(IndexError, match="Index out of range"):
        container.insert(9, layer)
    assert type(layer) is nn.Linear and layer.weight is weight and type(weight) is nn.Parameter
    assert len(container) == 3 and ot.stats(container).offloaded_bytes == s.offloaded_bytes


# ---------------------------------------------------------------------------- ot.on_host


@pytest.mark.parametrize("tied", [False, True])
def test_resize_token_embeddings_inside_on_host_keeps_the_resized_table(tied, device):
    """transformers resizes an embedding in place (``weight.data = new_weight.data``, the module's
    ``num_embeddings`` set to match). Inside ``ot.on_host`` that data went to the host stand-in,
    and the block's end gave back the old weight: the module said 136 rows, its table held 128, and
    the first new token raised IndexError (a ``weight.data = weight.data * 2`` there was lost the
    same way). The weight given back takes the stand-in's new data, offloaded at its new size."""
    model = _llama()
    model.config.tie_word_embeddings = tied
    model.tie_weights()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    ot.reset_stats(model)
    for m in (model, reference):
        torch.manual_seed(4)
        with ot.on_host(model) if m is model else contextlib.nullcontext():
            m.resize_token_embeddings(136)
            down = m.model.layers[0].mlp.down_proj.weight
            down.data = down.data * 2
    assert ot.stats(model).bytes_h2d == 0  # read and written on the host
    table = model.model.embed_tokens.weight
    assert isinstance(table, ot.OffloadedTensor) and table.shape == (136, 64)
    assert (model.lm_head.weight is table) == tied
    ids = torch.tensor([[130, 131, 5, 135]], device=device)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)
    _within_budget(model)
