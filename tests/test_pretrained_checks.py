"""from_pretrained agrees with the pinned transformers on what a checkpoint means, and checks
config.json before anything is allocated.

Ties: a config that ties lm_head to the embeddings beside files that store a different head, no
head, no embeddings or an equal head; an untied config without a head. Each is loaded by
``transformers.AutoModelForCausalLM.from_pretrained`` in the same test, and ``ot.from_pretrained``
must tie exactly what it ties and give bit-identical logits, or refuse where transformers would
initialize a weight randomly.

config.json: each hostile edit beside valid shards is a ``CheckpointError`` naming config.json and
the field, never a raw error, and an absurd size is refused by arithmetic before any allocation.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import offtensor as ot
from offtensor import _ext
from offtensor.loading import configs as loading_configs

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

GiB = 1 << 30


def _llama_config(tied: bool):
    return transformers.LlamaConfig(vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64,
                                    num_hidden_layers=2, num_key_value_heads=2, intermediate_size=128,
                                    tie_word_embeddings=tied)


def _write(root, tied_config: bool, files_edit=None):
    """A tiny Llama saved untied (embeddings and head differ), then its file edited and its config's
    tie_word_embeddings set: the checkpoints users meet that transformers reads its own way."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_llama_config(False)).eval().save_pretrained(root)
    file = os.path.join(root, "model.safetensors")
    state = safetensors_torch.load_file(file)
    if files_edit is not None:
        files_edit(state)
        safetensors_torch.save_file(state, file, metadata={"format": "pt"})
    path = os.path.join(root, "config.json")
    config = json.loads(open(path).read())
    config["tie_word_embeddings"] = tied_config
    open(path, "w").write(json.dumps(config))
    return sum(t.numel() * t.element_size() for t in state.values())


def _tied(model) -> bool:
    return model.lm_head.weight is model.model.embed_tokens.weight


def _drop(key):
    return lambda state: state.pop(key)


def _equal_head(state):
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()


TIE_CASES = {
    "tied_config_distinct_stored_head": None,  # the files as saved: both stored, different
    "tied_config_head_absent": _drop("lm_head.weight"),
    "tied_config_embeddings_absent": _drop("model.embed_tokens.weight"),
    "tied_config_equal_stored_head": _equal_head,
}


@pytest.mark.parametrize("case", sorted(TIE_CASES))
def test_from_pretrained_ties_as_transformers_does_with_bit_identical_logits(tmp_path, case):
    nbytes = _write(tmp_path, True, TIE_CASES[case])
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = ot.from_pretrained(tmp_path, device="cpu", budget_gb=0.4 * nbytes / GiB, progress=False)
    assert ot.stats(model).offloaded_bytes > 0
    assert _tied(model) == _tied(reference)
    assert set(model.all_tied_weights_keys) == set(reference.all_tied_weights_keys)
    untied_warnings = [w for w in caught if "different values" in str(w.message)]
    assert len(untied_warnings) == (case == "tied_config_distinct_stored_head")
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_distinct_stored_head_under_a_tied_config_is_used_not_dropped(tmp_path):
    _write(tmp_path, True)
    stored = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"'lm_head\.weight' to 'model\.embed_tokens\.weight'.*untied"):
        model = ot.from_pretrained(tmp_path, device="cpu", budget_gb=1, progress=False)
    assert torch.equal(model.lm_head.weight.cpu(), stored["lm_head.weight"])
    assert torch.equal(model.model.embed_tokens.weight.cpu(), stored["model.embed_tokens.weight"])


def test_an_untied_config_without_a_head_is_refused_where_transformers_initializes_it_randomly(tmp_path):
    _write(tmp_path, False, _drop("lm_head.weight"))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    stored = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert not _tied(reference)  # transformers neither ties it nor loads it: its values are a fresh initialization
    assert not torch.equal(reference.lm_head.weight, stored["model.embed_tokens.weight"])
    live = _ext.live_host_bytes()
    with pytest.raises(ot.CheckpointError, match=r"lack 1 weights.*'lm_head\.weight"):
        ot.from_pretrained(tmp_path, device="cpu", budget_gb=1, progress=False)
    assert _ext.live_host_bytes() == live


# ---------------------------------------------------------------------------- config.json


def _tiny_checkpoint(root):
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(_llama_config(True)).eval().save_pretrained(root)


def _edit_config(root, change):
    path = os.path.join(root, "config.json")
    if isinstance(change, str):
        open(path, "w").write(change)
        return
    config = json.loads(open(path).read())
    config.update(change)
    open(path, "w").write(json.dumps(config))


HOSTILE = {
    "negative_hidden_size": ({"hidden_size": -64}, r"hidden_size = -64.*cannot be negative"),
    "no_attention_heads": ({"num_attention_heads": 0}, r"num_attention_heads = 0.*at least one attention head"),
    "no_key_value_heads": ({"num_key_value_heads": 0}, r"num_key_value_heads = 0.*at least one attention head"),
    "unknown_dtype": ({"dtype": "X9"}, r"dtype = 'X9', which is not a torch dtype"),
    "layer_count_a_string": ({"num_hidden_layers": "2"}, r"transformers refuses .*num_hidden_layers"),
    "intermediate_size_minus_one": ({"intermediate_size": -1}, r"cannot build a model .*intermediate_size = -1"),
    "unknown_model_type": ({"model_type": "X9"}, r"transformers refuses .*X9"),
    "not_json": ("{not json", r"is not JSON"),
    # A bare TypeError ("'int' object is not iterable") came out of choosing the model class.
    "architectures_not_a_list": ({"architectures": 5}, r"architectures = 5, not a list of transformers model class"),
    "a_json_list": ("[1]", r"is a JSON list"),
    "absurd_vocabulary": ({"vocab_size": 10**15}, r"(?s)nothing was allocated.*vocab_size = 1000000000000000.*"
                                                  r"'model\.embed_tokens\.weight' \(1000000000000000, 64\) "
                                                  r"\(256000000000000000 bytes\).*stores \(128, 64\)"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_config_json_is_a_checkpoint_error_naming_it_and_the_field(tmp_path, case):
    _tiny_checkpoint(tmp_path)
    change, match = HOSTILE[case]
    _edit_config(tmp_path, change)
    live = _ext.live_host_bytes()
    with pytest.raises(ot.CheckpointError, match=match) as error:
        ot.from_pretrained(tmp_path, device="cpu", budget_gb=1, progress=False)
    assert "config.json" in str(error.value)
    assert _ext.live_host_bytes() == live


def test_buffers_a_config_makes_larger_than_memory_are_refused_before_the_build(tmp_path, monkeypatch):
    _tiny_checkpoint(tmp_path)
    monkeypatch.setattr(loading_configs, "physical_memory", lambda: 16)  # fewer bytes than the rotary buffers
    built = []
    real = transformers.LlamaForCausalLM._from_config.__func__
    monkeypatch.setattr(transformers.LlamaForCausalLM, "_from_config",
                        classmethod(lambda cls, *a, **k: built.append(torch.empty(0).device) or real(cls, *a, **k)))
    with pytest.raises(ot.CheckpointError, match=r"config\.json.*buffers .* more than this machine's 16 bytes.*inv_freq"):
        ot.from_pretrained(tmp_path, device="cpu", budget_gb=1, progress=False)
    assert built == [torch.device("meta")]  # only the build on meta ran


class ReadsAValueAtInit(transformers.LlamaForCausalLM):
    """A model whose __init__ reads a value (as remote-code models' drop-path schedules do): it
    cannot be built on meta, and loads as before."""

    def __init__(self, config):
        super().__init__(config)
        self.schedule = torch.linspace(0, 1, 3)[1].item()


def test_a_model_whose_init_reads_values_still_loads_and_ties_as_transformers(tmp_path):
    _write(tmp_path, True)  # tied config, distinct stored head
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with pytest.warns(UserWarning, match="different values"):
        model = ot.from_pretrained(tmp_path, device="cpu", budget_gb=1, progress=False, model_class=ReadsAValueAtInit)
    assert model.schedule == 0.5 and not _tied(model)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_no_default_config_of_the_pinned_transformers_fails_the_field_checks():
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for model_type in CONFIG_MAPPING.keys():
            try:
                fields = json.loads(CONFIG_MAPPING[model_type]().to_json_string())
            except Exception:  # a config that needs arguments or an optional package to be built
                continue
            loading_configs._check_fields(fields, "config.json", "")  # raises CheckpointError on a refusal
            checked += 1
    assert checked > 500


# Published MoE checkpoints' config values: models that build one module per expert (SwitchTransformers,
# NLLB-MoE) and ones that stack their experts (Mixtral, DeepSeek-V3, Qwen3-MoE, gpt-oss, Jamba).
PUBLISHED = {
    "switch-base-128": lambda: (transformers.SwitchTransformersForConditionalGeneration, transformers.SwitchTransformersConfig(
        num_experts=128, d_ff=3072, encoder_sparse_step=2, decoder_sparse_step=2, num_sparse_encoder_layers=6,
        num_sparse_decoder_layers=6)),
    "nllb-moe-54b": lambda: (transformers.NllbMoeForConditionalGeneration, transformers.NllbMoeConfig(
        vocab_size=256206, d_model=2048, encoder_layers=24, decoder_layers=24, encoder_ffn_dim=8192,
        decoder_ffn_dim=8192, encoder_attention_heads=16, decoder_attention_heads=16, num_experts=128,
        encoder_sparse_step=4, decoder_sparse_step=4)),
    "mixtral-8x22b": lambda: (transformers.MixtralForCausalLM, transformers.MixtralConfig(
        vocab_size=32768, hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
        num_key_value_heads=8, num_local_experts=8)),
    "deepseek-v3": lambda: (transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config()),
    "qwen3-235b-a22b": lambda: (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8)),
    "gpt-oss-120b": lambda: (transformers.GptOssForCausalLM, transformers.GptOssConfig(num_hidden_layers=36,
                                                                                       num_local_experts=128)),
    "jamba-v0.1": lambda: (transformers.JambaForCausalLM, transformers.JambaConfig()),
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_the_bound_on_what_a_build_registers_never_refuses_a_published_moe_checkpoint(name):
    # The build is stopped once it registers more parameters or modules than its files can fill;
    # a checkpoint's files hold every parameter and persistent buffer (a tied one once; stacked
    # experts are stored one tensor per expert, more than the model has). Built once on meta at its
    # published size, counted without limits: what it registers is within the limits those names
    # give, and every parameter and module is counted.
    from types import SimpleNamespace

    from offtensor.loading.registrations import Registrations, counted

    cls, config = PUBLISHED[name]()
    state = Registrations({}, "ckpt")
    state.parameter_limit = state.module_limit = float("inf")
    with torch.device("meta"), counted(state):
        model = cls._from_config(config)
    assert len(state.parameters) >= len({id(p) for p in model.parameters()})
    assert state.modules == sum(1 for _ in model.modules()) - 1  # (all but the model itself)
    stored = {id(t): n for n, t in reversed(model.state_dict(keep_vars=True).items())}.values()
    limits = Registrations({n: SimpleNamespace(file="model.safetensors", nbytes=1) for n in stored}, "ckpt")
    assert len(state.parameters) <= limits.parameter_limit and state.modules <= limits.module_limit


class ReadsAValueThenRepeats(transformers.LlamaForCausalLM):
    """A model whose __init__ reads a value first (so it is built for real without the check on
    meta), then repeats a module ``config.num_taps`` times."""

    def __init__(self, config):
        schedule = torch.linspace(0, 1, 3)[1].item()
        super().__init__(config)
        self.schedule = schedule
        self.taps = torch.nn.ModuleList(torch.nn.Identity() for _ in range(config.num_taps))


def test_a_model_that_cannot_be_built_on_meta_is_still_stopped_past_what_its_files_can_fill(tmp_path):
    # The real build is counted as the meta one is: a model whose __init__ reads a value skips the
    # check on meta, and built num_taps = 10**9 modules for real before anything was matched.
    from test_hostile_files import _within

    _tiny_checkpoint(tmp_path)
    _edit_config(tmp_path, {"num_taps": 10**9})
    with _within(5, "from_pretrained was still building modules"):
        with pytest.raises(ot.CheckpointError, match=r"\(check num_taps = 1000000000\) makes the model register more "
                                                     r"than \d+ modules"):
            ot.from_pretrained(tmp_path, device="cpu", budget_gb=1, progress=False, model_class=ReadsAValueThenRepeats)
