"""Other offloaders and dispatchers with a wrapped model, in both orders, on the pinned accelerate,
diffusers and transformers. Each combination either runs bit-identically to the unwrapped model
(and ``ot.unwrap_model`` gives back whole, correct weights), or is refused at the call that would
go wrong, naming the model and the bytes, with nothing moved.

On the emulated device several of these offloaders move nothing (their CPU is offtensor's
device), but on a GPU they would copy whole weights onto the device outside the budget, or leave
meta placeholders that ``ot.unwrap_model`` gives back: they are refused on every device, so the
refusals are proven here. A move to another device is shown with ``meta`` or ``cuda:1``, which
take the same path as a GPU model's ``.cpu()``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offtensor as ot

GiB = 1 << 30
BUDGET_FRACTION = 0.3


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}.values())


def _wrap(model: torch.nn.Module, device) -> None:
    ot.wrap_model(model, budget_gb=BUDGET_FRACTION * _weight_bytes(model) / GiB, device=device)
    assert ot.stats(model).offloaded_bytes > 0


def _llama(device):
    """A tiny Llama (two layers, tied embeddings), wrapped at 30 %, and its unwrapped copy."""
    pytest.importorskip("transformers")
    from offtensor.models.tiny import tiny_transformers

    model = tiny_transformers("llama")
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    return model, reference


def _logits(model, device):
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits


def _params(model) -> dict:
    return dict(model.named_parameters(remove_duplicate=False))


def _assert_untouched(model, reference, params, device) -> None:
    """No accelerate or diffusers hook on any module, the same Parameter objects, the unwrapped
    logits, and after ``ot.unwrap_model`` whole weights equal to the reference's."""
    assert not any("_hf_hook" in m.__dict__ or "_diffusers_hook" in m.__dict__ for m in model.modules())
    assert all(_params(model)[n] is p for n, p in params.items())
    assert torch.equal(_logits(model, device), _logits(reference, device))
    s = ot.stats(model)
    assert s.peak_device_bytes <= s.budget_bytes
    _assert_unwraps_whole(model, reference)


def _assert_unwraps_whole(model, reference) -> None:
    ot.unwrap_model(model)
    expected = reference.state_dict()
    for name, t in model.state_dict().items():
        assert type(t) is torch.Tensor and not t.is_meta, name
        assert torch.equal(t, expected[name]), name


# ---------------------------------------------------------------------------- accelerate, after wrapping


def _accelerate():
    return pytest.importorskip("accelerate")


def _offload_by(how, model, device, tmp_path):
    accelerate = _accelerate()
    from accelerate.hooks import attach_align_device_hook, attach_align_device_hook_on_blocks

    execution = torch.device(device)
    if how == "cpu_offload":
        accelerate.cpu_offload(model, execution_device=execution)
    elif how == "disk_offload":
        accelerate.disk_offload(model, str(tmp_path / "offload"), execution_device=execution)
    elif how == "attach_align_device_hook":
        attach_align_device_hook(model, execution_device=execution, offload=True)
    elif how == "attach_align_device_hook_on_blocks":
        attach_align_device_hook_on_blocks(model, execution_device=execution, offload=True)
    else:  # a device map with an entry on disk (on a GPU, "cpu" entries are offloaded the same way)
        device_map = {"model.embed_tokens": device, "model.layers.0": "disk", "model.layers.1": device,
                      "model.norm": device, "model.rotary_emb": device, "lm_head": device}
        accelerate.dispatch_model(model, device_map, main_device=device, offload_dir=str(tmp_path / "offload"))


@pytest.mark.parametrize("how", ["cpu_offload", "disk_offload", "attach_align_device_hook",
                                 "attach_align_device_hook_on_blocks", "dispatch_model"])
def test_accelerate_offloading_a_wrapped_model_is_refused_before_it_attaches_a_hook(how, device, tmp_path):
    """Before: accelerate's hooks replaced every weight with a meta placeholder and kept their values
    in a weights map of its own; forwards put each weight on the device whole, outside the budget,
    and ``ot.unwrap_model`` gave back the meta placeholders. Now its first hook is refused."""
    model, reference = _llama(device)
    params = _params(model)
    with pytest.raises(RuntimeError, match=rf"accelerate's {how} would offload this LlamaForCausalLM, which is "
                                           r"wrapped: \d+ of its weights are offloaded by offtensor already, such as "
                                           r"'model\.[\w.]+' \(\d+ bytes\).*ot\.unwrap_model\(model\) first.*"
                                           r"Nothing was moved"):
        _offload_by(how, model, device, tmp_path)
    _assert_untouched(model, reference, params, device)


def test_accelerate_model_offloading_of_a_wrapped_model_is_refused(device):
    """``cpu_offload_with_hook`` (diffusers' ``enable_model_cpu_offload``) moves the whole model to
    the CPU after use and back before the next: on a GPU the whole wrapped model, outside the budget."""
    accelerate = _accelerate()
    model, reference = _llama(device)
    params = _params(model)
    with pytest.raises(RuntimeError, match=r"accelerate's model offloading \(cpu_offload_with_hook.*would move this "
                                           r"LlamaForCausalLM, which is wrapped.*bytes.*Nothing was moved"):
        accelerate.cpu_offload_with_hook(model, execution_device=device)
    _assert_untouched(model, reference, params, device)


def test_accelerate_hooks_that_move_no_offloaded_weight_run_on_a_wrapped_model_and_come_off(device):
    """Hooks that keep each module's weights on the device they are wrapped for (inputs moved to
    it, a single-device dispatch) run as on the unwrapped model, and are removed as usual."""
    accelerate = _accelerate()
    from accelerate.hooks import attach_align_device_hook, remove_hook_from_submodules

    model, reference = _llama(device)
    accelerate.dispatch_model(model, {"": device})  # one device: moves the model to it, no hooks
    attach_align_device_hook(model, execution_device=torch.device(device))
    assert "_hf_hook" in model.model.layers[0].mlp.gate_proj.__dict__
    assert torch.equal(_logits(model, device), _logits(reference, device))
    remove_hook_from_submodules(model)
    assert not any("_hf_hook" in m.__dict__ for m in model.modules())
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _assert_unwraps_whole(model, reference)


def test_accelerate_offloading_a_module_offtensor_keeps_resident_runs_and_comes_off(device):
    """``cpu_offload`` of a module none of whose weights offtensor offloaded: accelerate takes over
    its weights, as it would in an unwrapped model, and gives them back when its hooks are removed."""
    accelerate = _accelerate()
    from accelerate.hooks import remove_hook_from_submodules

    model, reference = _llama(device)
    norm = model.model.norm
    assert not isinstance(norm.weight, ot.OffloadedTensor)
    accelerate.cpu_offload(norm, execution_device=torch.device(device))
    assert norm.weight.is_meta  # accelerate's placeholder between forwards
    assert torch.equal(_logits(model, device), _logits(reference, device))
    remove_hook_from_submodules(norm)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _assert_unwraps_whole(model, reference)


def test_an_accelerate_hook_that_would_move_offloaded_weights_to_another_device_is_refused(device):
    """An execution-device hook moves its module's weights to that device when attached (a
    dispatch over several devices does so per module): an offloaded weight would be copied there
    whole. ``meta`` stands in for a second GPU."""
    _accelerate()
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model, reference = _llama(device)
    params = _params(model)
    linear = model.model.layers[0].mlp.gate_proj
    assert isinstance(linear.weight, ot.OffloadedTensor)
    with pytest.raises(RuntimeError, match=r"accelerate's add_hook_to_module would move the weights of Linear "
                                           r"'model\.layers\.0\.mlp\.gate_proj' of LlamaForCausalLM to meta, but it is "
                                           r"wrapped for .*'weight' \(\d+ bytes\).*Nothing was moved"):
        add_hook_to_module(linear, AlignDevicesHook(execution_device="meta"))
    _assert_untouched(model, reference, params, device)


# ---------------------------------------------------------------------------- accelerate, before wrapping


def _plain_llama(device):
    pytest.importorskip("transformers")
    from offtensor.models.tiny import tiny_transformers

    model = tiny_transformers("llama")
    return model, copy.deepcopy(model).to(device)


def test_wrapping_a_model_under_accelerate_model_offloading_is_refused_until_its_hook_is_removed(device):
    accelerate = _accelerate()
    model, reference = _plain_llama(device)
    _, hook = accelerate.cpu_offload_with_hook(model, execution_device=device)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM '' of LlamaForCausalLM is under accelerate's model "
                                         r"offloading.*hook\.remove\(\).*Nothing was changed"):
        _wrap(model, device)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in model.parameters())
    hook.remove()
    _wrap(model, device)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _assert_unwraps_whole(model, reference)


def test_a_model_whose_accelerate_hooks_move_nothing_wraps_and_its_hooks_come_off_after(device):
    _accelerate()
    from accelerate.hooks import attach_align_device_hook, remove_hook_from_submodules

    model, reference = _plain_llama(device)
    attach_align_device_hook(model, execution_device=torch.device(device))
    _wrap(model, device)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    remove_hook_from_submodules(model)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _assert_unwraps_whole(model, reference)


def test_wrapping_a_model_dispatched_to_another_device_is_refused_naming_the_module(device):
    """A module whose accelerate hook runs it on another device (``meta`` stands in for a second
    GPU of a multi-GPU device_map) would get its inputs there and its weights on the wrap's device."""
    _accelerate()
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    model, _ = _plain_llama(device)
    add_hook_to_module(model.model.layers[1], AlignDevicesHook(execution_device="meta", place_submodules=True))
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer 'model\.layers\.1' of LlamaForCausalLM is dispatched by "
                                         r"accelerate to meta.*Nothing was changed"):
        _wrap(model, device)
    assert not any(isinstance(p, ot.OffloadedTensor) for p in model.parameters())


def test_a_model_whose_accelerate_offloading_was_removed_wraps(device):
    accelerate = _accelerate()
    from accelerate.hooks import remove_hook_from_submodules

    model, reference = _plain_llama(device)
    accelerate.cpu_offload(model, execution_device=torch.device(device))
    remove_hook_from_submodules(model)  # the weights come back from accelerate's map
    _wrap(model, device)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _assert_unwraps_whole(model, reference)


@pytest.mark.parametrize("how", ["from_pretrained", "load_checkpoint_and_dispatch"])
def test_a_model_loaded_onto_one_device_by_a_device_map_wraps(how, device, tmp_path):
    """``from_pretrained(device_map={"": device})`` and ``init_empty_weights`` +
    ``load_checkpoint_and_dispatch`` onto one device attach no offloading hooks: the model wraps
    and gives the logits of the model it was saved from."""
    transformers = pytest.importorskip("transformers")
    accelerate = _accelerate()
    model, reference = _plain_llama(device)
    model.save_pretrained(tmp_path / "model")
    if how == "from_pretrained":
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map={"": device})
    else:
        with accelerate.init_empty_weights():
            loaded = transformers.AutoModelForCausalLM.from_config(model.config)
        loaded.tie_weights()  # the checkpoint stores the tied embedding once
        loaded = accelerate.load_checkpoint_and_dispatch(loaded, str(tmp_path / "model"), device_map={"": device})
    _wrap(loaded.eval(), device)
    assert torch.equal(_logits(loaded, device), _logits(reference, device))
    _assert_unwraps_whole(loaded, reference)


# ---------------------------------------------------------------------------- moves


@pytest.mark.parametrize("target", ["meta", "cuda:1", "cpu"])
def test_moving_a_wrapped_model_to_another_device_is_refused_before_anything_moves(target, device):
    """torch's own path would turn every offloaded weight into a plain tensor on the target device
    (for ``.cpu()`` of a model wrapped for a GPU: the whole model, its host masters dropped) while
    the model stays wrapped for its device. To its own device it stays a no-op."""
    model, reference = _llama(device)
    params = _params(model)
    if torch.device(target) == torch.device(device):
        model.to(target)  # the emulated device's .cpu(): nothing to move
    else:
        with pytest.raises(RuntimeError, match=rf"moving a wrapped model to the {target} device is not supported "
                                               r"\(\d+ of its weights are offloaded for .*ot\.unwrap_model\(model\).*"
                                               r"Nothing was moved"):
            model.to(target)
    _assert_untouched(model, reference, params, device)


# ---------------------------------------------------------------------------- diffusers


from test_clients_diffusers import _diffusers, _unet  # noqa: E402  (the tiny UNet the clients tests use)


def _noise(unet, device):
    g = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 8, 8, generator=g).to(device), torch.randn(2, 7, 32, generator=g).to(device)
    with torch.no_grad():
        return unet(sample, torch.tensor([10, 500], device=device), text).sample


@pytest.mark.parametrize("how", ["enable_group_offload", "apply_group_offloading_leaf_level", "to_disk"])
def test_diffusers_group_offloading_of_a_wrapped_model_is_refused_before_it_builds_a_group(how, device, tmp_path):
    """Before: on the emulated device group offloading looked harmless (its CPU is offtensor's
    device), on a GPU it moved each group's weights to the device whole at each forward; offloaded
    to disk, ``ot.unwrap_model`` gave back emptied weights. Now it is refused before any group."""
    _diffusers()
    from diffusers.hooks import apply_group_offloading

    unet, reference = _unet(), _unet().to(device)
    _wrap(unet, device)
    params = _params(unet)
    onload = torch.device(device)
    with pytest.raises(RuntimeError, match=r"diffusers' group offloading .*would offload this UNet2DConditionModel, "
                                           r"which is wrapped: \d+ of its weights .* \(\d+ bytes\).*exclude_modules.*"
                                           r"Nothing was moved"):
        if how == "enable_group_offload":
            unet.enable_group_offload(onload_device=onload, offload_type="block_level", num_blocks_per_group=1)
        elif how == "apply_group_offloading_leaf_level":
            apply_group_offloading(unet, onload_device=onload, offload_type="leaf_level")
        else:
            unet.enable_group_offload(onload_device=onload, offload_type="leaf_level",
                                      offload_to_disk_path=str(tmp_path / "groups"))
    assert not any("_diffusers_hook" in m.__dict__ for m in unet.modules())
    assert all(_params(unet)[n] is p for n, p in params.items())
    assert torch.equal(_noise(unet, device), _noise(reference, device))
    _assert_unwraps_whole(unet, reference)


def _flux_pipeline(device):
    """A tiny FluxPipeline (CLIP and T5 encoders, Flux transformer, VAE; offline word-level
    tokenizers) and an unwrapped copy of it."""
    diffusers, transformers, tokenizers = _diffusers(), pytest.importorskip("transformers"), pytest.importorskip("tokenizers")
    vocab = {w: i for i, w in enumerate("<pad> <s> </s> <unk> a an photo of astronaut riding horse moon".split())}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                                     eos_token="</s>", unk_token="<unk>", model_max_length=8)
    torch.manual_seed(0)
    models = dict(
        text_encoder=transformers.CLIPTextModel(transformers.CLIPTextConfig(
            vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=8, projection_dim=32, pad_token_id=0, bos_token_id=1, eos_token_id=2)).eval(),
        text_encoder_2=transformers.T5EncoderModel(transformers.T5Config(
            vocab_size=len(vocab), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            relative_attention_num_buckets=8)).eval(),
        transformer=diffusers.FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval(),
        vae=diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
            up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(32, 64), layers_per_block=1,
            latent_channels=4, norm_num_groups=8, sample_size=16, scaling_factor=1.5, shift_factor=0.06).eval(),
    )

    def pipeline(components):
        pipe = diffusers.FluxPipeline(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), tokenizer=tokenizer,
                                      tokenizer_2=copy.deepcopy(tokenizer), **components)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    reference = pipeline({k: copy.deepcopy(m).to(device) for k, m in models.items()})
    return pipeline({k: m.to(device) for k, m in models.items()}), reference


def _image(pipe):
    return pipe(prompt="a photo of an astronaut riding a horse", height=16, width=16, num_inference_steps=2,
                guidance_scale=1.0, max_sequence_length=8, output_type="pt",
                generator=torch.Generator().manual_seed(3)).images


@pytest.mark.parametrize("how", ["enable_model_cpu_offload", "enable_sequential_cpu_offload"])
def test_a_pipelines_cpu_offloading_is_refused_before_it_hooks_any_component_when_one_is_wrapped(how, device):
    """The pipeline hooks its components one by one; it is refused where it first asks them for
    hooks, so none is hooked and the pipeline runs as before. A component left out of sequential
    offloading (``_exclude_from_cpu_offload``) is moved to the device, where a wrapped model already
    is, and not refused."""
    pipe, reference = _flux_pipeline(device)
    _wrap(pipe.transformer, device)
    with pytest.raises(RuntimeError, match=rf"FluxPipeline\.{how} would hook its component 'transformer', a wrapped "
                                           r"FluxTransformer2DModel: \d+ of its weights .* \(\d+ bytes\).*"
                                           r"No component was hooked"):
        getattr(pipe, how)(device=device)
    assert not any("_hf_hook" in m.__dict__ for c in pipe.components.values() if isinstance(c, torch.nn.Module)
                   for m in c.modules())
    assert torch.equal(_image(pipe), _image(reference))
    if how == "enable_sequential_cpu_offload":
        pipe._exclude_from_cpu_offload = ["transformer"]
        pipe.enable_sequential_cpu_offload(device=device)
        assert "_hf_hook" in pipe.vae.__dict__ and not any("_hf_hook" in m.__dict__ for m in pipe.transformer.modules())
        assert ot.stats(pipe.transformer).offloaded_bytes > 0


def test_a_pipelines_group_offloading_leaves_out_a_wrapped_component_it_is_told_to(device):
    """``pipe.enable_group_offload`` reaching the wrapped transformer is refused; with
    ``exclude_modules=["transformer"]`` the other components are group offloaded and the pipeline
    gives the unwrapped image."""
    pipe, reference = _flux_pipeline(device)
    _wrap(pipe.transformer, device)
    onload = torch.device(device)
    with pytest.raises(RuntimeError, match=r"group offloading .*would offload this FluxTransformer2DModel"):
        pipe.enable_group_offload(onload_device=onload, offload_type="block_level", num_blocks_per_group=1)
    assert not any("_diffusers_hook" in m.__dict__ for m in pipe.transformer.modules())

    pipe, reference = _flux_pipeline(device)
    _wrap(pipe.transformer, device)
    pipe.enable_group_offload(onload_device=onload, offload_type="block_level", num_blocks_per_group=1,
                              exclude_modules=["transformer"])
    assert any("_diffusers_hook" in m.__dict__ for m in pipe.vae.modules())
    assert torch.equal(_image(pipe), _image(reference))
    assert ot.stats(pipe.transformer).bytes_h2d > 0


@pytest.mark.parametrize("how", ["enable_model_cpu_offload", "enable_sequential_cpu_offload"])
def test_wrapping_a_component_of_a_cpu_offloaded_pipeline_is_refused(how, device):
    pipe, _ = _flux_pipeline(device)
    getattr(pipe, how)(device=device)
    what = "under accelerate's model offloading" if how == "enable_model_cpu_offload" else "offloaded by accelerate's hooks"
    with pytest.raises(ValueError, match=rf"of FluxTransformer2DModel (is|has its weights) {what}.*Nothing was changed"):
        _wrap(pipe.transformer, device)
