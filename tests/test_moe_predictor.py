"""The learned look-ahead (offtensor.moe.predictor): a ridge fit recovers a planted linear routing
and is kept only where it beats the router look-ahead, it survives a save and load beside a
checkpoint, an installed one decides the speculator's guesses, and a guess's copy never evicts an
expert whose expected next use is sooner than the guess's own."""

from __future__ import annotations

import pytest
import torch

import offtensor as ot
from offtensor.model.state import pager_of
from offtensor.moe import eviction as ot_eviction
from offtensor.moe import guesses as ot_guesses
from offtensor.moe import speculation as ot_speculation
from offtensor.moe.predictor import LookaheadPredictor, fit_ridge, install, top_k_precision

transformers = pytest.importorskip("transformers")


def _planted(n: int, hidden: int = 24, experts: int = 12, k: int = 2, layers: int = 3, seed: int = 0):
    """Hidden states of ``layers`` MoE layers and each layer's routing: layer i + 1 routes to the
    top-k of a planted linear map of layer i's hidden state."""
    g = torch.Generator().manual_seed(seed)
    maps = [torch.randn(experts, hidden, generator=g) for _ in range(layers)]
    xs = [torch.randn(n, hidden, generator=torch.Generator().manual_seed(seed + 100 + i)) for i in range(layers)]
    routed = [torch.randn(n, experts, generator=g).topk(k, -1).indices]  # layer 0: nothing to predict from
    routed += [(xs[i] @ maps[i].T).topk(k, -1).indices for i in range(layers - 1)]
    return xs, routed, maps


def test_fit_recovers_a_planted_linear_routing():
    xs, routed, maps = _planted(4000)
    w, b = fit_ridge(xs[0], routed[1], 12)
    held = torch.randn(1000, 24, generator=torch.Generator().manual_seed(7))
    truth = (held @ maps[0].T).topk(2, -1).indices
    learned = top_k_precision(torch.nn.functional.linear(held, w, b), truth)
    chance = top_k_precision(torch.randn(1000, 12, generator=torch.Generator().manual_seed(8)), truth)
    # A least-squares fit of one-hot targets ranks like the planted map on most held-out tokens
    # (the top-k of a linear map is not itself linear, so not on all of them).
    assert learned >= 0.8 and learned > chance + 0.5, (learned, chance)


def test_the_learned_lookahead_is_kept_only_where_it_beats_the_router_lookahead():
    xs, routed, maps = _planted(3000)
    predictor = LookaheadPredictor.fit(xs, routed, 12)
    hx, _, _ = _planted(800, seed=5)
    hr = [None] + [(hx[i] @ maps[i].T).topk(2, -1).indices for i in range(2)]
    # The same planted maps route the new hidden states. Layer 0's router look-ahead is the map itself (right every time), layer 1's is noise.
    router_ahead = [hx[0] @ maps[0].T, torch.randn(800, 12)]
    scores = predictor.compare(hx, hr, router_ahead)
    assert scores[0]["router"] == 1.0 and scores[1]["learned"] > scores[1]["router"], scores
    assert predictor.keep() == [1]


def test_a_saved_lookahead_loads_with_the_same_weights_and_scores(tmp_path):
    xs, routed, _ = _planted(500)
    predictor = LookaheadPredictor.fit(xs, routed, 12)
    predictor.scores = {0: {"learned": 0.9, "router": 0.5}}
    predictor.save(str(tmp_path))
    loaded = LookaheadPredictor.load(str(tmp_path))
    assert sorted(loaded.weights) == sorted(predictor.weights) and loaded.scores == predictor.scores
    for i in predictor.weights:
        assert torch.equal(loaded.weights[i], predictor.weights[i]) and torch.equal(loaded.biases[i], predictor.biases[i])


def _qwen3(layers: int = 4):
    config = transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_attention_heads=4, max_position_embeddings=64, num_hidden_layers=layers,
        num_key_value_heads=2, head_dim=16, intermediate_size=256, moe_intermediate_size=64, num_experts=16,
        num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[])
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _wrap_quarter(model, device="cpu"):
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() * 4 for p in model.parameters())
    return ot.wrap_model(model, budget_gb=(total - 0.75 * experts) / (1 << 30), device=device,
                         policy={"offload": ["*.experts.*"]})


def _decode(model, steps: int):
    ids = torch.randint(0, 128, (1, steps + 4), generator=torch.Generator().manual_seed(1))
    out = []
    with torch.no_grad():
        cache = None
        for t in range(steps):
            x = ids[:, :4] if cache is None else ids[:, 3 + t:4 + t]
            r = model(input_ids=x, past_key_values=cache, use_cache=True)
            cache = r.past_key_values
            out.append(r.logits)
    return out


def test_an_installed_lookahead_decides_the_next_layers_guess(monkeypatch):
    model = _wrap_quarter(_qwen3())
    predictor = LookaheadPredictor()
    for i in range(3):  # every token's guess for layer i + 1: experts 5, 6, 7, 8 (a bias, no weight)
        predictor.weights[i] = torch.zeros(16, 64)
        predictor.biases[i] = torch.tensor([0.0] * 5 + [9.0, 8.0, 7.0, 6.0] + [0.0] * 7)
    assert len(install(pager_of(model), predictor)) == 3
    routers = pager_of(model).experts.speculator.routers
    # The layers it guesses were measured held out: their bins need less evidence of their own.
    assert [r.evidence for r in routers] == [ot_guesses.SPECULATE_EVIDENCE] + \
        [ot_guesses.SPECULATE_EVIDENCE_LEARNED] * 3
    guesses = []
    real_issue = ot_speculation.RoutingSpeculator._issue

    def issue(self, pager, router, confidence, tokens):
        guesses.append((router.name, list(confidence)[:4]))
        return real_issue(self, pager, router, confidence, tokens)

    monkeypatch.setattr(ot_speculation.RoutingSpeculator, "_issue", issue)
    _decode(model, 3)
    assert guesses and all(top == [5, 6, 7, 8] for _, top in guesses), guesses
    assert {name for name, _ in guesses} == {f"model.layers.{i}.mlp.gate" for i in (1, 2, 3)}


def test_a_guess_never_evicts_an_expert_used_sooner_than_the_guess(monkeypatch):
    # Every guess pays (no precision gate), so guesses are copied wherever room allows; each
    # eviction made for a guess's copy is checked against the guess's own expected next use.
    monkeypatch.setattr(ot_guesses, "SPECULATE_PRECISION", 0.0)
    monkeypatch.setattr(ot_guesses, "SPECULATE_EVIDENCE", 0.0)
    monkeypatch.setattr(ot_speculation, "SPECULATE_EXPERTS", 4)
    monkeypatch.setattr(ot_eviction, "SPECULATE_VICTIM_CYCLES", 0.0)  # only the guess's own next use limits
    reference = _qwen3()
    model = _wrap_quarter(_qwen3())
    checked, limits = [], []
    real_room = ot_eviction.ExpertEviction.in_spare_room_only
    real_victim = ot_eviction.ExpertEviction.victim

    def room(self, next_use=None):
        limits.append(next_use)
        return real_room(self, next_use)

    def victim(self, view, room_bytes, candidates):
        out = real_victim(self, view, room_bytes, candidates)
        if self._spare_room_only and out is not None and out.key[0] in self.by_master:
            checked.append((self.expected_use_of(out.key), limits[-1]))
        return out

    monkeypatch.setattr(ot_eviction.ExpertEviction, "in_spare_room_only", room)
    monkeypatch.setattr(ot_eviction.ExpertEviction, "victim", victim)
    got, want = _decode(model, 12), _decode(reference, 12)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert limits and all(limit is not None for limit in limits)
    assert checked, "no guess evicted anything: the test checked nothing"
    assert all(use >= limit for use, limit in checked), [c for c in checked if c[0] < c[1]]


def test_fit_two_ahead_recovers_a_routing_planted_two_layers_on_and_keeps_it_where_it_is_right():
    xs, routed, maps = _planted(4000)
    # Layer 2 routes by a planted map of layer 0's hidden state (two layers ahead).
    plant = torch.randn(12, 24, generator=torch.Generator().manual_seed(3))
    routed[2] = (xs[0] @ plant.T).topk(2, -1).indices
    predictor = LookaheadPredictor.fit(xs, routed, 12)
    assert sorted(predictor.weights2) == [0]  # only layer 0 has a layer two on
    hx, _, _ = _planted(800, seed=5)
    hr = [None, (hx[0] @ maps[0].T).topk(2, -1).indices, (hx[0] @ plant.T).topk(2, -1).indices]
    scores = predictor.compare(hx, hr, [hx[0] @ maps[0].T, torch.randn(800, 12)])
    chance = top_k_precision(torch.randn(800, 12), hr[2])
    assert scores[0]["learned2"] >= 0.8 and scores[0]["learned2"] > chance + 0.5, scores
    predictor.keep()
    assert sorted(predictor.weights2) == [0]
    predictor.scores[0]["learned2"] = 0.5  # below TWO_AHEAD_PRECISION: dropped
    predictor.keep()
    assert predictor.weights2 == {} and predictor.biases2 == {}


def test_the_last_layer_is_fitted_to_the_next_tokens_first_layer():
    # Sequences of 50 tokens; the first layer of token t + 1 routes by a planted map of the last
    # layer's hidden state at token t (what the next decode step's first layer will page).
    xs, routed, _ = _planted(4000)
    plant = torch.randn(12, 24, generator=torch.Generator().manual_seed(4))
    nxt = (xs[2] @ plant.T).topk(2, -1).indices.view(80, 50, 2)
    routed[0] = torch.cat([routed[0].view(80, 50, 2)[:, :1], nxt[:, :-1]], 1).reshape(-1, 2)
    predictor = LookaheadPredictor.fit(xs, routed, 12, seq=50)
    assert sorted(predictor.weights) == [0, 1, 2]
    with pytest.raises(ValueError, match="seq"):
        LookaheadPredictor.fit(xs, routed, 12, seq=3000)
    scores = predictor.compare(xs, routed, [torch.randn(4000, 12) for _ in range(3)], seq=50)
    assert scores[2]["learned"] >= 0.8 and scores[2]["learned"] > scores[2]["router"] + 0.5, scores
    # Without the first router's scores on the last layer's input, only the learned map is measured.
    assert predictor.compare(xs, routed, [torch.randn(4000, 12) for _ in range(2)], seq=50)[2]["router"] == 0.0


def test_a_saved_two_ahead_map_loads_back(tmp_path):
    xs, routed, _ = _planted(500)
    predictor = LookaheadPredictor.fit(xs, routed, 12)
    predictor.save(str(tmp_path))
    loaded = LookaheadPredictor.load(str(tmp_path))
    assert sorted(loaded.weights2) == sorted(predictor.weights2) == [0]
    assert torch.equal(loaded.weights2[0], predictor.weights2[0]) and torch.equal(loaded.biases2[0], predictor.biases2[0])


def _biased(experts: list) -> torch.Tensor:
    bias = torch.zeros(16)
    for rank, e in enumerate(experts):
        bias[e] = 9.0 - rank
    return bias


@pytest.mark.parametrize("next_step", [False, True])
def test_an_installed_two_ahead_map_guesses_the_layer_after_next_and_the_last_the_next_step(monkeypatch, next_step):
    monkeypatch.setattr(ot_speculation, "SPECULATE_NEXT_STEP", next_step)
    model = _wrap_quarter(_qwen3())
    reference = _qwen3()
    predictor = LookaheadPredictor()
    for i in range(4):  # one layer ahead: 5, 6, 7, 8 (the last layer's: the next step's first layer)
        predictor.weights[i], predictor.biases[i] = torch.zeros(16, 64), _biased([5, 6, 7, 8])
    for i in range(2):  # two layers ahead: 9, 10, 11, 12
        predictor.weights2[i], predictor.biases2[i] = torch.zeros(16, 64), _biased([9, 10, 11, 12])
    install(pager_of(model), predictor)
    routers = pager_of(model).experts.speculator.routers
    assert [r.split for r in routers] == [16, 16, None, None]  # one matmul guesses both
    # Every router's guess was measured held out (the first's by the last layer's map).
    assert all(r.evidence == ot_guesses.SPECULATE_EVIDENCE_LEARNED for r in routers)
    guesses = []
    real_issue = ot_speculation.RoutingSpeculator._issue

    def issue(self, pager, router, confidence, tokens, ahead=1, idle=True):
        guesses.append((router.name, ahead, list(confidence)[:4]))
        return real_issue(self, pager, router, confidence, tokens, ahead, idle)

    monkeypatch.setattr(ot_speculation.RoutingSpeculator, "_issue", issue)
    got, want = _decode(model, 4), _decode(reference, 4)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    name = "model.layers.{}.mlp.gate".format
    # The first layer is guessed (at the end of the step before) only with SPECULATE_NEXT_STEP.
    first_guessed = {(name(0), 1)} if next_step else set()
    assert {(n, a) for n, a, _ in guesses} == {(name(i), 1) for i in (1, 2, 3)} | first_guessed | \
        {(name(i), 2) for i in (2, 3)}
    assert all(top == ([5, 6, 7, 8] if a == 1 else [9, 10, 11, 12]) for _, a, top in guesses), guesses
    # That guess is scored against the next step's routing.
    first = pager_of(model).experts.speculator.report()["routers"][name(0)]
    assert (first["guessed"] > 0 and first["routed"] > 0) == next_step, first


def test_a_fused_guess_without_a_layer_after_next_guesses_only_the_next_layers_experts():
    # A layer whose look-ahead also holds a two-ahead map, when the layer after next is unknown
    # (not yet learned, or no top-k): only the first E scores are the next layer's.
    model = _wrap_quarter(_qwen3())
    _decode(model, 2)
    speculator = pager_of(model).experts.speculator
    nxt = speculator.routers[1]
    scores = torch.zeros(1, 32)
    scores[0, 16:20] = 9.0  # the two-ahead half names experts 0-3 of another layer: not nxt's 16-19
    scores[0, [5, 6, 7, 8]] = 5.0
    speculator._queue(nxt, scores, 1, None, 16)
    speculator.issue_ready()
    assert nxt.guess is not None and all(e < 16 for e in nxt.guess), nxt.guess
    assert set(list(nxt.guess)[:4]) == {5, 6, 7, 8}


def test_online_refit_records_the_decode_and_installs_what_beat_the_router_lookahead():
    from offtensor.moe.refit import OnlineRefit

    model = _wrap_quarter(_qwen3())
    reference = _qwen3()
    pager = pager_of(model)
    with pytest.raises(ValueError, match="window >= minimum"):
        OnlineRefit(pager, every=8, window=8, minimum=16)
    refit = OnlineRefit(pager, every=24, window=64, minimum=24)
    installed = []
    real_refit = refit.refit
    refit.refit = lambda: installed.append(real_refit()) or installed[-1]
    got, want = _decode(model, 30), _decode(reference, 30)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # guesses never change a result
    # 28 one-token passes recorded (not the prefill; the last pass is recorded when the next
    # forward begins), a refit at the 24th.
    assert refit.refits == 1 and len(refit.steps) == 28 and refit.since == 4, (refit.refits, len(refit.steps))
    routers = [r for r in pager.experts.speculator.routers if r.stacks]
    kept = sorted(refit.predictor.weights)
    assert installed == [[routers[i].name for i in kept]]
    assert all((r.lookahead is not None) == (i in kept) for i, r in enumerate(routers))
    # Kept only where it was right more often than the router look-ahead on the held-out quarter.
    assert all(refit.predictor.scores[i]["learned"] > refit.predictor.scores[i]["router"] for i in kept)


def test_online_refit_learns_a_planted_routing_the_router_lookahead_misses():
    from offtensor.moe.refit import OnlineRefit

    model = _wrap_quarter(_qwen3())
    _decode(model, 2)  # the speculator learns its routers' stacks
    refit = OnlineRefit(pager_of(model), every=10_000, window=400, minimum=64)
    # 400 recorded decode steps: layer i + 1 routes by a planted map of layer i's router input,
    # the first layer by one of the last layer's input at the step before.
    g = torch.Generator().manual_seed(0)
    maps = [torch.randn(16, 64, generator=g) for _ in range(4)]
    xs = torch.randn(400, 4, 64, generator=g)
    for t in range(400):
        ids = [(xs[t - 1, 3] if t else torch.randn(64, generator=g)) @ maps[3].T] + \
            [xs[t, i] @ maps[i].T for i in range(3)]
        refit.steps.append([(xs[t, i], ids[i].topk(4).indices.sort().values) for i in range(4)])
    names = refit.refit()
    scores = refit.predictor.scores
    assert sorted(refit.predictor.weights) == [0, 1, 2, 3], scores  # every map beat the model's routers
    assert all(scores[i]["learned"] >= 0.6 and scores[i]["learned"] > scores[i]["router"] + 0.2 for i in range(4)), scores
    routers = [r for r in pager_of(model).experts.speculator.routers if r.stacks]
    assert names == [r.name for r in routers] and all(r.lookahead is not None for r in routers)
