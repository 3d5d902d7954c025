"""Every ``generate`` mode on the tiny transformers architectures of test_sweep.py (decoders, MoE,
encoder-decoders), wrapped at 30 % and 12 % of their bytes, against the unwrapped model: tokens,
and scores, logits, attentions and hidden states where the mode returns them, bit for bit.

The modes: greedy with scores and logits; beam search (``num_return_sequences``, ``length_penalty``,
``early_stopping``); sampling and beam sampling under a fixed seed; sampling warpers and logits
processors; static (and the deprecated sliding-window and hybrid) caches; assisted decoding with a
wrapped copy as the assistant, greedy and sampling, and prompt lookup; a left-padded batch of two
with an attention mask (greedy, beam, static cache, several samples each); no cache; continuing
from the returned cache; classifier-free guidance; a watermark; chunked prefill; inference mode;
autocast. Group beam search, contrastive search and constrained beam search live on the Hub in this
transformers (``custom_generate``) and are not tried.

What the sweep found: under ``torch.autocast`` a weight that requires grad is cast lazily (torch's
autocast caches that cast with grad on, even inside ``generate``'s ``no_grad``), and a lazy cast of
an expert stack larger than the room reached the tiled ``bmm`` whose check of its arguments read the
weight's own dtype, not the cast's: llama4's experts raised "expected m1 and m2 to have the same
dtype". The check reads the cast's dtype now.

The bfloat16 sweep found a second cause: a beam-search decode step's product with an LM head paged
in tiles ran another CPU kernel in its narrower tile (test_tiles_same_kernel.py).

``OFFTENSOR_GENERATE_SWEEP=1`` runs the whole sweep (about 150 architectures, 26 modes, two budgets,
float32 and bfloat16: about 26 minutes of one core per dtype); a handful of targeted cases always run."""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot

pytest.importorskip("transformers")

GiB = 1 << 30
BASE = dict(max_new_tokens=3, min_new_tokens=3, pad_token_id=0)


def _prompt():
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(1))
    ids[0, 4:] = ids[0, 1:3]  # a repeat, so prompt lookup finds a match
    return ids


def _batch():
    """Two prompts, the second left-padded by two."""
    ids = torch.randint(3, 96, (2, 6), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :2], mask[1, :2] = 0, 0
    return ids, mask


def _seeded(fn):
    torch.manual_seed(0)
    return fn()


def _gen(m, ids, **kwargs):
    return m.generate(ids, attention_mask=torch.ones_like(ids), **BASE, **kwargs)


def _gen_batch(m, **kwargs):
    ids, mask = _batch()
    return m.generate(ids, attention_mask=mask, **BASE, **kwargs)


def _inference_mode(m, ids, assistant):
    with torch.inference_mode():
        return _gen(m, ids, do_sample=False, return_dict_in_generate=True, output_scores=True)


def _autocast(m, ids, assistant):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _gen(m, ids, do_sample=False, return_dict_in_generate=True, output_logits=True)


def _chunked_prefill(m, ids, assistant):
    config = copy.deepcopy(m.generation_config)
    config.prefill_chunk_size = 2
    return _gen(m, ids, generation_config=config, do_sample=False)


def _continue(m, ids, assistant):
    """Generate, then generate again from the returned cache."""
    out = _gen(m, ids, do_sample=False, return_dict_in_generate=True)
    seq, cache = out.sequences, out.past_key_values
    if m.config.is_encoder_decoder:
        more = _gen(m, ids, decoder_input_ids=seq, past_key_values=cache, do_sample=False)
    else:
        more = m.generate(seq, attention_mask=torch.ones_like(seq), past_key_values=cache, do_sample=False, **BASE)
    return torch.cat([seq.flatten(), more.flatten()])


def _static_twice(m, ids, assistant):
    """A static cache kept by the model across two calls of different lengths."""
    first = _gen(m, ids, cache_implementation="static", do_sample=False)
    return torch.cat([first.flatten(), _gen(m, ids[:, :4], cache_implementation="static", do_sample=False).flatten()])


SCORED = dict(return_dict_in_generate=True, output_scores=True)
MODES = {
    "greedy_dict": lambda m, ids, a: _gen(m, ids, do_sample=False, output_logits=True, **SCORED),
    "beam": lambda m, ids, a: _gen(m, ids, num_beams=3, num_return_sequences=2, length_penalty=0.7,
                                   early_stopping=True, do_sample=False, **SCORED),
    "sample": lambda m, ids, a: _seeded(lambda: _gen(m, ids, do_sample=True, top_k=20, top_p=0.9, temperature=0.7,
                                                     **SCORED)),
    "beam_sample": lambda m, ids, a: _seeded(lambda: _gen(m, ids, do_sample=True, num_beams=2, top_k=0, **SCORED)),
    "static": lambda m, ids, a: _gen(m, ids, do_sample=False, cache_implementation="static"),
    "sliding_window": lambda m, ids, a: _gen(m, ids, do_sample=False, cache_implementation="sliding_window"),
    "hybrid": lambda m, ids, a: _gen(m, ids, do_sample=False, cache_implementation="hybrid"),
    "assisted": lambda m, ids, a: _gen(m, ids, assistant_model=a, do_sample=False),
    "assisted_sample": lambda m, ids, a: _seeded(lambda: _gen(m, ids, assistant_model=a, do_sample=True, top_k=0)),
    "prompt_lookup": lambda m, ids, a: _gen(m, ids, prompt_lookup_num_tokens=2, do_sample=False),
    "batch_left_pad": lambda m, ids, a: _gen_batch(m, do_sample=False, **SCORED),
    "no_cache": lambda m, ids, a: _gen(m, ids, use_cache=False, do_sample=False),
    "continue_cache": _continue,
    "attn_hidden": lambda m, ids, a: _gen(m, ids, do_sample=False, output_attentions=True, output_hidden_states=True,
                                          return_dict_in_generate=True),
    "beam_batch_pad": lambda m, ids, a: _gen_batch(m, num_beams=3, num_return_sequences=2, do_sample=False, **SCORED),
    "static_batch_pad": lambda m, ids, a: _gen_batch(m, cache_implementation="static", do_sample=False),
    "static_twice": _static_twice,
    "penalties": lambda m, ids, a: _gen(m, ids, do_sample=False, repetition_penalty=1.3, no_repeat_ngram_size=2,
                                        bad_words_ids=[[5], [7, 8]]),
    "sample_multi": lambda m, ids, a: _seeded(lambda: _gen_batch(m, do_sample=True, num_return_sequences=3, top_k=0,
                                                                 min_p=0.05)),
    "no_cache_beam": lambda m, ids, a: _gen(m, ids, use_cache=False, num_beams=2, do_sample=False),
    "inference_mode": _inference_mode,
    "guidance": lambda m, ids, a: _gen(m, ids, do_sample=False, guidance_scale=1.5),
    "warpers": lambda m, ids, a: _seeded(lambda: _gen(m, ids, do_sample=True, typical_p=0.9, epsilon_cutoff=1e-3,
                                                      eta_cutoff=1e-3, top_k=0, sequence_bias={(5,): 2.0},
                                                      suppress_tokens=[9])),
    "watermark": lambda m, ids, a: _gen(m, ids, do_sample=False,
                                        watermarking_config={"bias": 2.5, "seeding_scheme": "selfhash"}),
    "prefill_chunk": _chunked_prefill,
    "autocast": _autocast,
}


def _tensors(x, prefix="out") -> dict:
    """A generate result as name -> tensor (caches left out: they are compared through what
    continuing from them gives)."""
    from transformers.cache_utils import Cache

    if isinstance(x, torch.Tensor):
        return {prefix: x}
    if isinstance(x, (tuple, list)):
        return {k: v for i, item in enumerate(x) for k, v in _tensors(item, f"{prefix}[{i}]").items()}
    if hasattr(x, "items") and not isinstance(x, Cache):
        return {k: v for key, item in x.items() if key != "past_key_values"
                for k, v in _tensors(item, f"{prefix}.{key}").items()}
    return {}


def _difference(expected, got):
    e, g = _tensors(expected), _tensors(got)
    if e.keys() != g.keys():
        return f"returns {sorted(g)} instead of {sorted(e)}"
    for k in e:
        if e[k].shape != g[k].shape:
            return f"{k} of shape {tuple(g[k].shape)} instead of {tuple(e[k].shape)}"
        if not torch.equal(e[k], g[k]):
            return f"{k} differs by {(e[k].double() - g[k].double()).abs().nan_to_num(0).max().item():.3g}"
    return None


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"


def _model(family, name, dtype=torch.float32):
    import test_sweep as sweep

    model = sweep._build(family, name)
    if isinstance(model, str):
        return model
    model = model.to(dtype)
    if model.config.is_encoder_decoder and model.generation_config.decoder_start_token_id is None:
        model.generation_config.decoder_start_token_id = 1  # (the t5 family's configs leave it unset)
    return model


def generate_architecture(family, name, fractions=(0.3, 0.12), modes=tuple(MODES), dtype=torch.float32) -> dict:
    """(fraction, mode) -> None where wrapped and unwrapped agree bit for bit, else "skip: why",
    "warned: what differs" (offtensor warned that it may) or "fail: what"."""
    import test_sweep as sweep

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _model(family, name, dtype)
        if isinstance(model, str):
            return {(None, None): f"skip: {model}"}
        ids, reference, reference_assistant = _prompt(), copy.deepcopy(model), copy.deepcopy(model)
        expected = {}
        for mode in modes:
            try:
                expected[mode] = MODES[mode](reference, ids, reference_assistant)
            except Exception as e:  # the mode does not run on this architecture unwrapped
                expected[mode] = f"skip: fails unwrapped too: {_error(e)}"
    results = {}
    for fraction in fractions:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            wrapped, assistant = copy.deepcopy(model), copy.deepcopy(model)
            budget = fraction * sweep._weight_bytes(model) / GiB
            try:
                ot.wrap_model(wrapped, budget_gb=budget, device="cpu")
                ot.wrap_model(assistant, budget_gb=budget, device="cpu")
            except ot.BudgetError:
                results[(fraction, None)] = "skip: refused at wrap time"
                continue
            got = {}
            for mode in modes:
                try:
                    got[mode] = MODES[mode](wrapped, ids, assistant)
                except Exception as e:
                    got[mode] = e
        warned = any(str(w.message).startswith("offtensor:") and "differ" in str(w.message) for w in caught)
        for mode in modes:
            results[(fraction, mode)] = _verdict(expected[mode], got[mode], warned)
        stats = ot.stats(wrapped)
        if stats.peak_device_bytes > stats.budget_bytes:
            results[(fraction, "peak")] = f"fail: peak {stats.peak_device_bytes} bytes over {stats.budget_bytes}"
    return results


def _verdict(expected, got, warned: bool):
    if isinstance(expected, str):
        return expected
    if isinstance(got, Exception):
        return f"fail: {_error(got)}"
    difference = _difference(expected, got)
    if difference is None:
        return None
    return f"warned: {difference}" if warned else f"fail: {difference}"


F32, BF16 = torch.float32, torch.bfloat16
TARGETED = [
    # llama4's expert stack under autocast: a lazy cast tiled by bmm (failed before the dtype fix)
    ("moe", "llama4_text", 0.3, ("autocast",), F32),
    # bfloat16 beams against an LM head paged in tiles (test_tiles_same_kernel.py: differed before)
    ("decoder", "granite_swa", 0.12, ("beam",), BF16),
    ("decoder", "gpt2", 0.12, ("beam_batch_pad", "continue_cache", "assisted"), F32),
    ("decoder", "gemma2", 0.3, ("sliding_window", "static_batch_pad"), F32),
    ("moe", "mixtral", 0.12, ("sample", "static", "guidance"), F32),
    ("encoder-decoder", "t5", 0.12, ("beam_sample", "continue_cache", "prompt_lookup"), F32),
    ("encoder-decoder", "bart", 0.3, ("assisted_sample", "attn_hidden"), F32),
]


@pytest.mark.parametrize("family, name, fraction, modes, dtype", TARGETED)
def test_generate_modes_of_an_architecture_give_the_unwrapped_results(family, name, fraction, modes, device, dtype):
    if device != "cpu":
        pytest.skip("the sweep compares on the emulated device (autocast on 'cpu')")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # (as on two cores; the bfloat16 case differed there)
    try:
        results = generate_architecture(family, name, (fraction,), modes, dtype)
    finally:
        torch.set_num_threads(before)
    skipped = {k: v for k, v in results.items() if v and v.startswith("skip")}
    assert not skipped, skipped  # each case is chosen to run here
    assert all(v is None for v in results.values()), results


class _Experts(nn.Module):
    """An expert stack applied with bmm, as llama4's and gpt-oss's experts are."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 32, 64))

    def forward(self, x, op):
        if op == "bmm":
            return torch.bmm(x, self.w)
        if op == "baddbmm":
            return torch.baddbmm(torch.ones(4, x.shape[1], 64), x, self.w)
        return torch.einsum("eti,eio->eto", x, self.w)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("op", ["bmm", "baddbmm", "einsum"])
def test_autocast_of_a_stack_larger_than_the_room_runs_in_tiles_at_the_cast_dtype(op, grad, device):
    """Autocast casts a weight that requires grad lazily, also under no_grad (torch caches that
    cast with grad on); the tiled product checks its arguments at the cast's dtype, as the unwrapped
    op sees them, and gives the unwrapped result bit for bit."""
    torch.manual_seed(0)
    model = _Experts()
    reference = copy.deepcopy(model).to(device)
    ot.wrap_model(model, budget_gb=0.5 * 4 * 32 * 64 * 4 / GiB, device=device, policy={"offload": ["*"]})
    x = torch.randn(4, 3, 32, device=device)
    with torch.set_grad_enabled(grad), torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
        expected, got = reference(x, op), model(x, op)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, expected)
    stats = ot.stats(model)
    assert stats.peak_device_bytes <= stats.budget_bytes


@pytest.mark.skipif(os.environ.get("OFFTENSOR_GENERATE_SWEEP") != "1", reason="OFFTENSOR_GENERATE_SWEEP=1 runs it")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["decoder", "moe", "encoder-decoder"])
def test_generate_sweep_of_tiny_architectures(family, dtype, device):
    import test_sweep as sweep

    if device != "cpu":
        pytest.skip("the sweep compares on the emulated device (autocast on 'cpu')")
    failed, counts = {}, {"ok": 0, "skip": 0, "warned": 0, "fail": 0}
    for name in sweep.FAMILIES[family][1]:
        for key, verdict in generate_architecture(family, name, dtype=dtype).items():
            kind = "ok" if verdict is None else verdict.split(":")[0]
            counts[kind] += 1
            if kind == "fail":
                failed[(name, *key)] = verdict
    print(f"\ngenerate sweep, {family}, {dtype}: {counts}")
    assert not failed, "\n".join(f"{k}: {v}" for k, v in failed.items())
