"""Model-editing methods of diffusers, transformers and peft called on a wrapped model, against an
unwrapped deep copy given the same calls, bit for bit and within the budget: at 30 % of the model's
weight bytes and at a tighter budget at which a weight is larger than the room (each case asserts
that). diffusers: ``fuse_qkv_projections`` / ``unfuse_qkv_projections`` (a new Linear made from the
concatenated q, k, v weights and assigned into the wrapped model), ``set_attn_processor`` and back,
``enable_forward_chunking``, ``enable_slicing`` / ``enable_tiling`` of an AutoencoderKL (encode and
decode), IP-Adapter processors built on meta and loaded into a wrapped UNet. transformers:
``set_output_embeddings`` + ``tie_weights``, ``resize_position_embeddings``, gradient checkpointing
(reentrant and not) trained with ``enable_input_require_grads``, ``get_memory_footprint`` and
``num_parameters``. peft: ``inject_adapter_in_model`` trained, then ``get_peft_model_state_dict`` /
``set_peft_model_state_dict``; ``add_weighted_adapter`` of two LoRA adapters. Tiny models built
offline; without a client its tests skip."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch

import offtensor as ot

safetensors = pytest.importorskip("safetensors")
import safetensors.torch  # noqa: E402

GiB = 1 << 30


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]}.values())


def _wrap(model: torch.nn.Module, fraction: float, device, tight: bool) -> None:
    ot.wrap_model(model, budget_gb=fraction * _weight_bytes(model) / GiB, device=device)
    s = ot.stats(model)
    largest = max([p.numel() * p.element_size() for p in model.parameters() if isinstance(p, ot.OffloadedTensor)] or [0])
    room = s.budget_bytes - s.resident_bytes
    assert (largest > room) == tight, (largest, room)


def _equal(got, expected) -> None:
    got, expected = (list(got), list(expected)) if isinstance(got, (list, tuple)) else ([got], [expected])
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert e.abs().sum() > 0
        assert torch.equal(g, e)


def _within_budget(model: torch.nn.Module) -> None:
    s = ot.stats(model)
    assert s.bytes_h2d > 0, "nothing was paged"
    assert s.peak_device_bytes <= s.budget_bytes, s


# ---------------------------------------------------------------------------- diffusers


def _unet():
    from test_clients_diffusers import _unet
    return _unet()


def _sd3():
    torch.manual_seed(0)
    return pytest.importorskip("diffusers").SD3Transformer2DModel(
        sample_size=32, patch_size=1, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4).eval()


def _flux():
    from test_clients_diffusers import _flux_transformer
    return _flux_transformer()


def _vae():
    from test_clients_diffusers import _vae
    return _vae()


def _unet_call(model):
    g = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 7, 32, generator=g)
    return model(sample, torch.tensor([10, 500]), text).sample


def _sd3_call(model):
    g = torch.Generator().manual_seed(0)
    return model(hidden_states=torch.randn(2, 4, 32, 32, generator=g), encoder_hidden_states=torch.randn(2, 7, 32, generator=g),
                 pooled_projections=torch.randn(2, 64, generator=g), timestep=torch.tensor([10, 500])).sample


def _flux_call(model):
    g = torch.Generator().manual_seed(0)
    return model(hidden_states=torch.randn(1, 16, 16, generator=g), encoder_hidden_states=torch.randn(1, 7, 32, generator=g),
                 pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
                 img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(7, 3), guidance=None).sample


def _vae_call(model):
    # 64x64 against the VAE's sample_size of 16: tiling, once enabled, cuts encode and decode in tiles
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    latents = model.encode(x).latent_dist.mode()
    return [latents, model.decode(latents).sample]


def _attn_processor_and_back(model):
    from diffusers.models.attention_processor import AttnProcessor
    model._saved_processors = dict(model.attn_processors)
    model.set_attn_processor(AttnProcessor())


def _back(model):
    model.set_attn_processor(model._saved_processors)


def _tiling(model):
    model.enable_tiling()


FUSE = [("fuse", lambda m: m.fuse_qkv_projections()), ("unfuse", lambda m: m.unfuse_qkv_projections())]
DIFFUSERS = {
    # model -> (build, call, tight fraction, edits in order)
    "unet": (_unet, _unet_call, 0.04, [*FUSE, ("processor", _attn_processor_and_back), ("back", _back)]),
    "sd3": (_sd3, _sd3_call, 0.02, [*FUSE, ("chunking", lambda m: m.enable_forward_chunking(chunk_size=1, dim=1))]),
    "flux": (_flux, _flux_call, 0.1, FUSE),
    "vae": (_vae, _vae_call, 0.04, [*FUSE, ("processor", _attn_processor_and_back), ("back", _back),
                                    ("slicing", lambda m: m.enable_slicing()), ("tiling", _tiling)]),
}


@pytest.mark.parametrize("tight", [False, True], ids=["at_30_percent", "weight_larger_than_room"])
@pytest.mark.parametrize("which", list(DIFFUSERS))
def test_diffusers_edits_of_a_wrapped_model_give_the_unwrapped_outputs(which, tight, device):
    pytest.importorskip("diffusers")
    build, call, tight_fraction, edits = DIFFUSERS[which]
    model = build()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, tight_fraction if tight else 0.3, device, tight)
    for name, edit in edits:
        edit(reference)
        edit(model)
        with torch.no_grad():
            _equal(call(model), call(reference))
        _within_budget(model)
        if name == "fuse":  # the fused Linears, assigned into the wrapped model, are placed and counted
            assert any(".to_qkv." in n or ".to_kv." in n for n, _ in model.named_parameters())
            s = ot.stats(model)
            assert s.offloaded_bytes + s.resident_bytes == _weight_bytes(model)


def test_ip_adapter_processors_built_on_meta_load_into_a_wrapped_unet(device):
    """diffusers' ``_load_ip_adapter_weights`` builds its processors and image projection under
    ``init_empty_weights``, loads them outside the model and assigns them in, then moves the model
    with ``self.to(dtype=..., device=...)``: placed under the budget, bit for bit."""
    pytest.importorskip("diffusers")
    pytest.importorskip("accelerate")
    model = _unet()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, 0.04, device, tight=True)
    g = torch.Generator().manual_seed(3)
    ip, key = {}, 1
    for name in model.attn_processors:
        if name.endswith("attn2.processor"):
            hidden = 32 if name.startswith("down_blocks.0") or name.startswith("up_blocks.1") else 64
            ip[f"{key}.to_k_ip.weight"] = torch.randn(hidden, 32, generator=g) * 0.1
            ip[f"{key}.to_v_ip.weight"] = torch.randn(hidden, 32, generator=g) * 0.1
            key += 2
    proj = {"proj.weight": torch.randn(128, 16, generator=g) * 0.1, "proj.bias": torch.randn(128, generator=g),
            "norm.weight": torch.randn(32, generator=g), "norm.bias": torch.randn(32, generator=g)}
    for m in (reference, model):
        m._load_ip_adapter_weights(copy.deepcopy({"image_proj": proj, "ip_adapter": ip}), low_cpu_mem_usage=True)
    image_embeds = [torch.randn(2, 1, 16, generator=g).to(device)]
    with torch.no_grad():
        expected = _unet_call_with(reference, image_embeds)
        got = _unet_call_with(model, image_embeds)
    _equal(got, expected)
    _within_budget(model)


def _unet_call_with(model, image_embeds):
    g = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 7, 32, generator=g)
    return model(sample, torch.tensor([10, 500]), text, added_cond_kwargs={"image_embeds": image_embeds}).sample


# ---------------------------------------------------------------------------- transformers

TIGHT = 0.08  # of the tiny Llama's bytes: its MLP weights (64 KiB) are larger than the room


def _llama(tied=False):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                                      num_hidden_layers=2, num_key_value_heads=2, intermediate_size=256,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _logits(model, device):
    with torch.no_grad():
        return model(IDS.to(device)).logits


@pytest.mark.parametrize("tight", [False, True], ids=["at_30_percent", "weight_larger_than_room"])
@pytest.mark.parametrize("tied", [True, False])
def test_new_output_embeddings_then_tie_weights(tied, tight, device):
    model = _llama(tied)
    reference = copy.deepcopy(model).to(device)
    _wrap(model, TIGHT if tight else 0.3, device, tight)
    for m in (reference, model):
        torch.manual_seed(5)
        m.set_output_embeddings(torch.nn.Linear(64, 128, bias=False))
        m.tie_weights()
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    _equal(_logits(model, device), _logits(reference, device))
    assert model.get_memory_footprint() == reference.get_memory_footprint()
    assert model.num_parameters() == reference.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == reference.num_parameters(exclude_embeddings=True)
    _within_budget(model)


@pytest.mark.parametrize("tight", [False, True], ids=["at_30_percent", "weight_larger_than_room"])
def test_resize_position_embeddings(tight, device):
    """Pegasus builds new sinusoidal tables, DistilBERT a new learned one filled from a clone of the
    offloaded old table (grown, then cut)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    pegasus = transformers.PegasusForConditionalGeneration(transformers.PegasusConfig(
        vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=32)).eval()
    reference = copy.deepcopy(pegasus).to(device)
    _wrap(pegasus, 0.08 if tight else 0.3, device, tight)
    for m in (reference, pegasus):
        m.resize_position_embeddings(64)
    x = torch.randint(2, 128, (2, 40), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        _equal(pegasus(input_ids=x, decoder_input_ids=x).logits, reference(input_ids=x, decoder_input_ids=x).logits)
    _within_budget(pegasus)

    torch.manual_seed(0)
    distil = transformers.DistilBertModel(transformers.DistilBertConfig(
        vocab_size=128, dim=64, n_layers=2, n_heads=4, hidden_dim=256, max_position_embeddings=32)).eval()
    reference = copy.deepcopy(distil).to(device)
    _wrap(distil, 0.08 if tight else 0.3, device, tight)
    for size in (48, 20):  # its position_ids buffer keeps 32 positions: inputs of at most min(size, 32)
        for m in (reference, distil):
            torch.manual_seed(7)
            m.resize_position_embeddings(size)
        x = torch.randint(0, 128, (2, min(size, 32)), generator=torch.Generator().manual_seed(1)).to(device)
        with torch.no_grad():
            _equal(distil(x).last_hidden_state, reference(x).last_hidden_state)
    _within_budget(distil)


def _train(model, steps: int, device) -> torch.Tensor:
    """``steps`` AdamW steps of ``model``'s trainable parameters on the language-model loss of IDS:
    the losses."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(IDS.to(device), labels=IDS.to(device)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("tight", [False, True], ids=["at_30_percent", "weight_larger_than_room"])
@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("frozen", [False, True], ids=["all_trained", "frozen_with_input_grads"])
def test_gradient_checkpointing_trains_as_unwrapped(reentrant, frozen, tight, device):
    model = _llama()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, TIGHT if tight else 0.3, device, tight)
    losses = []
    for m in (reference, model):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        if frozen:  # as peft prepares a model: only the norms train, the inputs' embeddings need grad
            m.requires_grad_(False)
            m.enable_input_require_grads()
            for name, p in m.named_parameters():
                p.requires_grad_("norm" in name)
        losses.append(_train(m, 2, device))
    _equal(losses[1], losses[0])
    model.eval()
    reference.eval()
    _equal(_logits(model, device), _logits(reference, device))
    _within_budget(model)


# ---------------------------------------------------------------------------- peft

TARGETS = ["q_proj", "v_proj", "down_proj", "up_proj"]


def _lora():
    return pytest.importorskip("peft").LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)


def _plain(t):
    return t.materialize() if isinstance(t, ot.OffloadedTensor) else t


@pytest.mark.parametrize("tight", [False, True], ids=["at_30_percent", "weight_larger_than_room"])
@pytest.mark.parametrize("order", ["wrap_then_inject", "inject_then_wrap"])
def test_inject_adapter_train_then_peft_state_dicts(order, tight, device):
    peft = pytest.importorskip("peft")
    model = _llama()
    reference = copy.deepcopy(model).to(device)
    fraction = TIGHT if tight else 0.3
    if order == "wrap_then_inject":
        _wrap(model, fraction, device, tight)
    losses = []
    for m in (reference, model):
        torch.manual_seed(3)
        peft.inject_adapter_in_model(_lora(), m)
        if m is model and order == "inject_then_wrap":
            _wrap(model, fraction, device, tight)
        for name, p in m.named_parameters():
            p.requires_grad_("lora_" in name)
        losses.append(_train(m, 3, device))
    _equal(losses[1], losses[0])
    got, expected = peft.get_peft_model_state_dict(model), peft.get_peft_model_state_dict(reference)
    assert got.keys() == expected.keys() and len(got) == 16
    for k in expected:
        assert torch.equal(_plain(got[k]), expected[k]), k
    # adapters offloaded for want of room come back offloaded; saving writes their values
    buffer = io.BytesIO()
    torch.save(got, buffer)
    buffer.seek(0)
    saved = [torch.load(buffer), safetensors.torch.load(safetensors.torch.save(got))]
    for k in expected:
        assert all(torch.equal(s[k].to(device), expected[k]) for s in saved), k
    new = {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(i)).to(device)
           for i, (k, v) in enumerate(sorted(expected.items()))}
    for m in (reference, model):
        assert not peft.set_peft_model_state_dict(m, new).unexpected_keys
    _equal(_logits(model, device), _logits(reference, device))
    got = peft.get_peft_model_state_dict(model)
    for k in new:
        assert torch.equal(_plain(got[k]), new[k]), k
    _within_budget(model)


@pytest.mark.parametrize("tight", [False, True], ids=["at_30_percent", "weight_larger_than_room"])
@pytest.mark.parametrize("combination", ["svd", "cat", "linear", "ties", "dare_linear"])
def test_add_weighted_adapter_of_two_loras(combination, tight, device):
    peft = pytest.importorskip("peft")
    model = _llama()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, TIGHT if tight else 0.3, device, tight)
    logits = []
    for m in (reference, model):
        torch.manual_seed(3)
        peft_model = peft.get_peft_model(m, _lora(), adapter_name="a")
        peft_model.add_adapter("b", _lora())
        density = 0.5 if combination in ("ties", "dare_linear") else None
        peft_model.add_weighted_adapter(["a", "b"], [0.7, 0.4], "ab", combination_type=combination, density=density)
        peft_model.set_adapter("ab")
        logits.append(_logits(peft_model, device))
    _equal(logits[1], logits[0])
    _within_budget(model)


def test_a_slice_of_an_offloaded_clone_assigned_says_how_to_hold_only_its_bytes(device):
    """DistilBERT's ``resize_position_embeddings`` to fewer positions assigns
    ``nn.Parameter(old.clone()[:n])``: a view of the clone's whole host master, kept whole as a
    plain view keeps its storage. The warning names the bytes and the remedy that fits this case
    (assign a ``.clone()`` of the slice), not only the one for shards; a clone of the slice holds
    only its own bytes, without a warning."""
    model = torch.nn.Sequential(torch.nn.Embedding(48, 64), torch.nn.Linear(64, 64))
    ot.wrap_model(model, budget_gb=0.3 * _weight_bytes(model) / GiB, device=device)
    old = model[0].weight.clone()
    assert isinstance(old, ot.OffloadedTensor)
    expected = old.materialize()[:20]
    with pytest.warns(UserWarning, match=r"view of 5120 bytes .* host master of 12288 bytes .* assign a \.clone\(\) of it") \
            as caught:
        model[0].weight = torch.nn.Parameter(old[:20])
    assert [w.filename for w in caught] == [__file__]  # the assignment's line, not offtensor's
    assert torch.equal(model[0].weight.materialize(), expected)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model[0].weight = torch.nn.Parameter(old[:20].clone())
    assert isinstance(model[0].weight, ot.OffloadedTensor) and model[0].weight._master.nbytes == 5120
    assert torch.equal(model[0].weight.materialize(), expected)
