"""diffusers at its pinned release (requirements-test.txt) against wrapped models: UNet2DCondition,
AutoencoderKL encode and decode, the Flux transformer and a whole FluxPipeline with every component
wrapped, layerwise casting, SD3's ``pos_embed`` crop, and group offloading refused naming the
module. Each model is tiny, random-initialised offline, wrapped at about 30 % of its weight bytes
and compared with an unwrapped deep copy, as in tests/test_clients.py (whose helpers these are);
without diffusers every test here skips."""

from __future__ import annotations

import copy

import pytest
import torch

import offtensor as ot

from test_clients import BUDGET_FRACTION, _paged_within_budget, _reference, _weight_bytes, _wrap

GiB = 1 << 30


# ---------------------------------------------------------------------------- diffusers


def _diffusers():
    return pytest.importorskip("diffusers")


def _unet():
    torch.manual_seed(0)
    return _diffusers().UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    ).eval()


def _vae():
    torch.manual_seed(0)
    return _diffusers().AutoencoderKL(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
        latent_channels=4, norm_num_groups=8, sample_size=16, scaling_factor=1.5, shift_factor=0.06,
    ).eval()


def _flux_transformer():
    torch.manual_seed(0)
    # in_channels 16 = the VAE's 4 latent channels packed 2x2, as FluxPipeline packs them.
    return _diffusers().FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6),
    ).eval()


def test_diffusers_unet2d_condition_wrapped_gives_the_unwrapped_noise_prediction(device):
    unet = _unet()
    reference = _reference(unet, device)
    _wrap(unet, device)
    # cross-attention and resnet weights of both resolutions are paged, not only one block
    offloaded = {n.split(".")[0] for n, p in unet.named_parameters() if isinstance(p, ot.OffloadedTensor)}
    assert {"down_blocks", "up_blocks"} <= offloaded, offloaded
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, 8, 8, generator=g).to(device)
    text = torch.randn(2, 7, 32, generator=g).to(device)
    timesteps = torch.tensor([10, 500], device=device)
    with torch.no_grad():
        expected = reference(sample, timesteps, text).sample
        got = unet(sample, timesteps, text).sample
    assert expected.abs().sum() > 0
    assert torch.equal(got, expected)
    _paged_within_budget(unet)


@pytest.mark.parametrize("order", ["cast_then_wrap", "wrap_then_cast"])
def test_diffusers_layerwise_casting_and_wrap_keep_weights_offloaded_through_its_casts(order, device):
    """``enable_layerwise_casting`` (bf16 storage, fp32 compute) casts each layer to fp32 before its
    forward and back after. On main the cast paged whole weights and raised BudgetError; now the
    offloaded ones are converted host master to host master and the room re-planned for fp32.
    Enabled after wrapping, its first cast converts the offloaded fp32 weights to bf16 the same way."""
    def cast(unet):
        unet.enable_layerwise_casting(storage_dtype=torch.bfloat16, compute_dtype=torch.float32)
        return unet

    unet, reference = _unet(), cast(_unet()).to(device)  # a deepcopy would keep hooks bound to the original
    if order == "cast_then_wrap":
        _wrap(cast(unet), device)
    else:
        _wrap(unet, device)
        cast(unet)
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, 8, 8, generator=g).to(device)
    text = torch.randn(2, 7, 32, generator=g).to(device)
    timesteps = torch.tensor([10, 500], device=device)
    with torch.no_grad():
        expected = reference(sample, timesteps, text).sample
        for _ in range(2):  # the second forward runs on the placement the first one's casts left
            assert torch.equal(unet(sample, timesteps, text).sample, expected)
    offloaded = [p for p in unet.parameters() if isinstance(p, ot.OffloadedTensor)]
    assert offloaded and {p.dtype for p in offloaded} == {torch.bfloat16}  # stored bf16 between forwards
    _paged_within_budget(unet)


@pytest.mark.parametrize("how", ["enable_group_offload", "apply_group_offloading_leaf_level"])
def test_wrapping_a_diffusers_model_under_group_offloading_is_refused_naming_the_module(how, device):
    """diffusers' group offloading moves each group's weights to the onload device at every forward:
    wrapping such a model would offload the same weights a second time. Refused before anything
    moves, as a model that accelerate's hooks offload is; the model still runs as diffusers' own."""
    unet, reference = _unet(), _reference(_unet(), device)
    if how == "enable_group_offload":
        unet.enable_group_offload(onload_device=torch.device(device), offload_type="block_level", num_blocks_per_group=1)
        where = "UNet2DConditionModel '' of UNet2DConditionModel"
    else:
        from diffusers.hooks import apply_group_offloading

        apply_group_offloading(unet.down_blocks, onload_device=torch.device(device), offload_type="leaf_level")
        where = "GroupNorm 'down_blocks.0.attentions.0.norm' of UNet2DConditionModel"  # its first module with weights
    with pytest.raises(ValueError, match=rf"({where}) .*offloaded by diffusers' group offloading.*Nothing was changed"):
        ot.wrap_model(unet, budget_gb=BUDGET_FRACTION * _weight_bytes(unet) / GiB, device=device)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in unet.parameters())
    g = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 8, 8, generator=g).to(device), torch.randn(2, 7, 32, generator=g).to(device)
    timesteps = torch.tensor([10, 500], device=device)
    with torch.no_grad():
        assert torch.equal(unet(sample, timesteps, text).sample, reference(sample, timesteps, text).sample)


def test_diffusers_autoencoder_kl_encode_and_decode_wrapped_match_unwrapped(device):
    vae = _vae()
    reference = _reference(vae, device)
    _wrap(vae, device)
    assert any(isinstance(p, ot.OffloadedTensor) for p in vae.encoder.parameters())
    assert any(isinstance(p, ot.OffloadedTensor) for p in vae.decoder.parameters())
    image = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        expected = reference.encode(image).latent_dist
        got = vae.encode(image).latent_dist
        assert torch.equal(got.mean, expected.mean) and torch.equal(got.logvar, expected.logvar)
        expected_image = reference.decode(expected.mean).sample
        got_image = vae.decode(got.mean).sample
    assert torch.equal(got_image, expected_image)
    _paged_within_budget(vae)


def test_diffusers_flux_transformer_wrapped_matches_unwrapped(device):
    transformer = _flux_transformer()
    reference = _reference(transformer, device)
    _wrap(transformer, device)
    g = torch.Generator().manual_seed(0)
    image_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0), indexing="ij"), -1)
    inputs = dict(
        hidden_states=torch.randn(1, 16, 16, generator=g), encoder_hidden_states=torch.randn(1, 5, 32, generator=g),
        pooled_projections=torch.randn(1, 32, generator=g), timestep=torch.tensor([0.5]),
        img_ids=image_ids.reshape(16, 3), txt_ids=torch.zeros(5, 3),  # rotary positions of a 4x4 latent grid
    )
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():
        expected = reference(**inputs).sample
        got = transformer(**inputs).sample
    assert torch.equal(got, expected)
    _paged_within_budget(transformer)


def _word_tokenizer():
    """A real fast tokenizer built offline: a word-level vocabulary of a few words, max length 8."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {w: i for i, w in enumerate("<pad> <s> </s> <unk> a an photo of astronaut riding horse moon".split())}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>",
        model_max_length=8,
    ), len(vocab)


def test_diffusers_flux_pipeline_with_every_component_wrapped_gives_the_unwrapped_image(device):
    """FluxPipeline end to end, prompt to image: both text encoders (CLIP, T5), the Flux
    transformer over 2 denoising steps and the VAE decoder, each wrapped at 30 % on its own pager."""
    diffusers = _diffusers()
    transformers = pytest.importorskip("transformers")
    tokenizer, vocab = _word_tokenizer()
    torch.manual_seed(0)
    clip = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=8, projection_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )).eval()
    t5 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
    )).eval()
    models = dict(text_encoder=clip, text_encoder_2=t5, transformer=_flux_transformer(), vae=_vae())

    def pipeline(components):
        pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), tokenizer=tokenizer,
                                      tokenizer_2=copy.deepcopy(tokenizer), **components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    reference = pipeline({k: _reference(m, device) for k, m in models.items()})
    for m in models.values():
        _wrap(m, device)
    wrapped = pipeline(models)
    call = dict(prompt="a photo of an astronaut riding a horse", height=16, width=16, num_inference_steps=2,
                guidance_scale=1.0, max_sequence_length=8, output_type="pt")
    expected = reference(**call, generator=torch.Generator().manual_seed(3)).images
    got = wrapped(**call, generator=torch.Generator().manual_seed(3)).images
    assert expected.shape == (1, 3, 16, 16) and expected.std() > 0
    assert torch.equal(got, expected)
    for name, m in models.items():
        assert ot.stats(m).bytes_h2d > 0, name
        _paged_within_budget(m)


def _sd3_transformer():
    torch.manual_seed(0)
    return _diffusers().SD3Transformer2DModel(
        sample_size=32, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=4,
        caption_projection_dim=32, joint_attention_dim=32, pooled_projection_dim=64, out_channels=4,
        pos_embed_max_size=96,
    ).eval()


def test_diffusers_sd3_transformer_at_30_percent_pages_only_the_pos_embed_crop_it_reads(device):
    """SD3's PatchEmbed keeps a 96x96 ``pos_embed`` table (1.18 MB, 88 % of this model's bytes) and
    forward reads a 16x16 crop of it (32 KB). On main placement counted the whole table as one op's
    working set and refused the budget (BudgetError); now the table is offloaded as one read in
    slices, and the forward pages the crop only, bit-identical and within budget."""
    model = _sd3_transformer()
    reference = _reference(model, device)
    table = model.pos_embed.pos_embed
    with pytest.warns(UserWarning, match=r"'pos_embed\.pos_embed' \(1179648 bytes\) cannot be paged whole"):
        _wrap(model, device)
    assert isinstance(model.pos_embed.pos_embed, ot.OffloadedTensor)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 4, 32, 32, generator=g).to(device)
    text = torch.randn(2, 7, 32, generator=g).to(device)
    pooled = torch.randn(2, 64, generator=g).to(device)
    timesteps = torch.tensor([10, 500], device=device)
    ot.reset_stats(model)
    with torch.no_grad():
        expected = reference(hidden, text, pooled, timesteps).sample
        got = model(hidden, text, pooled, timesteps).sample
    assert torch.equal(got, expected)
    s = ot.stats(model)
    crop = 16 * 16 * table.shape[-1] * table.element_size()
    assert s.bytes_h2d < table.numel() * table.element_size() and s.bytes_h2d >= crop, s
    _paged_within_budget(model)


def _qwenimage_transformer(device):
    torch.manual_seed(0)
    model = _diffusers().QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=4,
        joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
    ).eval()
    rope = model.pos_embed  # its rope tables are plain attributes, computed at init: put them on the device
    rope.pos_freqs, rope.neg_freqs = rope.pos_freqs.to(device), rope.neg_freqs.to(device)
    return model


def test_diffusers_qwenimage_transformer_counts_its_rope_tables_held_as_plain_attributes(device):
    # Its two rope tables (512 KiB, 40 % of this tiny model's bytes) stayed resident beside a
    # placement that had not counted them: 816 kB on the device at a budget of 397 kB. Its forward
    # reads both whole, so 30 % is refused at wrap time, naming them; 60 % runs within the budget.
    with pytest.raises(ot.BudgetError, match=r"'pos_embed\.pos_freqs'.*524288 bytes"):
        _wrap(_qwenimage_transformer(device), device)
    transformer = _qwenimage_transformer(device)
    reference = _reference(transformer, device)
    _wrap(transformer, device, 0.6 * _weight_bytes(transformer))
    g = torch.Generator().manual_seed(0)
    inputs = dict(hidden_states=torch.randn(1, 16, 16, generator=g), encoder_hidden_states=torch.randn(1, 8, 16, generator=g),
                  encoder_hidden_states_mask=torch.ones(1, 8, dtype=torch.long), timestep=torch.tensor([1.0]))
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():
        expected = reference(**inputs, img_shapes=[(1, 4, 4)]).sample
        got = transformer(**inputs, img_shapes=[(1, 4, 4)]).sample
    assert torch.equal(got, expected)
    _paged_within_budget(transformer)
