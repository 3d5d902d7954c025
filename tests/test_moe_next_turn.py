"""The learned look-ahead's next-token map and the eviction that uses it: a logistic fit recovers
a planted next-token routing with chances that add up to the top-k, it is kept only where it ranks
the next token's experts better than the previous token's experts do, it survives a save and
load, an installed one is more rows of the same matmul and tells eviction each layer's chances
(a prefill forgets them), an expert its layer is predicted to use is not evicted while another
can go, and ``fit_offline`` records a model's routing, fits and writes the file beside a
checkpoint."""

from __future__ import annotations

import os

import pytest
import torch

import offtensor as ot
from offtensor.model.state import pager_of
from offtensor.moe.predictor import FILE_NAME, LookaheadPredictor, fit_logistic, install, top_k_precision
from offtensor.moe.stacks import ExpertStacks

transformers = pytest.importorskip("transformers")

from test_moe_predictor import _qwen3  # noqa: E402  (the same tiny Qwen3-MoE the look-ahead tests build)


def _next_token_planted(sequences: int = 60, seq: int = 50, hidden: int = 24, experts: int = 12, k: int = 2,
                        layers: int = 2, seed: int = 0):
    """Hidden states of ``layers`` MoE layers over sequences of ``seq`` tokens. Layer 0's token t + 1
    routes to the top-k of a planted map of its token t's hidden state; layer 1's token t + 1 routes
    to exactly what its token t did (the previous token's experts say it all)."""
    g = torch.Generator().manual_seed(seed)
    n = sequences * seq
    xs = [torch.randn(n, hidden, generator=g) for _ in range(layers)]
    plant = torch.randn(experts, hidden, generator=g)
    nxt = (xs[0] @ plant.T).topk(k, -1).indices.view(sequences, seq, k)
    first = torch.randn(sequences, 1, experts, generator=g).topk(k, -1).indices
    routed0 = torch.cat([first, nxt[:, :-1]], 1).reshape(n, k)
    same = torch.randn(sequences, 1, experts, generator=g).topk(k, -1).indices.expand(sequences, seq, k)
    routed1 = same.reshape(n, k).contiguous()
    return xs, [routed0, routed1], plant


def test_fit_logistic_recovers_a_planted_next_token_routing_with_chances_that_add_up_to_top_k():
    xs, routed, plant = _next_token_planted()
    w, b = fit_logistic(xs[0], (xs[0] @ plant.T).topk(2, -1).indices, 12)
    held = torch.randn(1000, 24, generator=torch.Generator().manual_seed(9))
    truth = (held @ plant.T).topk(2, -1).indices
    chances = torch.sigmoid(torch.nn.functional.linear(held, w, b))
    assert top_k_precision(chances, truth) >= 0.8, top_k_precision(chances, truth)
    # Calibrated marginals: each token's chances sum to about the two experts it routes to.
    assert abs(float(chances.sum(-1).mean()) - 2.0) < 0.3, float(chances.sum(-1).mean())


def test_next_token_maps_are_kept_only_where_they_beat_the_previous_tokens_experts():
    xs, routed, _ = _next_token_planted()
    predictor = LookaheadPredictor.fit(xs, routed, 12, seq=50)
    assert sorted(predictor.own_weights) == [0, 1]
    hx, hr, _ = _next_token_planted(sequences=20, seed=5)
    # (the held-out set's layer 0 routes by another draw of the plant: refit it from the same map)
    hr[0] = torch.cat([hr[0].view(20, 50, 2)[:, :1], (hx[0] @ _next_token_planted()[2].T).topk(2, -1).indices
                       .view(20, 50, 2)[:, :-1]], 1).reshape(-1, 2)
    scores = predictor.compare(hx, hr, [torch.randn(1000, 12), torch.randn(1000, 12)], seq=50)
    assert scores[0]["own"] >= 0.8 and scores[0]["own"] > scores[0]["reuse"] + 0.5, scores
    assert scores[1]["reuse"] == 1.0 and scores[1]["own"] < 1.0, scores  # reuse is exact there
    predictor.keep()
    assert sorted(predictor.own_weights) == [0] and sorted(predictor.own_biases) == [0]


def test_a_saved_next_token_map_loads_back(tmp_path):
    xs, routed, _ = _next_token_planted(sequences=10)
    predictor = LookaheadPredictor.fit(xs, routed, 12, seq=50)
    predictor.save(str(tmp_path))
    loaded = LookaheadPredictor.load(str(tmp_path))
    assert sorted(loaded.own_weights) == sorted(predictor.own_weights) == [0, 1]
    for i in predictor.own_weights:
        assert torch.equal(loaded.own_weights[i], predictor.own_weights[i])
        assert torch.equal(loaded.own_biases[i], predictor.own_biases[i])


def _wrap_quarter(model, cached: float = 0.25):
    experts = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." in n)
    total = sum(p.numel() * 4 for p in model.parameters())
    return ot.wrap_model(model, budget_gb=(total - (1 - cached) * experts) / (1 << 30), device="cpu",
                         policy={"offload": ["*.experts.*"]})


def _decode(model, steps: int, prefill: int = 4, after=None, ids=None):
    """Logits (on the host) of a prefill and ``steps - 1`` decode steps of ``ids`` (128-token
    vocabulary ids, seeded ones by default) on the model's device; each step's token is read as a
    decode loop reads it (generate does) before the next; ``after(t)`` is called after pass t."""
    if ids is None:
        ids = torch.randint(0, 128, (steps + prefill,), generator=torch.Generator().manual_seed(1))
    ids = ids[None].to(model.get_input_embeddings().weight.device)
    out = []
    with torch.no_grad():
        cache = None
        for t in range(steps):
            x = ids[:, :prefill] if cache is None else ids[:, prefill - 1 + t:prefill + t]
            r = model(input_ids=x, past_key_values=cache, use_cache=True)
            cache = r.past_key_values
            r.logits[0, -1].argmax().item()
            out.append(r.logits.cpu())
            if after is not None:
                after(t)
    return out


def _predicting(likely: list, layers: int = 4, hidden: int = 64, experts: int = 16) -> LookaheadPredictor:
    """A predictor whose maps ignore their input (biases only): each next layer guessed as experts
    5-8, and each layer's own next turn as ``likely`` (chance about 1, every other about 0)."""
    predictor = LookaheadPredictor()
    own = torch.full((experts,), -9.0)
    own[likely] = 9.0
    for i in range(layers):
        predictor.weights[i], predictor.biases[i] = torch.zeros(experts, hidden), torch.zeros(experts)
        predictor.biases[i][5:9] = 5.0
        predictor.own_weights[i], predictor.own_biases[i] = torch.zeros(experts, hidden), own.clone()
    return predictor


def test_an_installed_next_token_map_tells_eviction_each_layers_chances_and_a_prefill_forgets_them():
    model = _wrap_quarter(_qwen3())
    reference = _qwen3()
    install(pager_of(model), _predicting([1, 2]))
    routers = [r for r in pager_of(model).experts.speculator.routers if r.stacks]
    # One matmul a layer: 16 rows guess the next layer, the 16 from ``own`` on are its own next turn.
    assert [r.own for r in routers] == [16] * 4 and all(r.lookahead[0].shape[0] == 32 for r in routers)
    got, want = _decode(model, 5), _decode(reference, 5)
    assert all(torch.equal(a, b) for a, b in zip(got, want))  # predictions only move bytes
    next_turn = pager_of(model).experts.eviction.next_turn
    groups = {r.stacks[0].group for r in routers}
    # Every layer but the last has a prediction; the last has one where it copied in the last step.
    for group in groups:
        chances = next_turn.of(group)
        if chances is None:
            continue
        assert chances[1] > 0.99 and chances[2] > 0.99 and max(chances[3:]) < 0.01, chances
        assert next_turn.likely(group) >= {1, 2}
    assert sum(next_turn.of(g) is not None for g in groups) >= 3
    with torch.no_grad():  # a prefill: its next turn is no single token's, so nothing is predicted
        model(input_ids=torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(3)))
    assert all(next_turn.of(g) is None for g in groups)


def _evicted_experts(monkeypatch, predictor) -> list:
    """The experts evicted over a decode of a model wrapped at 25% of its experts, from the third
    pass on (the first learns the layer order, which the predictions need); with ``predictor``,
    those of layers with a prediction when evicted (the last layer has one only after a step in
    which it copied)."""
    model = _wrap_quarter(_qwen3())
    if predictor is not None:
        install(pager_of(model), predictor)
    evicted, passes = [], [0]
    real = ExpertStacks.evicted  # (the pager's call: its bookkeeping may be one native call, past ExpertEviction's)

    def record(self, key):
        stack = self.by_master.get(key[0])
        if stack is not None and passes[0] >= 2 and (predictor is None or self.eviction.next_turn.of(stack.group)):
            evicted.append(stack.expert_of(key))
        return real(self, key)

    monkeypatch.setattr(ExpertStacks, "evicted", record)
    _decode(model, 24, after=lambda t: passes.__setitem__(0, t + 1))
    return evicted


def test_an_expert_its_layer_is_predicted_to_use_is_not_evicted_while_another_can_go(monkeypatch):
    # Experts 1 and 2 predicted certain at every layer's next turn: never the victim (there are
    # always others: 4 of 16 are routed a token). Without the prediction the same decode evicts them.
    without = _evicted_experts(monkeypatch, None)
    assert {1, 2} & set(without), without
    monkeypatch.undo()
    with_prediction = _evicted_experts(monkeypatch, _predicting([1, 2]))
    assert with_prediction and not {1, 2} & set(with_prediction), with_prediction


def test_the_prediction_replaces_reuse_in_an_experts_expected_next_use():
    model = _wrap_quarter(_qwen3())
    _decode(model, 3)
    eviction = pager_of(model).experts.eviction
    stack = next(iter(eviction.by_master.values()))
    a, b = 0, 1
    stack.last_used = {b}  # b was routed at its layer's last turn: reuse makes it the likelier
    stack.used = set()
    for e in (a, b):
        eviction.frequency[stack.key_of(e)] = 1.0
    eviction.next_turn.forget([stack])
    if stack.group in eviction.layers.ran:
        eviction.layers.order.remove(stack.group)  # its last turn is the step before
        eviction.layers.ran.discard(stack.group)
    assert eviction.expected_use_of(stack.key_of(b)) < eviction.expected_use_of(stack.key_of(a))
    chances = [0.0] * stack.num_experts
    chances[a], chances[b] = 0.9, 0.05
    eviction.next_turn.predict([stack], chances, 4)
    assert eviction.expected_use_of(stack.key_of(a)) < eviction.expected_use_of(stack.key_of(b))


def test_fit_offline_records_a_models_routing_and_writes_the_lookahead_beside_the_checkpoint(tmp_path):
    from offtensor.moe.refit import fit_offline, record_routing

    model = _qwen3()
    g = torch.Generator().manual_seed(2)
    ids, held = torch.randint(0, 128, (16 * 24,), generator=g), torch.randint(0, 128, (16 * 8,), generator=g)
    xs, routed, ahead = record_routing(model, ids, 24)
    assert len(xs) == 4 and all(x.shape == (16 * 24, 64) for x in xs)
    assert all(r.shape == (16 * 24, 4) for r in routed) and all(a.shape == (16 * 24, 16) for a in ahead)
    # The routed ids are the routers' own: the top-4 of their logits on the recorded inputs.
    gate = model.model.layers[1].mlp.gate
    assert torch.equal(routed[1].sort(-1).values, torch.nn.functional.linear(xs[1], gate.weight).topk(4, -1)
                       .indices.sort(-1).values)
    predictor = fit_offline(model, ids, held, 24, save=str(tmp_path))
    assert os.path.exists(os.path.join(tmp_path, FILE_NAME))
    loaded = LookaheadPredictor.load(str(tmp_path))
    assert loaded.scores == predictor.scores and sorted(loaded.weights) == sorted(predictor.weights)
    assert set(predictor.scores) == {0, 1, 2, 3} and all("own" in s for s in predictor.scores.values())
    with pytest.raises(ValueError, match="two sequences"):
        record_routing(model, ids[:30], 24)


@pytest.mark.parametrize("next_step", [False, True])
@pytest.mark.parametrize("cached", [0.25, 1.0])
def test_guesses_never_read_the_next_token_rows_as_experts(monkeypatch, next_step, cached):
    # The last layer guesses the next step's first (SPECULATE_NEXT_STEP) from the same matmul as its
    # next-token rows, also on steps where its own prediction is not taken (with every expert
    # cached it copies nothing).
    from offtensor.moe import speculation as ot_speculation

    monkeypatch.setattr(ot_speculation, "SPECULATE_NEXT_STEP", next_step)
    model = _wrap_quarter(_qwen3(), cached)
    reference = _qwen3()
    predictor = _predicting([1, 2])
    for i in range(4):  # the next-token rows name experts far above any guess's
        predictor.own_biases[i] = torch.full((16,), 20.0)
    install(pager_of(model), predictor)
    guessed = []
    real_issue = ot_speculation.RoutingSpeculator._issue

    def issue(self, pager, router, confidence, tokens, ahead=1, idle=True):
        guessed.append((router.name, sorted(confidence)))
        return real_issue(self, pager, router, confidence, tokens, ahead, idle)

    monkeypatch.setattr(ot_speculation.RoutingSpeculator, "_issue", issue)
    got, want = _decode(model, 8), _decode(reference, 8)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert guessed and all(e < 16 for _, experts in guessed for e in experts), guessed
    assert any(name == "model.layers.0.mlp.gate" for name, _ in guessed) == next_step


def test_online_refit_fits_the_next_token_maps_inside_an_inference_mode_decode():
    # A refit runs at the start of a forward: under torch.inference_mode its logistic fit still
    # needs autograd (made outside inference mode from the recorded inputs).
    from offtensor.moe.refit import OnlineRefit

    model = _wrap_quarter(_qwen3())
    reference = _qwen3()
    refit = OnlineRefit(pager_of(model), every=16, window=64, minimum=16)
    ids = torch.randint(0, 128, (1, 24), generator=torch.Generator().manual_seed(4))
    got, want = [], []
    with torch.inference_mode():
        for m, out in ((model, got), (reference, want)):
            cache = None
            for t in range(20):
                r = m(input_ids=ids[:, :4] if cache is None else ids[:, 3 + t:4 + t], past_key_values=cache,
                      use_cache=True)
                cache = r.past_key_values
                out.append(r.logits)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert refit.refits == 1 and refit.predictor is not None
    assert set(refit.predictor.scores) == {0, 1, 2, 3} and all("own" in s for s in refit.predictor.scores.values())


def _host_loops(which: str, monkeypatch) -> None:
    """Make the host side of a guess take the native extension's loops, or the interpreter's."""
    from offtensor.moe import guesses

    if which == "native":
        if guesses._NATIVE_GUESS is None:
            pytest.skip("the native extension is not built with the guess loops")
    else:
        monkeypatch.setattr(guesses, "_NATIVE_GUESS", None)
        monkeypatch.setattr(guesses, "_NATIVE_CHANCES", None)


@pytest.mark.parametrize("loops", ["native", "interpreter"])
def test_host_chances_are_one_minus_the_product_of_each_tokens_sigmoid_misses(loops, monkeypatch):
    """The next-token map's chances on the host: for one token (a decode step) its sigmoid per
    expert, for several the chance that any of them routes there; logits far below zero give 0."""
    from offtensor.moe.guesses import host_chances

    _host_loops(loops, monkeypatch)
    logits = torch.tensor([[0.0, 2.0, -1.5, -80.0], [1.0, -3.0, 0.5, -80.0]], dtype=torch.float64)
    one = host_chances(logits[:1])
    assert one == pytest.approx(torch.sigmoid(logits[0]).tolist()[:3] + [0.0])
    both = host_chances(logits)
    want = 1.0 - (1.0 - torch.sigmoid(logits)).prod(0)
    want[3] = 0.0
    assert both == pytest.approx(want.tolist())


@pytest.mark.parametrize("loops", ["native", "interpreter"])
def test_host_guess_is_each_rows_top_k_by_score_with_its_softmax_probability(loops, monkeypatch):
    """A guess on the host: each row's top-k experts, the highest score first and the lower expert
    first among equal scores, each with its softmax probability over the row; None takes them all."""
    from offtensor.moe.guesses import host_guess

    _host_loops(loops, monkeypatch)
    scores = torch.tensor([[0.5, 2.0, 2.0, -1.0, 1.0], [3.0, 0.0, 0.0, 0.0, -2.0]])
    probs = scores.double().softmax(-1)
    got = host_guess(scores, 3)
    assert [e for e, _ in got] == [1, 2, 4, 0, 1, 2]
    assert [p for _, p in got] == pytest.approx([probs[r, e].item() for r, e in zip([0, 0, 0, 1, 1, 1], [1, 2, 4, 0, 1, 2])])
    assert [e for e, _ in host_guess(scores[:1], None)] == [1, 2, 4, 0, 3]
    assert [e for e, _ in host_guess(scores[:1], 9)] == [1, 2, 4, 0, 3]


def test_the_native_guess_loops_give_the_interpreters_guesses_bit_for_bit(monkeypatch):
    """Which loops run the host side of a guess is a matter of speed only: on rows of any width,
    dtype and layout (ties, logits below the sigmoid's floor, a column slice of wider scores) the
    native extension's experts and probabilities equal the interpreter's exactly, so the same
    copies and evictions follow."""
    from offtensor.moe import guesses

    if guesses._NATIVE_GUESS is None:
        pytest.skip("the native extension is not built with the guess loops")
    g = torch.Generator().manual_seed(0)
    cases = []
    for width in (2, 7, 16, 32, 64, 256):
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            for rows in (1, 3):
                s = (torch.randn(rows, width + 4, generator=g) * 4).to(dtype)
                cases.append(s[:, 2 : 2 + width])  # (a slice, as a guess's columns of the look-ahead's)
                tied = s.round()[:, :width].contiguous()
                tied[:, : width // 2] = -80.0
                cases.append(tied)
    loops = guesses._NATIVE_GUESS, guesses._NATIVE_CHANCES
    for scores in cases:
        for top_k in (0, 1, 4, 8, 300, None):
            monkeypatch.setattr(guesses, "_NATIVE_GUESS", loops[0])
            monkeypatch.setattr(guesses, "_NATIVE_CHANCES", loops[1])
            native = guesses.host_guess(scores, top_k), guesses.host_chances(scores)
            monkeypatch.setattr(guesses, "_NATIVE_GUESS", None)
            monkeypatch.setattr(guesses, "_NATIVE_CHANCES", None)
            assert (guesses.host_guess(scores, top_k), guesses.host_chances(scores)) == native, (scores.dtype, top_k)
