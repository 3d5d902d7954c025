"""The learned look-ahead with a hidden layer (``LookaheadPredictor.fit(..., hidden=)``): it ranks
a routing no linear map of the hidden state can, the same inputs give the same maps, it survives a
save and load beside a checkpoint, and installed it decides the speculator's guesses with the same
scores as the predictor's, with a decode's logits unchanged."""

from __future__ import annotations

import pytest
import torch

import offtensor as ot
from offtensor.model.state import pager_of
from offtensor.moe import speculation as ot_speculation
from offtensor.moe.predictor import LookaheadPredictor, fit_hidden, fit_ridge, hidden_layer, install, top_k_precision

transformers = pytest.importorskip("transformers")
from test_moe_predictor import _decode, _qwen3  # noqa: E402  (the tiny Qwen3-MoE the look-ahead tests build)


def _even(n: int, hidden: int = 16, experts: int = 8, k: int = 2, layers: int = 3, seed: int = 0):
    """Hidden states of ``layers`` MoE layers, layer i + 1 routed to the top-k of a planted map of
    the squares of layer i's hidden state: a routing that is even in the state (x and -x route
    alike), so every linear map of the state ranks the experts no better than chance."""
    g = torch.Generator().manual_seed(seed)
    maps = [torch.randn(experts, hidden, generator=g) for _ in range(layers)]
    xs = [torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed + 100 + i)) for i in range(layers)]
    routed = [torch.randn(n, experts, generator=g).topk(k, -1).indices]
    routed += [((xs[i] ** 2) @ maps[i].T).topk(k, -1).indices for i in range(layers - 1)]
    return xs, routed, maps


def test_a_hidden_layer_ranks_a_routing_no_linear_map_can():
    xs, routed, maps = _even(6000)
    held = torch.randn(2000, 16, generator=torch.Generator().manual_seed(7))
    truth = ((held ** 2) @ maps[0].T).topk(2, -1).indices
    w, b = fit_ridge(xs[0], routed[1], 8)
    linear = top_k_precision(torch.nn.functional.linear(held, w, b), truth)
    (w1, b1), [(w2, b2)] = fit_hidden(xs[0], [(routed[1], None, "guess")], 8, hidden=64)
    learned = top_k_precision(torch.nn.functional.linear(hidden_layer(held, w1, b1), w2, b2), truth)
    # A linear map does no better than naming the experts routed most often (what its bias learns).
    popular = torch.bincount(routed[1].reshape(-1), minlength=8).float().expand(2000, 8)
    often = top_k_precision(popular + 1e-3 * torch.rand(2000, 8, generator=torch.Generator().manual_seed(9)), truth)
    assert linear < often + 0.05 and learned > often + 0.3, (linear, often, learned)


def test_the_same_routing_fits_the_same_hidden_maps():
    xs, routed, _ = _even(1000)
    a = LookaheadPredictor.fit(xs, routed, 8, hidden=16)
    b = LookaheadPredictor.fit(xs, routed, 8, hidden=16)
    assert sorted(a.hidden_layers) == [0, 1] and sorted(a.weights) == [0, 1] and sorted(a.weights2) == [0]
    for i in a.hidden_layers:
        assert all(torch.equal(u, v) for u, v in zip(a.hidden_layers[i], b.hidden_layers[i]))
        assert torch.equal(a.weights[i], b.weights[i]) and a.weights[i].shape == (8, 16)


def test_a_saved_hidden_lookahead_loads_with_the_same_maps(tmp_path):
    xs, routed, _ = _even(600)
    seq = 50
    predictor = LookaheadPredictor.fit(xs, routed, 8, seq=seq, hidden=16)
    # With seq: the last layer guesses the next token's first, every layer its own next token.
    assert sorted(predictor.weights) == [0, 1, 2] and sorted(predictor.own_weights) == [0, 1, 2]
    predictor.save(str(tmp_path))
    loaded = LookaheadPredictor.load(str(tmp_path))
    x = torch.randn(5, 16)
    for i in range(3):
        assert torch.equal(loaded.logits(i, x), predictor.logits(i, x))
        assert torch.equal(loaded.own_logits(i, x), predictor.own_logits(i, x))
    assert torch.equal(loaded.logits2(0, x), predictor.logits2(0, x))


def test_an_installed_hidden_lookahead_guesses_what_the_predictor_scores(monkeypatch):
    reference = _qwen3()
    model = _qwen3()
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() * 4 for p in model.parameters())
    ot.wrap_model(model, budget_gb=(total - 0.75 * experts) / (1 << 30), device="cpu",
                  policy={"offload": ["*.experts.*"]})
    g = torch.Generator().manual_seed(3)
    predictor = LookaheadPredictor()
    for i in range(3):
        predictor.hidden_layers[i] = (torch.randn(32, 64, generator=g), torch.randn(32, generator=g))
        predictor.weights[i], predictor.biases[i] = torch.randn(16, 32, generator=g), torch.zeros(16)
    install(pager_of(model), predictor)
    routers = pager_of(model).experts.speculator.routers
    assert [len(r.lookahead) if r.lookahead is not None else 0 for r in routers] == [4, 4, 4, 0]
    inputs, guesses = {}, []
    real_ran, real_issue = ot_speculation.RoutingSpeculator.router_ran, ot_speculation.RoutingSpeculator._issue

    def ran(self, router, x):
        inputs[router.name] = x.detach().reshape(-1, x.shape[-1]).clone()
        return real_ran(self, router, x)

    def issue(self, pager, router, confidence, tokens, ahead=1, idle=True):
        guesses.append((router.name, list(confidence)))
        return real_issue(self, pager, router, confidence, tokens, ahead, idle)

    monkeypatch.setattr(ot_speculation.RoutingSpeculator, "router_ran", ran)
    monkeypatch.setattr(ot_speculation.RoutingSpeculator, "_issue", issue)
    got, want = _decode(model, 3), _decode(reference, 3)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    name = "model.layers.{}.mlp.gate".format
    assert guesses
    # The last guess of each layer was made from its previous layer's input at the last step:
    # its experts in order are the predictor's top-4 of that one token.
    last = {}
    for router, confidence in guesses:
        last[router] = confidence
    for i in range(3):
        expected = predictor.logits(i, inputs[name(i)][-1:]).topk(4, -1).indices[0].tolist()
        assert last[name(i + 1)][:4] == expected, (i, last[name(i + 1)], expected)


@pytest.mark.parametrize("hidden", [0, -3, 2.5])
def test_a_hidden_width_that_is_no_positive_whole_number_is_refused(hidden):
    xs, routed, _ = _even(100)
    with pytest.raises(ValueError, match="hidden"):
        LookaheadPredictor.fit(xs, routed, 8, hidden=hidden)
