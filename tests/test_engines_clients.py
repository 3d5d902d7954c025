"""Client flows over a wrapped model that the other client tests leave out, each against the same
model unwrapped, bit for bit (``torch.equal``), within the budget, with every weight offloaded
(the budget below the largest weight, so ops run in tiles and slices): peft's other adapter kinds
and its adapter life cycle, ``generate`` returning logits and scores, ``resize_token_embeddings``,
``tie_weights`` after wrapping, seq2seq models and a vision model trained, diffusers LoRA
adapters on a wrapped UNet, torchao LoRA training on an int8 base, accelerate's ``Accelerator``,
DDP and ``torch.distributed.checkpoint``. Tiny models built offline."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offtensor as ot

GiB = 1 << 30


def _weight_bytes(model: nn.Module) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}.values())


def _wrap(model: nn.Module, device, fraction=0.3) -> nn.Module:
    ot.wrap_model(model, budget_gb=fraction * _weight_bytes(model) / GiB, device=device, policy={"offload": ["*"]})
    return model


def _within_budget(model: nn.Module) -> None:
    s = ot.stats(model)
    assert s.bytes_h2d > 0, "nothing was paged"
    assert s.peak_device_bytes <= s.budget_bytes, s


def _llama(vocab=128):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )).eval()


def _pair(device):
    model = _llama()
    reference = copy.deepcopy(model).to(device)
    return _wrap(model, device), reference


def _ids(device, batch=2, length=6, vocab=128, seed=1):
    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed)).to(device)
    return ids, torch.ones_like(ids)


def _logits(model, device):
    ids, mask = _ids(device)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def _same_steps(models, device, steps=2, **batch):
    """``steps`` AdamW steps of each model's trainable weights: equal losses at every step."""
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in models]
    for step in range(steps):
        ids, mask = _ids(device, length=8, seed=10 + step)
        losses = []
        for m, opt in zip(models, optimizers):
            torch.manual_seed(step)  # dropout draws the same masks in both
            loss = m(input_ids=ids, attention_mask=mask, labels=ids, **batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses), (step, losses)


# ---------------------------------------------------------------------------- peft


def _peft_configs(peft):
    return {
        "ia3": lambda: peft.IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
        "loha": lambda: peft.LoHaConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False),
        "lokr": lambda: peft.LoKrConfig(r=4, target_modules=["q_proj", "v_proj"], init_weights=False),
        "adalora": lambda: peft.AdaLoraConfig(target_modules=["q_proj", "v_proj"], total_step=10, init_r=4, target_r=2),
        "vera": lambda: peft.VeraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        "boft": lambda: peft.BOFTConfig(boft_block_size=4, target_modules=["q_proj", "v_proj"]),
        "prefix": lambda: peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
        "prompt": lambda: peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4),
    }


@pytest.mark.parametrize("kind", ["ia3", "loha", "lokr", "adalora", "vera", "boft", "prefix", "prompt"])
def test_peft_adapter_kinds_on_a_wrapped_base_train_like_the_unwrapped_run(kind, device):
    peft = pytest.importorskip("peft")
    model, reference = _pair(device)
    config = _peft_configs(peft)[kind]
    models = []
    for base in (model, reference):
        torch.manual_seed(7)  # the adapters' random initialisation, the same in both
        models.append(peft.get_peft_model(base, config()))
    assert torch.equal(_logits(models[0], device), _logits(models[1], device))
    _same_steps(models, device)
    assert torch.equal(_logits(models[0], device), _logits(models[1], device))
    _within_budget(model)


def test_peft_adapter_life_cycle_on_a_wrapped_base(tmp_path, device):
    """``disable_adapter()``, a trained ``modules_to_save`` copy of an offloaded head, two adapters
    switched and deleted, ``save_pretrained`` read back by ``PeftModel.from_pretrained`` onto a
    freshly wrapped base, and ``unload()``."""
    peft = pytest.importorskip("peft")
    model, reference = _pair(device)
    models = []
    for base in (model, reference):
        torch.manual_seed(7)
        m = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"],
                                                      modules_to_save=["lm_head"], init_lora_weights=False))
        torch.manual_seed(8)
        m.add_adapter("other", peft.LoraConfig(r=2, target_modules=["k_proj", "o_proj"], init_lora_weights=False))
        models.append(m)
    _same_steps(models, device, steps=1)
    with models[0].disable_adapter(), models[1].disable_adapter():
        assert torch.equal(_logits(models[0], device), _logits(models[1], device))
    for m in models:
        m.set_adapter("other")
    assert torch.equal(_logits(models[0], device), _logits(models[1], device))
    for m in models:
        m.set_adapter("default")
        m.delete_adapter("other")
    expected = _logits(models[1], device)
    assert torch.equal(_logits(models[0], device), expected)
    models[0].save_pretrained(tmp_path)
    base = _wrap(_llama(), device)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path)
    assert torch.equal(_logits(loaded, device), expected)
    _within_budget(base)
    assert torch.equal(_logits(models[0].unload(), device), _logits(models[1].unload(), device))
    _within_budget(model)


# ---------------------------------------------------------------------------- transformers


def test_generate_returning_logits_and_scores_with_logits_processors_gives_the_unwrapped_ones(device):
    model, reference = _pair(device)
    ids, mask = _ids(device)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, pad_token_id=0, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, output_scores=True, repetition_penalty=1.3, no_repeat_ngram_size=2)
    expected, got = reference.generate(ids, **kwargs), model.generate(ids, **kwargs)
    for field in ("sequences", "logits", "scores"):
        assert torch.equal(torch.stack(list(getattr(got, field))) if field != "sequences" else got.sequences,
                           torch.stack(list(getattr(expected, field))) if field != "sequences" else expected.sequences)
    assert torch.equal(model.compute_transition_scores(got.sequences, got.scores, normalize_logits=True),
                       reference.compute_transition_scores(expected.sequences, expected.scores, normalize_logits=True))
    _within_budget(model)


def test_resize_token_embeddings_tie_weights_and_num_parameters_of_a_wrapped_model(device):
    """The resized tables are drawn from the old ones' mean and covariance: at 30 % with the
    default placement the tables fit the room, so their reductions are bit for bit."""
    model = _llama()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=0.3 * _weight_bytes(model) / GiB, device=device)
    assert model.num_parameters() == reference.num_parameters()
    assert model.num_parameters(exclude_embeddings=True) == reference.num_parameters(exclude_embeddings=True)
    assert model.get_memory_footprint() == reference.get_memory_footprint()
    for m in (model, reference):
        torch.manual_seed(11)
        m.resize_token_embeddings(150, pad_to_multiple_of=64)
    assert model.get_input_embeddings().weight.shape == (192, 64)
    assert torch.equal(model.get_input_embeddings().weight, reference.get_input_embeddings().weight)
    assert torch.equal(_logits(model, device), _logits(reference, device))
    for m in (model, reference):
        m.config.tie_word_embeddings = True
        m.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(_logits(model, device), _logits(reference, device))
    _within_budget(model)


def _seq2seq(kind):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0)).eval()
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=128, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)).eval()


@pytest.mark.parametrize("kind", ["t5", "bart"])
def test_seq2seq_generate_and_training_with_dropout_give_the_unwrapped_results(kind, device):
    model = _seq2seq(kind)
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    ids, mask = _ids(device)
    for mode in (dict(do_sample=False), dict(num_beams=3), dict(do_sample=True, top_k=0)):
        tokens = []
        for m in (model, reference):
            torch.manual_seed(4)
            tokens.append(m.generate(ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, **mode))
        assert torch.equal(*tokens), mode
    for m in (model, reference):
        m.train()
    _same_steps([model, reference], device)
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    _within_budget(model)


def test_a_vision_transformer_forward_and_backward_give_the_unwrapped_hidden_states_and_gradients(device):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, num_labels=5)).eval()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    pixels = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(3)).to(device)
    labels = torch.tensor([1, 3], device=device)
    outputs = []
    for m in (model, reference):
        out = m(pixel_values=pixels, labels=labels, output_hidden_states=True)
        out.loss.backward()
        outputs.append((out.logits, *out.hidden_states, *(p.grad for p in m.parameters())))
    for got, expected in zip(*outputs):
        assert torch.equal(got, expected)
    _within_budget(model)


# ---------------------------------------------------------------------------- diffusers, torchao, accelerate


def _unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8,
    ).eval()


def _lora_state_dict(seed, targets):
    """A LoRA state dict in peft's naming, made in memory on an unwrapped UNet of the same shape."""
    peft = pytest.importorskip("peft")
    unet = _unet()
    torch.manual_seed(seed)
    unet.add_adapter(peft.LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights=False))
    return {k: v.clone() for k, v in peft.utils.get_peft_model_state_dict(unet).items()}


def test_diffusers_lora_adapters_loaded_mixed_fused_and_unfused_on_a_wrapped_unet(device):
    first = _lora_state_dict(1, ["to_q", "to_k", "to_v", "to_out.0"])
    second = _lora_state_dict(2, ["to_k", "to_v", "proj_in"])
    unet = _unet()
    reference = copy.deepcopy(unet).to(device)
    _wrap(unet, device)
    g = torch.Generator().manual_seed(0)
    sample, text = torch.randn(2, 4, 8, 8, generator=g).to(device), torch.randn(2, 7, 32, generator=g).to(device)
    timesteps = torch.tensor([10, 500], device=device)

    def same():
        with torch.no_grad():
            assert torch.equal(unet(sample, timesteps, text).sample, reference(sample, timesteps, text).sample)

    for m in (unet, reference):
        m.load_lora_adapter(dict(first), prefix=None, adapter_name="a")
        m.load_lora_adapter(dict(second), prefix=None, adapter_name="b")
        m.set_adapters(["a", "b"], weights=[0.7, 0.4])
    same()
    for m in (unet, reference):
        m.set_adapters("a")
        m.fuse_lora(lora_scale=0.8)  # writes the offloaded base weights' masters
    same()
    for m in (unet, reference):
        m.unfuse_lora()
        m.disable_lora()
    same()
    _within_budget(unet)


def test_lora_training_on_a_torchao_int8_base_wrapped_gives_the_unwrapped_losses(device):
    pytest.importorskip("torchao")
    peft = pytest.importorskip("peft")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    model = _llama()
    quantize_(model, Int8WeightOnlyConfig())
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=0.3 * _weight_bytes(model) / GiB, device=device)
    assert ot.stats(model).offloaded_bytes > 0
    models = []
    for base in (model, reference):
        torch.manual_seed(7)
        models.append(peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])))
    _same_steps(models, device)
    _within_budget(model)


def test_accelerate_accelerator_prepared_wrapped_model_accumulates_clips_and_saves_state(tmp_path, device):
    accelerate = pytest.importorskip("accelerate")
    if device != "cpu":
        pytest.skip("the Accelerator is run on the CPU here")
    model, reference = _pair(device)
    ids, _ = _ids(device, batch=4, length=8)
    rows = [dict(input_ids=row, labels=row) for row in ids]
    results = []
    for i, m in enumerate((model, reference)):
        accelerate.state.AcceleratorState._reset_state(True)
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
        prepared, optimizer, loader = accelerator.prepare(
            m, torch.optim.AdamW(m.parameters(), lr=1e-2), torch.utils.data.DataLoader(rows, batch_size=1))
        for batch in loader:
            with accelerator.accumulate(prepared):
                accelerator.backward(prepared(**batch).loss)
                accelerator.clip_grad_norm_(prepared.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
        accelerator.save_state(tmp_path / str(i))
        accelerator.load_state(tmp_path / str(i))
        results.append(accelerator.get_state_dict(prepared))
    accelerate.state.AcceleratorState._reset_state(True)
    assert results[0].keys() == results[1].keys()
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    _within_budget(model)


# ---------------------------------------------------------------------------- torch.distributed


def test_ddp_over_a_wrapped_model_and_a_distributed_checkpoint_of_its_optimizer_state(one_rank_mesh, tmp_path, device):
    """DDP (with ``no_sync`` accumulation) steps the wrapped model as the unwrapped one; its model
    and optimizer state through ``get_state_dict``, ``dcp.save``, ``dcp.load`` and
    ``set_state_dict`` into another wrapped model continue the unwrapped run."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.nn.parallel import DistributedDataParallel

    if device != "cpu":
        pytest.skip("a gloo group of one CPU rank")
    model, reference = _pair(device)
    parallel = [DistributedDataParallel(m) for m in (model, reference)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    first, _ = _ids(device, length=8, seed=3)
    second, _ = _ids(device, length=8, seed=4)
    for m, opt in zip(parallel, optimizers):
        with m.no_sync():
            m(input_ids=first, labels=first).loss.backward()
        m(input_ids=second, labels=second).loss.backward()
        opt.step()
        opt.zero_grad()
    weights, state = get_state_dict(model, optimizers[0])
    dcp.save({"model": weights, "optim": state}, checkpoint_id=tmp_path)
    restored = _wrap(_llama(), device)
    optimizer = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    restored(input_ids=first, labels=first).loss.backward()  # a step of its own first: state to overwrite
    optimizer.step()
    optimizer.zero_grad()
    weights, state = get_state_dict(restored, optimizer)
    dcp.load({"model": weights, "optim": state}, checkpoint_id=tmp_path)
    set_state_dict(restored, optimizer, model_state_dict=weights, optim_state_dict=state)
    for m, opt in ((restored, optimizer), (reference, optimizers[1])):
        m(input_ids=first, labels=first).loss.backward()
        opt.step()
    for p, q in zip(restored.parameters(), reference.parameters()):
        assert torch.equal(p, q)
    _within_budget(model)
    _within_budget(restored)
