"""More clients over a wrapped model, each against the same model unwrapped, bit for bit
(``torch.equal``): peft adapters on stacked MoE experts, DoRA and several adapters mixed; ``generate`` returning attentions and hidden states,
``save_pretrained`` read back by plain transformers; torch's
parametrizations registered after wrapping; ``torch.export``'s
``run_decompositions``. Tiny models built offline, as in tests/test_clients.py."""

from __future__ import annotations

import copy

import pytest
import torch

import offtensor as ot

GiB = 1 << 30


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum({id(t): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}.values())


def _wrap(model: torch.nn.Module, device, fraction=0.3) -> None:
    ot.wrap_model(model, budget_gb=fraction * _weight_bytes(model) / GiB, device=device)
    assert ot.stats(model).offloaded_bytes > 0


def _paged_within_budget(model: torch.nn.Module) -> None:
    s = ot.stats(model)
    assert s.bytes_h2d > 0, "nothing was paged"
    assert s.peak_device_bytes <= s.budget_bytes, s


def _ids(device, batch=2):
    ids = torch.randint(0, 128, (batch, 6), generator=torch.Generator().manual_seed(1)).to(device)
    return ids, torch.ones_like(ids)


def _same_logits(model, reference, device) -> None:
    ids, mask = _ids(device)
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask).logits
        assert torch.equal(model(input_ids=ids, attention_mask=mask).logits, expected)


def _same_training(model, reference, device, steps=2) -> None:
    """``steps`` AdamW steps of each model's trainable weights: equal losses at every step."""
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, reference)]
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        ids = torch.randint(0, 128, (2, 8), generator=g).to(device)
        losses = []
        for m, optimizer in zip((model, reference), optimizers):
            loss = m(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss)
        assert torch.equal(*losses), (step, losses)


def _tiny(name, device):
    pytest.importorskip("transformers")
    from offtensor.models.tiny import tiny_transformers

    model = tiny_transformers(name)
    return model, copy.deepcopy(model).to(device)


# ---------------------------------------------------------------------------- peft


def test_peft_lora_on_stacked_moe_experts_trains_like_the_unwrapped_run(device):
    """peft's ``target_parameters`` LoRA on a stacked expert weight computes ``baddbmm(W, A, B)``
    over the whole stack at every forward, where the rest of the model reads it one routed expert
    at a time, so wrap left no room for the stack. It paged the stack whole and raised BudgetError
    at the first forward of a budget wrap accepted; now baddbmm runs in tiles of the batches."""
    peft = pytest.importorskip("peft")
    model, reference = _tiny("qwen3_moe", device)

    def config():
        return peft.LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights=False,
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

    torch.manual_seed(1)
    model = peft.get_peft_model(model, config())
    torch.manual_seed(1)
    reference = peft.get_peft_model(reference, config())
    _wrap(model, device)
    stacks = [p for n, p in model.named_parameters() if n.endswith("experts.base_layer.base_layer.gate_up_proj")]
    assert stacks and all(isinstance(p, ot.OffloadedTensor) for p in stacks)
    s = ot.stats(model)
    assert stacks[0].numel() * stacks[0].element_size() > s.budget_bytes - s.resident_bytes  # never fits whole
    _same_logits(model, reference, device)
    model.train()
    reference.train()
    _same_training(model, reference, device)
    model.eval()
    reference.eval()
    _same_logits(model, reference, device)
    _paged_within_budget(model)


def _stacked_lora(model, adapters):
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    config = dict(r=4, target_modules=["q_proj"], init_lora_weights=False,
                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = peft.get_peft_model(model, peft.LoraConfig(**config), adapter_name=adapters[0])
    for name in adapters[1:]:
        model.add_adapter(name, peft.LoraConfig(**config))
    return model


@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_several_peft_adapters_active_on_stacked_experts_run_at_every_budget_wrap_accepts(device, fraction):
    """With several adapters active on a ``target_parameters`` weight, peft sums their deltas into
    one tensor the size of the whole stack at every forward and holds it on a parametrization
    module registered for that forward. That tensor was counted as a resident weight, so at 0.3 of
    the weights and below the forward raised BudgetError; it is counted as activations are, and
    ``W + delta`` runs in slices: logits and two training steps equal the unwrapped run's."""
    model, reference = _tiny("qwen3_moe", device)
    model, reference = _stacked_lora(model, ["a", "b"]), _stacked_lora(reference, ["a", "b"])
    _wrap(model, device, fraction)
    for m in (model, reference):
        m.base_model.set_adapter(["a", "b"])
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".experts.base_layer.lora_A.a." in n for n in trained)
    assert any(".experts.base_layer.lora_A.b." in n for n in trained)
    _same_logits(model, reference, device)
    model.train()
    reference.train()
    _same_training(model, reference, device)
    _paged_within_budget(model)


def test_merged_peft_adapter_on_stacked_experts_writes_the_offloaded_stack_and_unmerges(device):
    """``merge_adapter`` of a ``target_parameters`` LoRA adds its delta into the offloaded stack's
    master (``param.data += delta``) and ``unmerge_adapter`` takes it out: logits equal the
    unwrapped model's both ways, within the budget."""
    model, reference = _tiny("qwen3_moe", device)
    model, reference = _stacked_lora(model, ["a"]), _stacked_lora(reference, ["a"])
    _wrap(model, device)
    stack = next(p for n, p in model.named_parameters() if n.endswith("experts.base_layer.base_layer.gate_up_proj"))
    before = stack.detach().clone()
    for m in (model, reference):
        m.merge_adapter()
    assert isinstance(stack, ot.OffloadedTensor) and not torch.equal(stack, before)
    _same_logits(model, reference, device)
    for m in (model, reference):
        m.unmerge_adapter()
    _same_logits(model, reference, device)
    _paged_within_budget(model)


class _AddDelta(torch.nn.Module):
    """A parametrization as peft's ``_LoraParameterProxy``: ``W + self.delta``, the delta a plain attribute."""

    def __init__(self, delta):
        super().__init__()
        self.delta = delta

    def forward(self, w):
        return w + self.delta


def test_a_tensor_assigned_to_a_parametrization_of_a_wrapped_model_is_its_operand_not_a_weight(device):
    """A plain tensor set on a registered parametrization (here after it joined the wrapped model;
    peft sets its delta before) is an operand of the parametrized tensor, not a weight: it stays
    the tensor assigned, on the device, outside the resident bytes. Before, it was offloaded in
    place (a copy back to the host at each assignment) or, where it fit, counted as a resident weight."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256))
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    for m in (model, reference):
        torch.nn.utils.parametrize.register_parametrization(m[2], "weight", _AddDelta(torch.zeros(256, 256).to(device)))
    resident = ot.stats(model).resident_bytes
    delta = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)).to(device)
    for m in (model, reference):
        m[2].parametrizations.weight[0].delta = delta
    assert model[2].parametrizations.weight[0].delta is delta and not isinstance(delta, ot.OffloadedTensor)
    s = ot.stats(model)
    assert (s.resident_bytes, s.bytes_d2h) == (resident, 0), s
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)).to(device)
    assert torch.equal(model(x), reference(x))
    _paged_within_budget(model)


# ---------------------------------------------------------------------------- torch.export


def test_export_run_decompositions_of_a_model_with_a_weight_past_the_room_runs_in_tiles(device):
    """``run_decompositions`` registers Python kernels on the CPU and CUDA keys of the composites it
    keeps (``linear``) while it runs. An op first met then was classified as having a kernel of its
    own and kept a handler that pages it whole: the decomposed program, and every later eager
    forward in inference mode, raised BudgetError on a weight that tiles."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 64)).eval()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    s = ot.stats(model)
    assert model[2].weight.numel() * 4 > s.budget_bytes - s.resident_bytes  # only its tiles fit
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = reference(x)
    program = torch.export.export(model, (x,)).run_decompositions()
    with torch.no_grad():
        assert torch.equal(program.module()(x), expected)
    with torch.inference_mode():
        assert torch.equal(model(x), expected)
    _paged_within_budget(model)


def test_export_run_decompositions_pages_weights_it_passes_whole_through_the_pager_cache(device, monkeypatch):
    """GPT-2's ``Conv1D`` computes ``addmm(bias, x, weight)`` on its weight and bias as they are.
    ``run_decompositions`` lifts each offloaded host view into a Parameter of the program, and an op
    given one read it as a tracing stand-in: at run time it was copied whole into a device tensor
    of its own that the budget does not count (``offtensor::page``), where the exported program
    and eager forwards page it through the pager's cache. Now it is paged as they page it."""
    from offtensor.ops import compile as ot_compile

    Conv1D = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    model = torch.nn.Sequential(Conv1D(128, 64), torch.nn.GELU(), Conv1D(128, 128), torch.nn.GELU(),
                                Conv1D(64, 128)).eval()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device, 0.6)
    assert all(isinstance(m.weight, ot.OffloadedTensor) for m in model[::2])
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        expected = reference(x)
        ot.reset_stats(model)
        assert torch.equal(model(x), expected)
    eager = ot.stats(model)
    program = torch.export.export(model, (x,)).run_decompositions().module()
    own_copies = []
    real_page = ot_compile.page
    monkeypatch.setattr(ot_compile, "page", lambda host, *rest: own_copies.append(tuple(host.shape)) or real_page(host, *rest))
    ot.reset_stats(model)
    with torch.no_grad():
        assert torch.equal(program(x), expected)
        s = ot.stats(model)
        assert (s.bytes_h2d, s.page_ins) == (eager.bytes_h2d, eager.page_ins), (s, eager)
    assert own_copies == []
    _paged_within_budget(model)


def test_export_run_decompositions_copies_a_convolution_weight_past_the_room_in_tiles(device):
    """A convolution has non-tensor arguments, so the decomposed program gives it the graph's own
    device copy of its weight (``offtensor::page``), which the budget does not count. The conv
    handler ran while ``run_decompositions`` traced, so a weight larger than the room is recorded as
    the tiles it chose (slices, a convolution each, a ``cat``): no copy is larger than the room, and
    the program gives the unwrapped outputs within the budget."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(8, 64, 3), torch.nn.GELU(), torch.nn.Conv2d(64, 64, 3),
                                torch.nn.GELU(), torch.nn.Conv2d(64, 8, 3)).eval()
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device)
    s = ot.stats(model)
    room = s.budget_bytes - s.resident_bytes
    assert isinstance(model[2].weight, ot.OffloadedTensor) and model[2].weight.numel() * 4 > room
    x = torch.randn(2, 8, 12, 12, generator=torch.Generator().manual_seed(1)).to(device)
    program = torch.export.export(model, (x,)).run_decompositions()
    copies = [n.meta["val"] for n in program.graph.nodes if n.target == torch.ops.offtensor.page.default]
    assert len(copies) > 3 and max(c.numel() * c.element_size() for c in copies) <= room
    ot.reset_stats(model)
    with torch.no_grad():
        assert torch.equal(program.module()(x), reference(x))
    _paged_within_budget(model)


@pytest.mark.parametrize("strict", [False, True])
def test_export_of_a_model_whose_embedding_table_is_offloaded_pages_only_the_rows_it_looks_up(device, strict):
    """export traces with gradients on, and an embedding table wrapped as a parameter needs one: the
    traced embedding op was refused for such an argument, and the graph break it fell back on does
    not exist under export, so export raised "aten.embedding ... cannot be traced". The op runs
    below autograd, where the table's own formula (a scatter of rows that needs no weight) already
    applies: it stays in the program, which pages the looked-up rows only."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 64)).eval()
    reference = copy.deepcopy(model).to(device)
    resident = sum(p.numel() * p.element_size() for p in model[1].parameters())
    ot.wrap_model(model, budget_gb=(resident + 1000 * 64 * 4 // 2) / GiB, device=device,
                  policy=lambda name: "offload" if name == "0.weight" else "keep")
    assert isinstance(model[0].weight, ot.OffloadedTensor) and model[0].weight.requires_grad
    ids = torch.tensor([[3, 7, 3, 999], [0, 7, 512, 3]]).to(device)  # 5 distinct rows
    program = torch.export.export(model, (ids,), strict=strict)
    ot.reset_stats(model)
    with torch.no_grad():
        assert torch.equal(program.module()(ids), reference(ids))
    assert ot.stats(model).bytes_h2d == 5 * 64 * 4
    _paged_within_budget(model)


def test_export_of_a_tiny_llama_at_30_percent_of_its_weights_gives_the_unwrapped_logits(device):
    """Default placement offloads the embedding table (tied to the LM head) at this budget. The
    decomposed program looks the rows up through offtensor's embedding op and gives what the
    unwrapped model's decomposed program gives (decompositions change the last bits of both)."""
    model, reference = _tiny("llama", device)
    _wrap(model, device)
    assert isinstance(model.model.embed_tokens.weight, ot.OffloadedTensor)
    ids, _ = _ids(device)
    kwargs = {"input_ids": ids, "use_cache": False}
    program = torch.export.export(model, (), kwargs)
    ot.reset_stats(model)
    with torch.no_grad():
        assert torch.equal(program.module()(**kwargs).logits, reference(**kwargs).logits)
    _paged_within_budget(model)
    decomposed = program.run_decompositions()
    assert any(n.target == torch.ops.offtensor.embedding.default for n in decomposed.graph.nodes)
    unwrapped = torch.export.export(reference, (), kwargs).run_decompositions()
    with torch.no_grad():
        assert torch.equal(decomposed.module()(**kwargs).logits, unwrapped.module()(**kwargs).logits)
    _paged_within_budget(model)


# ---------------------------------------------------------------------------- already composing


def test_generate_returning_attentions_hidden_states_and_scores_and_plain_save_pretrained(tmp_path, device):
    """``generate(output_attentions=..., output_hidden_states=..., output_scores=...)`` (eager
    attention) gives every returned tensor bit for bit; the wrapped model's ``save_pretrained`` reads
    back in plain transformers with its tie and values."""
    transformers = pytest.importorskip("transformers")
    model, reference = _tiny("llama", device)
    for m in (model, reference):
        m.set_attn_implementation("eager")
    _wrap(model, device)
    ids, mask = _ids(device)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, pad_token_id=0, do_sample=False,
                  output_attentions=True, output_hidden_states=True, output_scores=True, return_dict_in_generate=True)
    got, expected = model.generate(ids, **kwargs), reference.generate(ids, **kwargs)
    assert torch.equal(got.sequences, expected.sequences)

    def flat(v):
        return [v] if isinstance(v, torch.Tensor) else [t for x in v for t in flat(x)]

    for key in ("attentions", "hidden_states", "scores"):
        mine, theirs = flat(getattr(got, key)), flat(getattr(expected, key))
        assert len(mine) == len(theirs) > 0 and all(map(torch.equal, mine, theirs)), key
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).to(device).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for (name, value), (other, expected_value) in zip(loaded.state_dict().items(), reference.state_dict().items()):
        assert name == other and torch.equal(value, expected_value), name
    _paged_within_budget(model)


def test_peft_dora_and_weighted_adapters_over_a_wrapped_model(device):
    peft = pytest.importorskip("peft")
    model, reference = _tiny("llama", device)

    def adapters(m):
        torch.manual_seed(1)
        config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
        m = peft.get_peft_model(m, peft.LoraConfig(**config, use_dora=True), adapter_name="dora")
        m.add_adapter("a", peft.LoraConfig(**config))
        m.add_adapter("b", peft.LoraConfig(**config))
        m.add_weighted_adapter(["a", "b"], [0.7, 0.3], "mix", combination_type="linear")
        return m

    model, reference = adapters(model), adapters(reference)
    _wrap(model, device)
    for name in ("dora", "mix", "b"):
        model.set_adapter(name)
        reference.set_adapter(name)
        _same_logits(model, reference, device)
    _paged_within_budget(model)


def test_weight_norm_registered_after_wrap_trains_like_the_unwrapped_model(device):
    """A parametrization registered on an offloaded weight after wrapping moves it under
    ``parametrizations``, still offloaded, and trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 96),
                                torch.nn.GELU(), torch.nn.Linear(96, 64))
    reference = copy.deepcopy(model).to(device)
    _wrap(model, device, 0.6)  # weight_norm reads the weight whole: the room must hold it
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(1)).to(device)
    for m in (model, reference):
        torch.nn.utils.parametrizations.weight_norm(m[2])
    assert any(isinstance(p, ot.OffloadedTensor) for p in model[2].parametrizations.weight.parameters())
    got, expected = model(x), reference(x)
    assert torch.equal(got, expected)
    got.sum().backward()
    expected.sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name
    _paged_within_budget(model)
