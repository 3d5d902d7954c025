"""Real clients against their pinned releases (requirements-test.txt): peft LoRA training and
merging, the transformers ``generate`` modes not tested elsewhere, ``Trainer``, ``save_pretrained``
and accelerate's utilities (diffusers models and a whole pipeline are in
tests/test_clients_diffusers.py, on this file's helpers). Each model is tiny, random-initialised offline, wrapped at about 30 % of its weight
bytes on the ``device`` fixture, and compared with an unwrapped deep copy: outputs bit-identical
(``torch.equal``), bytes actually paged, and ``peak_device_bytes`` within the budget.

Covered elsewhere, so not repeated here: greedy ``generate`` (tests/test_transformers_models.py),
static-cache ``generate`` of a compiled model (tests/test_compile.py), ``save_pretrained`` of an
unwrapped model -> ``ot.from_pretrained`` (tests/test_loading_files.py).

accelerate's utilities over a wrapped model (``set_module_tensor_to_device``, ``init_empty_weights``)
re-create parameters through their class, as nn.Parameter's constructor
(``type(p)(data, requires_grad=...)``): an offloaded parameter's class makes what nn.Parameter makes.
accelerate's and diffusers' offloaders over a wrapped model, in both orders, are in
tests/test_other_offloaders.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offtensor as ot
from offtensor.model.copies import state_of

GiB = 1 << 30
BUDGET_FRACTION = 0.3


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}.values())


def _wrap(model: torch.nn.Module, device, budget_bytes=None) -> int:
    """Wrap ``model`` at 30 % of its weight bytes (or ``budget_bytes``); returns the budget."""
    budget_bytes = BUDGET_FRACTION * _weight_bytes(model) if budget_bytes is None else budget_bytes
    ot.wrap_model(model, budget_gb=budget_bytes / GiB, device=device)
    s = ot.stats(model)
    assert s.offloaded_bytes > 0
    return s.budget_bytes


def _paged_within_budget(model: torch.nn.Module) -> None:
    s = ot.stats(model)
    assert s.bytes_h2d > 0, "nothing was paged"
    assert s.peak_device_bytes <= s.budget_bytes, s


def _reference(model: torch.nn.Module, device) -> torch.nn.Module:
    return copy.deepcopy(model).to(device)


# ---------------------------------------------------------------------------- peft

LORA_TARGETS = ["q_proj", "v_proj", "down_proj"]  # down_proj's base weights are offloaded at 30 %


def _llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                                      num_hidden_layers=2, num_key_value_heads=2, intermediate_size=256)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _add_lora(model):
    peft = pytest.importorskip("peft")
    # init_lora_weights=False: B is random too, so the adapters change the logits from step 0.
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def _adapter_bytes() -> int:
    return _weight_bytes(_add_lora(_llama())) - _weight_bytes(_llama())


def _train_lora_and_merge(order, device, room_for_adapters=True):
    """3 AdamW steps of LoRA on a frozen tiny Llama, wrapped in ``order``, against the unwrapped
    run: equal losses at every step, equal adapters, then equal logits after merge_and_unload."""
    base = _llama()
    reference = _add_lora(_reference(base, device))
    if order == "wrap_then_get_peft_model":
        # A model wrapped before it has adapters has no room planned for them: the budget leaves
        # room for their bytes beside 30 % of the base (or none: they must be offloaded).
        _wrap(base, device, BUDGET_FRACTION * _weight_bytes(base) + (_adapter_bytes() if room_for_adapters else 0))
        model, root = _add_lora(base), base  # the PeftModel holds the wrapped model
        offloaded_adapters = [n for n, p in model.named_parameters() if "lora_" in n and isinstance(p, ot.OffloadedTensor)]
        assert bool(offloaded_adapters) != room_for_adapters, offloaded_adapters
    else:
        model = root = _add_lora(base)
        _wrap(model, device)
    offloaded_targets = [n for n, p in model.named_parameters()
                         if isinstance(p, ot.OffloadedTensor) and any(f".{t}.base_layer." in n for t in LORA_TARGETS)]
    assert offloaded_targets  # LoRA runs on offloaded frozen base weights, not only on resident ones
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    initial = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    reference_optimizer = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    reference.train()
    g = torch.Generator().manual_seed(2)
    for step in range(3):
        ids = torch.randint(0, 128, (2, 12), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected = reference(input_ids=ids, labels=ids).loss
        expected.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        assert torch.equal(loss, expected), (step, loss.item(), expected.item())
    adapters = {n: p for n, p in model.named_parameters() if "lora_" in n}
    expected_adapters = {n: p for n, p in reference.named_parameters() if "lora_" in n}
    assert adapters.keys() == expected_adapters.keys()
    for n, p in adapters.items():
        assert torch.equal(p.detach().cpu(), expected_adapters[n].detach().cpu()), n
        assert not torch.equal(p.detach().cpu(), initial[n]), n  # the steps did train it
    _paged_within_budget(root)

    model.eval()
    reference.eval()
    merged, expected_merged = model.merge_and_unload(), reference.merge_and_unload()
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    # the merge wrote the offloaded base weights' masters: they are still offloaded, with merged values
    name = offloaded_targets[0].replace("base_model.model.", "", 1).replace(".base_layer.", ".")
    assert isinstance(merged.get_parameter(name), ot.OffloadedTensor), name
    ids = torch.randint(0, 128, (2, 12), generator=g).to(device)
    with torch.no_grad():
        assert torch.equal(merged(input_ids=ids).logits, expected_merged(input_ids=ids).logits)
    _paged_within_budget(root)


@pytest.mark.parametrize("order", ["wrap_then_get_peft_model", "get_peft_model_then_wrap"])
def test_peft_lora_training_and_merge_equal_the_unwrapped_run(order, device):
    _train_lora_and_merge(order, device)


def test_peft_lora_adapters_offloaded_for_want_of_room_train_like_the_unwrapped_run(device):
    """At exactly 30 % of the base, wrapped first, the adapters peft assigns are offloaded; peft's
    ``module.to(weight.device)`` then swaps every OffloadedTensor parameter (swap_tensors), which
    refused while ``model.state.Placed`` held a weak reference to the placed tensor."""
    _train_lora_and_merge("wrap_then_get_peft_model", device, room_for_adapters=False)


class _LoRAShaped(torch.nn.Module):
    """What peft's LoRA layer is to the module tree: it replaces a Linear and holds it as ``base_layer``."""

    def __init__(self, base_layer: torch.nn.Linear, rank: int):
        super().__init__()
        self.base_layer = base_layer
        self.lora_A = torch.nn.Linear(base_layer.in_features, rank, bias=False)
        self.lora_B = torch.nn.Linear(rank, base_layer.out_features, bias=False)

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(x))


def test_a_module_replaced_by_one_that_holds_it_keeps_counting_its_resident_weights(device):
    """peft's pattern: ``setattr(parent, "q_proj", LoraLayer(base_layer=q_proj))`` on a wrapped model.
    The resident q_proj weight stays in the model, so new adapter weights that do not fit beside it
    and the paging room are offloaded, not kept (which overran the budget at the next forward)."""
    model, reference = _tiny_llama(device)
    attention = model.model.layers[0].self_attn
    assert not isinstance(attention.q_proj.weight, ot.OffloadedTensor)
    s = ot.stats(model)
    free = s.budget_bytes - s.resident_bytes - state_of(model).working_set_bytes
    rank = free // ((attention.q_proj.in_features + attention.q_proj.out_features) * 4) + 1  # just too big to keep
    torch.manual_seed(3)
    attention.q_proj = _LoRAShaped(attention.q_proj, rank)
    reference.model.layers[0].self_attn.q_proj = _LoRAShaped(reference.model.layers[0].self_attn.q_proj, rank).to(device)
    reference.model.layers[0].self_attn.q_proj.load_state_dict(
        {k: v.detach().cpu() for k, v in attention.q_proj.state_dict().items()})
    assert not isinstance(attention.q_proj.base_layer.weight, ot.OffloadedTensor)
    assert isinstance(attention.q_proj.lora_A.weight, ot.OffloadedTensor) or isinstance(
        attention.q_proj.lora_B.weight, ot.OffloadedTensor)
    ids, mask = _prompt(device)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)
    _paged_within_budget(model)


# ---------------------------------------------------------------------------- generate


def _tiny_llama(device):
    pytest.importorskip("transformers")
    from offtensor.models.tiny import tiny_transformers

    model = tiny_transformers("llama")  # two layers, tied embeddings, 128-token vocabulary
    reference = _reference(model, device)
    _wrap(model, device)
    return model, reference


def _prompt(device, batch=2):
    ids = torch.randint(0, 128, (batch, 6), generator=torch.Generator().manual_seed(1)).to(device)
    return ids, torch.ones_like(ids)


GENERATE_MODES = {
    "sampling": dict(do_sample=True, top_k=0),  # the full distribution, so every logit's last bit can matter
    "beam_search": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "beam_sample": dict(do_sample=True, num_beams=3, top_k=0),
    "no_cache": dict(do_sample=False, use_cache=False),  # every step runs the whole sequence again
    "static_cache": dict(do_sample=False, cache_implementation="static"),  # eager; test_compile.py compiles it
}


@pytest.mark.parametrize("mode", list(GENERATE_MODES))
def test_generate_mode_gives_the_unwrapped_tokens(mode, device):
    model, reference = _tiny_llama(device)
    ids, mask = _prompt(device)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, **GENERATE_MODES[mode])
    torch.manual_seed(5)
    expected = reference.generate(ids, **kwargs)
    torch.manual_seed(5)
    got = model.generate(ids, **kwargs)
    rows = 2 * kwargs.get("num_return_sequences", 1)
    assert expected.shape == (rows, 12)
    assert torch.equal(got, expected)
    _paged_within_budget(model)


def test_assisted_generate_with_a_wrapped_assistant_gives_the_unwrapped_tokens(device):
    """Speculative decoding: a wrapped 1-layer assistant drafts, the wrapped model verifies several
    tokens per forward (cache rolled back on rejection); tokens equal the unwrapped pair's and greedy's."""
    transformers = pytest.importorskip("transformers")
    model, reference = _tiny_llama(device)
    torch.manual_seed(0)
    assistant = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, num_attention_heads=2, max_position_embeddings=64, num_hidden_layers=1,
        num_key_value_heads=1, intermediate_size=64, tie_word_embeddings=True,
    )).eval()
    reference_assistant = _reference(assistant, device)
    _wrap(assistant, device)
    ids, _ = _prompt(device, batch=1)  # assisted generation takes one sequence
    kwargs = dict(do_sample=False, max_new_tokens=8, min_new_tokens=8, pad_token_id=0)
    expected = reference.generate(ids, assistant_model=reference_assistant, **kwargs)
    got = model.generate(ids, assistant_model=assistant, **kwargs)
    assert expected.shape == (1, 14)
    assert torch.equal(got, expected)
    assert torch.equal(got, reference.generate(ids, **kwargs))  # assisted greedy is greedy
    # Prompt lookup: the drafts are n-grams of the prompt, verified by the wrapped model the same way.
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=2, **kwargs), expected)
    _paged_within_budget(model)
    _paged_within_budget(assistant)


def test_transformers_trainer_with_its_default_fused_adamw_trains_a_wrapped_model_like_the_unwrapped_one(tmp_path, device):
    """Trainer's default optimizer is torch's fused AdamW: one ``_fused_adamw_`` over every weight,
    which offtensor runs weight by weight when the offloaded ones do not fit the budget together."""
    from transformers import Trainer, TrainingArguments

    model, reference = _tiny_llama(device)
    ids, _ = _prompt(device)
    rows = [dict(input_ids=row.cpu(), labels=row.cpu()) for row in ids.repeat(2, 1)]
    for m in (model, reference):
        args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to=[],
                                 save_strategy="no", seed=0, data_seed=0, use_cpu=device == "cpu")
        assert args.optim == "adamw_torch_fused"
        # The method's name moved between the pinned transformers releases (the GPU machine's is older).
        (getattr(m, "activation_checkpointing_enable", None) or m.gradient_checkpointing_enable)()
        Trainer(model=m, args=args, train_dataset=rows).train()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())
    _paged_within_budget(model)


# ---------------------------------------------------------------------------- save_pretrained


def test_save_pretrained_of_a_wrapped_model_then_from_pretrained_gives_the_unwrapped_logits(tmp_path, device):
    """transformers' save_pretrained reads the state dict of a wrapped model (offloaded weights
    written from their host masters, the tied embedding once); ot.from_pretrained loads it back."""
    model, reference = _tiny_llama(device)
    model.save_pretrained(tmp_path)
    assert any(f.endswith(".safetensors") for f in map(str, tmp_path.iterdir()))
    assert ot.stats(model).bytes_h2d == 0  # saving read the masters, paged nothing
    loaded = ot.from_pretrained(tmp_path, budget_gb=ot.stats(model).budget_bytes / GiB, device=device, progress=False)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert ot.stats(loaded).offloaded_bytes > 0
    ids, mask = _prompt(device)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(loaded(input_ids=ids, attention_mask=mask).logits, expected)
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)
    _paged_within_budget(loaded)


# ---------------------------------------------------------------------------- accelerate


def _offloaded_linear(model: torch.nn.Module) -> torch.nn.Module:
    """The first ``nn.Linear`` of ``model`` whose weight is offloaded."""
    return next(m for m in model.modules() if isinstance(m, torch.nn.Linear) and isinstance(m.weight, ot.OffloadedTensor))


def test_offloaded_parameter_class_called_like_nn_parameter_makes_what_nn_parameter_makes(device):
    """``type(p)(data, requires_grad=...)``: of a plain tensor a plain Parameter (not an
    OffloadedTensor without a host master), of an OffloadedTensor a Parameter alias of its master;
    a caller's extra keywords (accelerate passes the old parameter's ``__dict__``) are not kept."""
    model, _ = _tiny_llama(device)
    weight = _offloaded_linear(model).weight
    plain = torch.randn(3, 4, device=device)
    made = type(weight)(plain, requires_grad=False, **weight.__dict__)
    assert type(made) is torch.nn.Parameter and not made.requires_grad
    assert made.data_ptr() == plain.data_ptr() and not hasattr(made, "_master")
    alias = type(weight)(weight, requires_grad=False)
    assert isinstance(alias, ot.OffloadedTensor) and isinstance(alias, torch.nn.Parameter)
    assert alias._master is weight._master and not alias.requires_grad and weight.requires_grad
    assert torch.equal(alias, weight)


def test_accelerate_set_module_tensor_to_device_to_meta_and_back_keeps_the_logits(device):
    """accelerate moves a parameter to meta and back from a kept value (its offload hooks' step):
    the offloaded weight comes back as an alias of its master, paged as before."""
    pytest.importorskip("accelerate")
    from accelerate.utils import set_module_tensor_to_device

    model, reference = _tiny_llama(device)
    linear = _offloaded_linear(model)
    weight = linear.weight
    set_module_tensor_to_device(linear, "weight", "meta")
    assert linear.weight.is_meta and type(linear.weight) is torch.nn.Parameter
    set_module_tensor_to_device(linear, "weight", device, value=weight)
    assert isinstance(linear.weight, ot.OffloadedTensor) and linear.weight._master is weight._master
    ids, mask = _prompt(device)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           reference(input_ids=ids, attention_mask=mask).logits)


def test_accelerate_init_empty_weights_puts_an_offloaded_parameter_registered_under_it_on_meta(device):
    """As for a plain parameter: registered under ``init_empty_weights`` it becomes a meta Parameter."""
    pytest.importorskip("accelerate")
    from accelerate import init_empty_weights

    model, _ = _tiny_llama(device)
    weight = _offloaded_linear(model).weight
    holder = torch.nn.Module()
    with init_empty_weights():
        holder.register_parameter("weight", weight)
    assert type(holder.weight) is torch.nn.Parameter and holder.weight.is_meta
    assert holder.weight.shape == weight.shape and holder.weight.requires_grad == weight.requires_grad


def test_wrapping_a_model_that_accelerate_offloads_is_refused_naming_the_module(device):
    """cpu_offload leaves the weights on meta and fills them at each forward: a second offloader of
    the same weights is refused before anything moves; the model still runs as accelerate's."""
    pytest.importorskip("accelerate")
    from accelerate import cpu_offload

    from offtensor.models.tiny import tiny_transformers

    model = tiny_transformers("llama")
    reference = _reference(model, device)
    cpu_offload(model, execution_device=torch.device(device))
    with pytest.raises(ValueError, match=r"Embedding 'model.embed_tokens' of LlamaForCausalLM has its weights "
                                         r"offloaded by accelerate's hooks.*Nothing was changed"):
        ot.wrap_model(model, budget_gb=1e-4, device=device)
    ids, mask = _prompt(device)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                           reference(input_ids=ids, attention_mask=mask).logits)


def test_wrapping_a_from_pretrained_disk_offloaded_model_is_refused_naming_its_device_map(tmp_path, device):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from offtensor.models.tiny import tiny_transformers

    tiny_transformers("llama").save_pretrained(tmp_path / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "model", device_map="auto", max_memory={"cpu": 1}, offload_folder=str(tmp_path / "offload"))
    with pytest.raises(ValueError, match=r"offloaded by accelerate's hooks \(hf_device_map \{'': 'disk'\}\)"):
        ot.wrap_model(model, budget_gb=1e-4, device=device)
