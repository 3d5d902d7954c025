"""Clear words for the smaller gaps: a policy pattern that matches nothing is
named in a warning; a budget above the device's memory is named in a warning; an expanded
(stride-0) parameter of a wrapped model keeps its layout in the host master and is counted by the
bytes it takes. (``ot.offload(t)`` of an expanded tensor still makes a writable master of numel
elements, as tests/test_properties.py's "expanded" layout states: a copy the caller may write.)

And the names a newcomer meets first: ``ot.OffloadConfig`` exported, stats printed under their field
names, an unknown device string answered with the devices to use, every ``plan`` option explained,
and ``plan --config`` planning the checkpoint's own dtype."""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import OffloadedTensor, placement, wrap

GiB = 1 << 30


def _offtensor_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn()
    return [str(w.message) for w in caught if str(w.message).startswith("offtensor:")]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


# ---------------------------------------------------------------------------- policy patterns


@pytest.mark.parametrize("policy, pattern, choice", [
    ({"offload": ["*.expert.*", "2.weight"]}, "*.expert.*", "offload"),
    ({"keep": ["embed_tokens*"], "offload": ["0.*"]}, "embed_tokens*", "keep"),
    (["0.weight", "layers.*"], "layers.*", "offload"),
    ("lm_head.weight", "lm_head.weight", "offload"),
])
def test_a_policy_pattern_matching_nothing_is_named_in_a_warning(device, policy, pattern, choice):
    with pytest.warns(UserWarning, match=rf"the policy's '{choice}' pattern '{re.escape(pattern)}' matches none of the model's "
                                         rf"4 tensor names \(such as \['0\.weight', '0\.bias', '2\.weight'\]\)") as record:
        ot.wrap_model(_model(), budget_gb=1, device=device, policy=policy)
    assert len([w for w in record if "matches none" in str(w.message)]) == 1  # the patterns that match say nothing


def test_matching_patterns_and_callable_policies_warn_nothing(device):
    assert not _offtensor_warnings(lambda: ot.wrap_model(_model(), budget_gb=1, device=device,
                                                         policy={"offload": ["*.weight"], "keep": ["0.bias"]}))
    assert not _offtensor_warnings(lambda: ot.wrap_model(_model(), budget_gb=1, device=device,
                                                         policy=lambda name: None))


def test_the_warning_points_at_the_callers_line(device):
    with pytest.warns(UserWarning, match="matches none") as record:
        ot.wrap_model(_model(), budget_gb=1, device=device, policy=["nothing.*"])
    assert record[0].filename == __file__


# ---------------------------------------------------------------------------- budget vs device memory


def test_a_budget_above_the_devices_memory_is_named_in_a_warning(device):
    total = placement.device_total_bytes(torch.device(device))
    assert total and total > 0
    memory = "GPU memory" if torch.device(device).type == "cuda" else "RAM on this machine"
    with pytest.warns(UserWarning, match=rf"budget_gb=1000000.0 \(\d+ bytes\) is more than the {total} bytes "
                                         rf"\([\d.]+ GiB\) of {memory}"):
        ot.wrap_model(_model(), budget_gb=1e6, device=device)


def test_a_budget_within_the_devices_memory_warns_nothing(device):
    assert not _offtensor_warnings(lambda: ot.wrap_model(_model(), budget_gb=0.5, device=device))


# ---------------------------------------------------------------------------- expanded parameters


def _expanded(seed=0):
    # 64 distinct float32 values (256 B) seen as 64 x 64 (16 KiB) with stride (0, 1).
    return torch.randn(1, 64, generator=torch.Generator().manual_seed(seed)).expand(64, 64)


class WithExpanded(nn.Module):
    def __init__(self):
        super().__init__()
        self.e = nn.Parameter(_expanded(), requires_grad=False)
        self.d = nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(1)), requires_grad=False)

    def forward(self, x):
        return (x @ self.e) @ self.d.t() + x @ self.e.t()


def test_a_wrapped_expanded_parameter_takes_its_256_bytes_offloaded_and_is_counted_so(device):
    reference, model = WithExpanded(), WithExpanded()  # (a deepcopy would clone e into 16 KiB)
    ot.wrap_model(model, budget_gb=40_000 / GiB, device=device, policy={"offload": ["e"]})
    assert isinstance(model.e, OffloadedTensor) and isinstance(model.e, nn.Parameter)
    assert model.e.host_nbytes == 256 and model.e.stride() == (0, 1) and model.e._host.stride() == (0, 1)
    assert torch.equal(model.e.cpu(), reference.e.detach())
    stats = ot.stats(model)
    assert stats.offloaded_bytes == 256
    # The plain model on the same device, its e still one row seen as 64 (moved whole, it would be
    # made dense): a GPU's kernels need not round as the host's do.
    reference.d = nn.Parameter(reference.d.detach().to(device), requires_grad=False)
    reference.e = nn.Parameter(reference.e.detach()[:1].to(device).expand(64, 64), requires_grad=False)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2)).to(device)
    ot.reset_stats(model)
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    assert ot.stats(model).bytes_h2d <= 2 * 256  # each page of e moves its 256 bytes, not 16 KiB


def test_placement_counts_an_expanded_parameter_by_the_bytes_it_takes(device):
    # 16 KiB dense + 256 B expanded fit a 17,000-byte budget; counted as 16 KiB, e would not.
    model = WithExpanded()
    ot.wrap_model(model, budget_gb=17_000 / GiB, device=device)
    assert not any(isinstance(p, OffloadedTensor) for p in model.parameters())
    assert model.e.stride() == (0, 1)
    assert ot.stats(model).resident_bytes == 64 * 64 * 4 + 256


def test_an_expanded_parameter_assigned_after_wrapping_is_offloaded_in_256_bytes(device):
    model = nn.Module()
    model.d = nn.Parameter(torch.randn(64, 64), requires_grad=False)
    ot.wrap_model(model, budget_gb=17_000 / GiB, device=device, policy=lambda name: "offload" if name == "e" else None)
    values = _expanded(3)
    model.e = nn.Parameter(values, requires_grad=False)  # paging room reserved for 256 B, not 16 KiB
    assert isinstance(model.e, OffloadedTensor) and model.e.host_nbytes == 256 and model.e.stride() == (0, 1)
    assert torch.equal(model.e.cpu(), values)


# ---------------------------------------------------------------------------- names a newcomer meets


def test_offload_config_is_exported():
    assert "OffloadConfig" in ot.__all__
    from offtensor.config import OffloadConfig

    assert ot.OffloadConfig is OffloadConfig


def test_stats_print_under_their_field_names(device):
    model = _model()
    ot.wrap_model(model, budget_gb=2000 / GiB, device=device)  # both weights offloaded
    with torch.no_grad():
        model(torch.randn(2, 16).to(device))
    text = str(ot.stats(model))
    names = re.findall(r"(\w+)=", text)
    fields = set(ot.OffloadStats.__dataclass_fields__)
    assert names and set(names) <= fields, set(names) - fields
    assert {"bytes_h2d", "bytes_d2h", "peak_device_bytes", "budget_bytes", "resident_bytes"} <= set(names)
    assert "bytes_h2d=2.05 kB" in text


@pytest.mark.parametrize("bad", ["gpu", "npu", "GPU:0", ""])
def test_an_unknown_device_string_names_the_devices_to_use(bad):
    with pytest.raises(ValueError) as raised:
        ot.wrap_model(_model(), budget_gb=1, device=bad)
    assert str(raised.value) == (f"offtensor: device={bad!r} is not a device; "
                                 'use "cuda" (a GPU), "cuda:N" or "cpu" (the emulated device)')


def test_plan_help_explains_every_option_and_lists_the_profiles(capsys):
    from offtensor.__main__ import main

    with pytest.raises(SystemExit) as exited:
        main(["plan", "--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    options = text[text.index("options:"):]
    # argparse puts an option's help beside it or on the next line; an option with none has neither.
    lines = options.splitlines()[2:]
    for i, line in enumerate(lines):
        if line.startswith("  --"):
            beside = len(line.split("  ")) > 2 and line.split("  ")[-1].strip()
            below = i + 1 < len(lines) and lines[i + 1].startswith(" " * 10)
            assert beside or below, f"no help for {line.strip()}"
    assert f"--profile {{{','.join(sorted(ot.PROFILES))}}}" in options


@pytest.mark.parametrize("option, value, words", [
    ("--layers", "0", "argument --layers: must be at least 1, got 0"),
    ("--steps", "two", "argument --steps: not a whole number: 'two'"),
    ("--budget-gb", "-3", "argument --budget-gb: must be a non-negative number of GiB, got -3"),
    ("--offload-gb", "nan", "argument --offload-gb: must be a non-negative number of GiB, got nan"),
])
def test_plan_refuses_a_number_out_of_range_naming_the_option(capsys, option, value, words):
    from offtensor.__main__ import main

    with pytest.raises(SystemExit) as exited:  # was a traceback from deep in the plan, or a hang
        main(["plan", option, value])
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


def test_plan_at_a_budget_the_model_cannot_run_in_says_so_without_a_traceback(tmp_path, capsys):
    from offtensor.__main__ import main

    args = ["plan", "--layers", "2", "--hidden", "8", "--ffn", "8", "--budget-gb", "0", "--png", str(tmp_path / "p.png")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("offtensor: a budget of 0 B (0 bytes) cannot hold this model") and "Traceback" not in err


@pytest.mark.parametrize("text, words", [
    ("[1, 2]", "is not routing statistics: a JSON list, not an object"),
    ('{"top_k": 2}', "is not routing statistics: no popularity, locality"),
    ('{"popularity": [[0.5, 0.5]], "locality": [0.3], "top_k": 0}', "top_k 0 is not a whole number of at least 1"),
    ('{"popularity": [[-1, 2]], "locality": [0.3], "top_k": 1}', "popularity is not a list, per MoE layer"),
    ('{"popularity": [[0.5, 0.5]], "locality": [3], "top_k": 1}', "locality is not a list of shares between 0 and 1"),
])
def test_plan_with_a_file_that_is_not_routing_statistics_names_the_file_and_what_is_wrong(tmp_path, capsys, text, words):
    from offtensor.__main__ import main

    path = tmp_path / "routing.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:  # was an AttributeError, KeyError or TypeError traceback
        main(["plan", "--routing", str(path)])
    assert str(exited.value.code).startswith(f"offtensor plan: {path} is not routing statistics: ")
    assert words in str(exited.value.code)


@pytest.mark.parametrize("config, words", [
    (None, "no config.json in"),
    ('{"model_type": "no-such-model"}', "transformers cannot read the config at"),
    ("not json", "transformers cannot read the config at"),
    ('{"model_type": "clip"}', "is not a causal LM transformers can build: Unrecognized configuration class"),
])
def test_plan_with_a_config_transformers_cannot_build_says_which_and_why(tmp_path, config, words):
    pytest.importorskip("transformers")
    from offtensor.__main__ import main

    if config is not None:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(SystemExit) as exited:
        main(["plan", "--config", str(tmp_path)])
    assert str(exited.value.code).startswith("offtensor plan: ") and words in str(exited.value.code)
    assert "\n" not in str(exited.value.code)


def _tiny_config(tmp_path, **extra):
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 2048, "hidden_size": 64,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 128, "tie_word_embeddings": False, **extra}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


@pytest.mark.parametrize("extra, dtype, total", [
    ({}, "float32", "1.54 MB"),  # no dtype in config.json: float32, as transformers loads it
    ({"torch_dtype": "float32"}, "float32", "1.54 MB"),
    ({"dtype": "bfloat16"}, "bfloat16", "770.69 kB"),
])
def test_plan_with_a_config_plans_the_checkpoints_own_dtype(tmp_path, capsys, extra, dtype, total):
    pytest.importorskip("transformers")
    from offtensor.__main__ import main

    path = _tiny_config(tmp_path, **extra)
    args = ["plan", "--config", path, "--prefill-tokens", "8", "--steps", "1", "--png", str(tmp_path / "p.png")]
    assert main(args) == 0
    assert f"LlamaForCausalLM: 2 layers, {dtype}, {total};" in capsys.readouterr().out
    assert main(args + ["--dtype", "fp16"]) == 0  # an explicit --dtype still wins
    assert "LlamaForCausalLM: 2 layers, fp16, 770.69 kB;" in capsys.readouterr().out


# ---------------------------------------------------------------------------- what wrap_model says


def test_help_of_wrap_model_says_what_every_argument_does():
    doc = ot.wrap_model.__doc__
    for argument in ("budget_gb", "device", "offload_gb", "prefetch", "policy", "routing"):
        assert f"``{argument}``" in doc, argument
    assert "None is ``cuda``" in doc and "else\n      ``cpu``" in doc  # the default device
    assert '{"offload": [...], "keep": [...]}' in doc and "callable" in doc  # the forms a policy takes
    assert "docs/moe.md" in doc and len(doc.splitlines()) <= 35  # MoE in a pointer, not half a page
    for fn in (ot.stats, ot.reset_stats):
        assert fn.__doc__ and len(fn.__doc__.split()) >= 10, fn.__name__


def _wide_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))


@pytest.mark.parametrize("policy", [None, {"keep": ["0.*"]}])
def test_a_budget_error_says_the_bytes_readably_and_the_smallest_budget_that_works(device, policy):
    with pytest.raises(ot.BudgetError) as info:
        ot.wrap_model(_wide_model(), budget_gb=100 / GiB, device=device, policy=policy)
    message = str(info.value)
    assert "a budget of 100 B (100 bytes) cannot hold this model" in message
    assert re.search(r"needs [\d.]+ k?B \(\d+ bytes\) on the device at once", message)
    smallest = float(re.search(r"The smallest budget that holds it is budget_gb=([\d.e-]+)", message).group(1))
    model = _wide_model()
    ot.wrap_model(model, budget_gb=smallest, device=device, policy=policy)  # the suggestion works
    assert ot.stats(model).peak_device_bytes <= ot.stats(model).budget_bytes
    with pytest.raises(ot.BudgetError):  # and is the smallest, to its three digits
        ot.wrap_model(_wide_model(), budget_gb=smallest * 0.98, device=device, policy=policy)


def test_moving_a_wrapped_model_to_meta_says_to_unwrap_first(device):
    model = _wide_model()
    ot.wrap_model(model, budget_gb=30_000 / GiB, device=device)
    offloaded = {n for n, p in model.named_parameters() if isinstance(p, OffloadedTensor)}
    assert offloaded
    with pytest.raises(RuntimeError) as info:
        model.to("meta")
    message = str(info.value)
    assert "moving a wrapped model to the meta device is not supported" in message
    assert "ot.unwrap_model(model)" in message and "budget_gb" not in message
    assert {n for n, p in model.named_parameters() if isinstance(p, OffloadedTensor)} == offloaded
    assert not any(p.is_meta for p in model.parameters())  # nothing was moved
    ot.unwrap_model(model)
    assert all(p.is_meta for p in model.to("meta").parameters())  # unwrapped, it moves
