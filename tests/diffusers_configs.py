"""Tiny diffusers models for tests/test_diffusers_sweep.py: per diffusers model class, an init dict
and its inputs, as plain data, built offline from seeds; nothing is downloaded."""
# Init dicts and input shapes from diffusers' own tests (get_init_dict / get_dummy_inputs), Apache-2.0.

from __future__ import annotations

import torch

# diffusers class name -> (init dict, inputs). An input spec is a tuple whose first item names it:
# ('randn', shape, dtype), ('randint', low, high, shape, dtype), ('full', shape, value, dtype),
# ('tensor', values, dtype), ('list', [specs]); anything else is passed as it is.
MODELS = {
    'AutoencoderKL': (
        dict(block_out_channels=[2, 4], in_channels=3, out_channels=3,
            down_block_types=['DownEncoderBlock2D', 'DownEncoderBlock2D'],
            up_block_types=['UpDecoderBlock2D', 'UpDecoderBlock2D'], latent_channels=4, norm_num_groups=2),
        dict(sample=('randn', (4, 3, 32, 32), 'float32'))),
    'AutoencoderDC': (
        dict(in_channels=3, latent_channels=4, attention_head_dim=2,
            encoder_block_types=('ResBlock', 'EfficientViTBlock'),
            decoder_block_types=('ResBlock', 'EfficientViTBlock'), encoder_block_out_channels=(8, 8),
            decoder_block_out_channels=(8, 8), encoder_qkv_multiscales=((), (5,)), decoder_qkv_multiscales=((), (5,)),
            encoder_layers_per_block=(1, 1), decoder_layers_per_block=[1, 1], downsample_block_type='conv',
            upsample_block_type='interpolate', decoder_norm_types='rms_norm', decoder_act_fns='silu',
            scaling_factor=0.41407),
        dict(sample=('randn', (4, 3, 32, 32), 'float32'))),
    'AutoencoderKLCogVideoX': (
        dict(in_channels=3, out_channels=3,
            down_block_types=('CogVideoXDownBlock3D',) * 4,
            up_block_types=('CogVideoXUpBlock3D',) * 4,
            block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
            temporal_compression_ratio=4),
        dict(sample=('randn', (4, 3, 8, 16, 16), 'float32'))),
    'AutoencoderKLKVAE': (
        dict(in_channels=3, channels=32, num_enc_blocks=1, num_dec_blocks=1, z_channels=4,
            double_z=True, ch_mult=(1, 2), sample_size=32),
        dict(sample=('randn', (2, 3, 32, 32), 'float32'))),
    'AutoencoderKLLTXVideo': (
        dict(in_channels=3, out_channels=3, latent_channels=8,
            block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False),
            decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False, False, False, False, False), upsample_residual=(False, False, False, False),
            upsample_factor=(1, 1, 1, 1), timestep_conditioning=False, patch_size=1, patch_size_t=1,
            encoder_causal=True, decoder_causal=False),
        dict(sample=('randn', (2, 3, 9, 16, 16), 'float32'))),
    'AutoencoderTiny': (
        dict(in_channels=3, out_channels=3, encoder_block_out_channels=[32, 32],
            decoder_block_out_channels=[32, 32], num_encoder_blocks=[1, 1], num_decoder_blocks=[1, 1]),
        dict(sample=('randn', (4, 3, 32, 32), 'float32'))),
    'VQModel': (
        dict(block_out_channels=[8, 16], norm_num_groups=8, in_channels=3, out_channels=3,
            down_block_types=['DownEncoderBlock2D', 'DownEncoderBlock2D'],
            up_block_types=['UpDecoderBlock2D', 'UpDecoderBlock2D'], latent_channels=3),
        dict(sample=('randn', (4, 3, 32, 32), 'float32'))),
    'DiTTransformer2DModel': (
        dict(in_channels=4, out_channels=8, activation_fn='gelu-approximate',
            num_attention_heads=2, attention_head_dim=4, attention_bias=True, num_layers=1, norm_type='ada_norm_zero',
            num_embeds_ada_norm=8, patch_size=2, sample_size=8),
        dict(hidden_states=('randn', (4, 4, 8, 8), 'float32'), timestep=('tensor', [44, 239, 933, 760], 'int64'),
            class_labels=('tensor', [0, 3, 1, 0], 'int64'))),
    'PixArtTransformer2DModel': (
        dict(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=2,
            num_attention_heads=2, in_channels=4, cross_attention_dim=8, out_channels=8, attention_bias=True,
            activation_fn='gelu-approximate', num_embeds_ada_norm=8, norm_type='ada_norm_single',
            norm_elementwise_affine=False, norm_eps=1e-06, use_additional_conditions=False, caption_channels=None),
        dict(hidden_states=('randn', (4, 4, 8, 8), 'float32'), timestep=('tensor', [44, 239, 933, 760], 'int64'),
            encoder_hidden_states=('randn', (4, 8, 8), 'float32'),
            added_cond_kwargs={'aspect_ratio': None, 'resolution': None})),
    'LatteTransformer3DModel': (
        dict(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=4,
            num_attention_heads=2, caption_channels=8, in_channels=4, cross_attention_dim=8, out_channels=8,
            attention_bias=True, activation_fn='gelu-approximate', num_embeds_ada_norm=1000,
            norm_type='ada_norm_single', norm_elementwise_affine=False, norm_eps=1e-06),
        dict(hidden_states=('randn', (2, 4, 1, 8, 8), 'float32'),
            encoder_hidden_states=('randn', (2, 8, 8), 'float32'), timestep=('tensor', [44, 239], 'int64'),
            enable_temporal_attentions=True)),
    'LTXVideoTransformer3DModel': (
        dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
            cross_attention_dim=16, num_layers=1, qk_norm='rms_norm_across_heads', caption_channels=16),
        dict(hidden_states=('randn', (2, 512, 4), 'float32'), encoder_hidden_states=('randn', (2, 16, 16), 'float32'),
            timestep=('tensor', [44, 239], 'int64'), encoder_attention_mask=('full', (2, 16), True, 'bool'),
            num_frames=2, height=16, width=16)),
    'SanaTransformer2DModel': (
        dict(patch_size=1, in_channels=4, out_channels=4, num_layers=1,
            attention_head_dim=4, num_attention_heads=2, num_cross_attention_heads=2, cross_attention_head_dim=4,
            cross_attention_dim=8, caption_channels=8, sample_size=32),
        dict(hidden_states=('randn', (2, 4, 32, 32), 'float32'),
            encoder_hidden_states=('randn', (2, 8, 8), 'float32'), timestep=('tensor', [44, 239], 'int64'))),
    'Cosmos3OmniTransformer': (
        dict(head_dim=6, hidden_act='relu2', hidden_size=12, intermediate_size=24,
            latent_channel=2, latent_patch_size=1, num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1,
            patch_latent_dim=2, qk_norm_for_text=False, rms_norm_eps=1e-05, rope_axes_dim=[1, 1, 1],
            rope_theta=100000000.0, vocab_size=32),
        dict(input_ids=('tensor', [1, 2], 'int64'), text_indexes=('tensor', [0, 1], 'int64'),
            position_ids=('full', (3, 3), 0, 'int64'), und_len=2, sequence_length=3,
            vision_tokens=('list', [('randn', (1, 2, 1, 1, 1), 'float32')]), vision_token_shapes=[(1, 1, 1)],
            vision_sequence_indexes=('tensor', [2], 'int64'), vision_mse_loss_indexes=('tensor', [2], 'int64'),
            vision_timesteps=('tensor', [1.0], 'float32'),
            vision_noisy_frame_indexes=('list', [('tensor', [0], 'int64')]))),
    'ErnieImageTransformer2DModel': (
        dict(hidden_size=16, num_attention_heads=1, num_layers=1, ffn_hidden_size=16,
            in_channels=16, out_channels=16, patch_size=1, text_in_dim=16, rope_theta=256, rope_axes_dim=(8, 4, 4),
            eps=1e-06, qk_layernorm=True),
        dict(hidden_states=('randn', (1, 16, 16, 16), 'float32'), timestep=('tensor', [1.0], 'float32'),
            text_bth=('randn', (1, 16, 16), 'float32'), text_lens=('tensor', [16], 'int64'))),
    'CogVideoXTransformer3DModel': (
        dict(num_attention_heads=2, attention_head_dim=8, in_channels=4,
            out_channels=4, time_embed_dim=2, text_embed_dim=8, num_layers=2, sample_width=8, sample_height=8,
            sample_frames=8, patch_size=2, patch_size_t=None, temporal_compression_ratio=4, max_text_seq_length=8),
        dict(hidden_states=('randn', (2, 1, 4, 8, 8), 'float32'),
            encoder_hidden_states=('randn', (2, 8, 8), 'float32'), timestep=('tensor', [44, 239], 'int64'))),
    'CogView4Transformer2DModel': (
        dict(patch_size=2, in_channels=4, num_layers=2, attention_head_dim=4,
            num_attention_heads=4, out_channels=4, text_embed_dim=8, time_embed_dim=8, condition_dim=4),
        dict(hidden_states=('randn', (2, 4, 8, 8), 'float32'), encoder_hidden_states=('randn', (2, 8, 8), 'float32'),
            timestep=('tensor', [44, 239], 'int64'), original_size=('full', (2, 2), 64, 'int64'),
            target_size=('full', (2, 2), 64, 'int64'), crop_coords=('full', (2, 2), 0, 'int64'))),
    'HunyuanDiT2DModel': (
        dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
            num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8, pooled_projection_dim=4,
            hidden_size=16, text_len=4, text_len_t5=4, activation_fn='gelu-approximate'),
        dict(hidden_states=('randn', (2, 4, 8, 8), 'float32'), encoder_hidden_states=('randn', (2, 4, 8), 'float32'),
            text_embedding_mask=('full', (2, 4), 1.0, 'float32'),
            encoder_hidden_states_t5=('randn', (2, 4, 8), 'float32'),
            text_embedding_mask_t5=('full', (2, 4), 1.0, 'float32'), timestep=('tensor', [44.0, 239.0], 'float32'),
            image_meta_size=('randint', 0, 1025, (2, 6), 'float32'), style=('full', (2,), 0, 'int64'),
            image_rotary_emb=('list', [('full', (1, 8), 1.0, 'float32'), ('full', (1, 8), 0.0, 'float32')]))),
    'HunyuanVideoTransformer3DModel': (
        dict(in_channels=4, out_channels=4, num_attention_heads=2,
            attention_head_dim=10, num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1,
            patch_size_t=1, guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
            image_condition_type=None),
        dict(hidden_states=('randn', (1, 4, 1, 16, 16), 'float32'), timestep=('tensor', [44.0], 'float32'),
            encoder_hidden_states=('randn', (1, 12, 16), 'float32'), pooled_projections=('randn', (1, 8), 'float32'),
            encoder_attention_mask=('full', (1, 12), 1.0, 'float32'), guidance=('tensor', [44.0], 'float32'))),
    'WanTransformer3DModel': (
        dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
            in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2, cross_attn_norm=True,
            qk_norm='rms_norm_across_heads', rope_max_seq_len=32),
        dict(hidden_states=('randn', (1, 4, 2, 16, 16), 'float32'),
            encoder_hidden_states=('randn', (1, 12, 16), 'float32'), timestep=('tensor', [44], 'int64'))),
    'ZImageTransformer2DModel': (
        dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=16,
            n_layers=1, n_refiner_layers=1, n_heads=1, n_kv_heads=2, qk_norm=True, cap_feat_dim=16, rope_theta=256.0,
            t_scale=1000.0, axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]),
        dict(x=('list', [('randn', (16, 1, 16, 16), 'float32')]),
            cap_feats=('list', [('randn', (16, 16), 'float32')]), t=('tensor', [0.0], 'float32'))),
    'FluxTransformer2DModel': (
        dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8]),
        dict(hidden_states=('randn', (1, 16, 4), 'float32'), encoder_hidden_states=('randn', (1, 48, 32), 'float32'),
            pooled_projections=('randn', (1, 32), 'float32'), img_ids=('randn', (16, 3), 'float32'),
            txt_ids=('randn', (48, 3), 'float32'), timestep=('tensor', [1.0], 'float32'))),
    'Flux2Transformer2DModel': (
        dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, timestep_guidance_channels=256,
            axes_dims_rope=[4, 4, 4, 4]),
        dict(hidden_states=('randn', (1, 16, 4), 'float32'), encoder_hidden_states=('randn', (1, 48, 32), 'float32'),
            img_ids=('randint', 0, 4, (1, 16, 4), 'int64'), txt_ids=('randint', 0, 48, (1, 48, 4), 'int64'),
            timestep=('tensor', [1.0], 'float32'), guidance=('tensor', [1.0], 'float32'))),
    'QwenImageTransformer2DModel': (
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16, guidance_embeds=False,
            axes_dims_rope=(8, 4, 4)),
        dict(hidden_states=('randn', (1, 16, 16), 'float32'), encoder_hidden_states=('randn', (1, 8, 16), 'float32'),
            encoder_hidden_states_mask=('full', (1, 8), 1, 'int64'), timestep=('tensor', [1.0], 'float32'),
            img_shapes=[(1, 4, 4)])),
    'NucleusMoEImageTransformer2DModel': (
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
            moe_enabled=False, capacity_factors=[8.0, 8.0]),
        dict(hidden_states=('randn', (1, 16, 16), 'float32'), encoder_hidden_states=('randn', (1, 8, 16), 'float32'),
            encoder_hidden_states_mask=('full', (1, 8), 1, 'int64'), timestep=('tensor', [1.0], 'float32'),
            img_shapes=[(1, 4, 4)])),
    'TransformerTemporalModel': (
        dict(num_attention_heads=8, attention_head_dim=4, in_channels=4, num_layers=1,
            norm_num_groups=1),
        dict(hidden_states=('randn', (2, 4, 32, 32), 'float32'), timestep=('tensor', [44, 239], 'int64'))),
    'EasyAnimateTransformer3DModel': (
        dict(attention_head_dim=16, num_attention_heads=2, in_channels=4,
            mmdit_layers=2, num_layers=2, out_channels=4, patch_size=2, sample_height=60, sample_width=90,
            text_embed_dim=16, time_embed_dim=8, time_position_encoding_type='3d_rope', timestep_activation_fn='silu'),
        dict(hidden_states=('randn', (2, 4, 2, 16, 16), 'float32'), timestep=('tensor', [44, 239], 'int64'),
            timestep_cond=None, encoder_hidden_states=('randn', (2, 16, 16), 'float32'),
            encoder_hidden_states_t5=None, inpaint_latents=None, control_latents=None)),
    'PriorTransformer': (
        dict(num_attention_heads=2, attention_head_dim=4, num_layers=2, embedding_dim=8,
            num_embeddings=7, additional_embeddings=4),
        dict(hidden_states=('randn', (4, 8), 'float32'), timestep=2, proj_embedding=('randn', (4, 8), 'float32'),
            encoder_hidden_states=('randn', (4, 7, 8), 'float32'))),
    'AuraFlowTransformer2DModel': (
        dict(sample_size=32, patch_size=2, in_channels=4, num_mmdit_layers=1,
            num_single_dit_layers=1, attention_head_dim=8, num_attention_heads=4, caption_projection_dim=32,
            joint_attention_dim=32, out_channels=4, pos_embed_max_size=256),
        dict(hidden_states=('randn', (2, 4, 32, 32), 'float32'),
            encoder_hidden_states=('randn', (2, 256, 32), 'float32'), timestep=('tensor', [44, 239], 'int64'))),
    'OmniGenTransformer2DModel': (
        dict(hidden_size=16, num_attention_heads=4, num_key_value_heads=4,
            intermediate_size=32, num_layers=20, pad_token_id=0, vocab_size=1000, in_channels=4, time_step_dim=4,
            rope_scaling={'long_factor': [1, 2], 'short_factor': [1, 2]}),
        dict(hidden_states=('randn', (2, 4, 8, 8), 'float32'), timestep=('randn', (2,), 'float32'),
            input_ids=('randint', 0, 10, (2, 24), 'int64'),
            input_img_latents=('list', [('randn', (1, 4, 8, 8), 'float32')]), input_image_sizes={0: [[0, 16]]},
            attention_mask=('full', (2, 41, 41), 1.0, 'float32'), position_ids=('randint', 0, 41, (2, 41), 'int64'))),
    'UNet2DConditionModel': (
        dict(block_out_channels=(4, 8), norm_num_groups=4,
            down_block_types=('CrossAttnDownBlock2D', 'DownBlock2D'),
            up_block_types=('UpBlock2D', 'CrossAttnUpBlock2D'), cross_attention_dim=8, attention_head_dim=2,
            out_channels=4, in_channels=4, layers_per_block=1, sample_size=16),
        dict(sample=('randn', (4, 4, 16, 16), 'float32'), timestep=('tensor', [10], 'int64'),
            encoder_hidden_states=('randn', (4, 4, 8), 'float32'))),
    'UNet2DModel': (
        dict(block_out_channels=(4, 8), norm_num_groups=2,
            down_block_types=('DownBlock2D', 'AttnDownBlock2D'), up_block_types=('AttnUpBlock2D', 'UpBlock2D'),
            attention_head_dim=3, out_channels=3, in_channels=3, layers_per_block=2, sample_size=32),
        dict(sample=('randn', (4, 3, 32, 32), 'float32'), timestep=('tensor', [10], 'int64'))),
    'UNet1DModel': (
        dict(block_out_channels=(8, 8, 16, 16), in_channels=14, out_channels=14,
            time_embedding_type='positional', use_timestep_embedding=True, flip_sin_to_cos=False, freq_shift=1.0,
            out_block_type='OutConv1DBlock', mid_block_type='MidResTemporalBlock1D',
            down_block_types=('DownResnetBlock1D', 'DownResnetBlock1D', 'DownResnetBlock1D', 'DownResnetBlock1D'),
            up_block_types=('UpResnetBlock1D', 'UpResnetBlock1D', 'UpResnetBlock1D'), act_fn='swish'),
        dict(sample=('randn', (4, 14, 16), 'float32'), timestep=('full', (4,), 10, 'int64'))),
    'UNet3DConditionModel': (
        dict(block_out_channels=(4, 8), norm_num_groups=4,
            down_block_types=('CrossAttnDownBlock3D', 'DownBlock3D'),
            up_block_types=('UpBlock3D', 'CrossAttnUpBlock3D'), cross_attention_dim=8, attention_head_dim=2,
            out_channels=4, in_channels=4, layers_per_block=1, sample_size=16),
        dict(sample=('randn', (4, 4, 4, 16, 16), 'float32'), timestep=('tensor', [10], 'int64'),
            encoder_hidden_states=('randn', (4, 4, 8), 'float32'))),
    'UNetControlNetXSModel': (
        dict(sample_size=16, down_block_types=('DownBlock2D', 'CrossAttnDownBlock2D'),
            up_block_types=('CrossAttnUpBlock2D', 'UpBlock2D'), block_out_channels=(4, 8), cross_attention_dim=8,
            transformer_layers_per_block=1, num_attention_heads=2, norm_num_groups=4, upcast_attention=False,
            ctrl_block_out_channels=[2, 4], ctrl_num_attention_heads=4, ctrl_max_norm_num_groups=2,
            ctrl_conditioning_embedding_out_channels=(2, 2)),
        dict(sample=('randn', (4, 4, 16, 16), 'float32'), timestep=('tensor', [10], 'int64'),
            encoder_hidden_states=('randn', (4, 4, 8), 'float32'),
            controlnet_cond=('randn', (4, 3, 32, 32), 'float32'), conditioning_scale=1)),
    # Controlnets, in the sizes of the models above (diffusers tests them through their pipelines).
    'ControlNetModel': (
        dict(block_out_channels=(4, 8), norm_num_groups=4, layers_per_block=1, in_channels=4,
            down_block_types=('DownBlock2D', 'CrossAttnDownBlock2D'), cross_attention_dim=8, attention_head_dim=2,
            conditioning_embedding_out_channels=(4, 8)),
        dict(sample=('randn', (2, 4, 16, 16), 'float32'), timestep=('tensor', [10], 'int64'),
            encoder_hidden_states=('randn', (2, 4, 8), 'float32'),
            controlnet_cond=('randn', (2, 3, 32, 32), 'float32'))),
    'SD3ControlNetModel': (
        dict(sample_size=16, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
            num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=32, pooled_projection_dim=64,
            out_channels=4, pos_embed_max_size=16),
        dict(hidden_states=('randn', (2, 4, 16, 16), 'float32'), controlnet_cond=('randn', (2, 4, 16, 16), 'float32'),
            encoder_hidden_states=('randn', (2, 7, 32), 'float32'), pooled_projections=('randn', (2, 64), 'float32'),
            timestep=('tensor', [10, 500], 'int64'))),
    'FluxControlNetModel': (
        dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
            axes_dims_rope=[4, 4, 8]),
        dict(hidden_states=('randn', (1, 16, 4), 'float32'), controlnet_cond=('randn', (1, 16, 4), 'float32'),
            encoder_hidden_states=('randn', (1, 48, 32), 'float32'), pooled_projections=('randn', (1, 32), 'float32'),
            img_ids=('randn', (16, 3), 'float32'), txt_ids=('randn', (48, 3), 'float32'),
            timestep=('tensor', [1.0], 'float32'))),
    'HunyuanDiT2DControlNetModel': (
        dict(sample_size=8, patch_size=2, in_channels=4, transformer_num_layers=4,
            attention_head_dim=8, num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8,
            pooled_projection_dim=4, hidden_size=16, text_len=4, text_len_t5=4, activation_fn='gelu-approximate'),
        dict(hidden_states=('randn', (2, 4, 8, 8), 'float32'), controlnet_cond=('randn', (2, 4, 8, 8), 'float32'),
            encoder_hidden_states=('randn', (2, 4, 8), 'float32'), text_embedding_mask=('full', (2, 4), 1.0, 'float32'),
            encoder_hidden_states_t5=('randn', (2, 4, 8), 'float32'),
            text_embedding_mask_t5=('full', (2, 4), 1.0, 'float32'), timestep=('tensor', [44.0, 239.0], 'float32'),
            image_meta_size=('randint', 0, 1025, (2, 6), 'float32'), style=('full', (2,), 0, 'int64'),
            image_rotary_emb=('list', [('full', (1, 8), 1.0, 'float32'), ('full', (1, 8), 0.0, 'float32')]))),
    'QwenImageControlNetModel': (
        dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
            attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16, axes_dims_rope=(8, 4, 4)),
        dict(hidden_states=('randn', (1, 16, 16), 'float32'), controlnet_cond=('randn', (1, 16, 16), 'float32'),
            encoder_hidden_states=('randn', (1, 8, 16), 'float32'),
            encoder_hidden_states_mask=('full', (1, 8), 1, 'int64'), timestep=('tensor', [1.0], 'float32'),
            img_shapes=[(1, 4, 4)])),
}


def make_inputs(spec: dict, seed: int = 1) -> dict:
    """The inputs a spec of ``MODELS`` names, drawn from a generator seeded with ``seed``."""
    g = torch.Generator().manual_seed(seed)

    def build(s):
        kind = s[0] if isinstance(s, tuple) and s and isinstance(s[0], str) else None
        if kind == "randn":
            return torch.randn(s[1], generator=g).to(getattr(torch, s[2]))
        if kind == "randint":
            return torch.randint(s[1], s[2], s[3], generator=g).to(getattr(torch, s[4]))
        if kind == "full":
            return torch.full(s[1], s[2], dtype=getattr(torch, s[3]))
        if kind == "tensor":
            return torch.tensor(s[1], dtype=getattr(torch, s[2]))
        if kind == "list":
            return [build(x) for x in s[1]]
        return s

    return {name: build(s) for name, s in spec.items()}
