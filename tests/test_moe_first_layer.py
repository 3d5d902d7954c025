"""The first MoE layer guessed from a step's input tokens (offtensor.moe.first_layer): the token
table counts each token's first-layer experts, survives a save and load with the learned
look-ahead, is kept by the offline fit only where it beats the next-token map, and once installed
copies the first layer's experts when the step's embedding runs, before that layer routes, with
logits unchanged; a prefill, an embeddings input and ids that would wait for the device are not
guessed."""

from __future__ import annotations

import pytest
import torch

import offtensor as ot
from offtensor.model.state import pager_of
from offtensor.moe import guesses as ot_guesses
from offtensor.moe import speculation as ot_speculation
from offtensor.moe.first_layer import TokenTable, host_tokens
from offtensor.moe.predictor import LookaheadPredictor, install
from offtensor.moe.refit import fit_offline

transformers = pytest.importorskip("transformers")
from test_moe_predictor import _qwen3, _wrap_quarter  # noqa: E402  (a tiny Qwen3-MoE, a quarter of its experts cached)
from test_moe_next_turn import _decode  # noqa: E402  (a prefill and decode steps that read each token)


def test_a_token_table_counts_each_tokens_first_layer_experts():
    ids = torch.tensor([0, 0, 1, 1, 1, 2])
    routed = torch.tensor([[3, 1], [3, 2], [0, 1], [0, 1], [0, 2], [2, 3]])
    table = TokenTable.fit(ids, routed, num_experts=4, vocab=5)
    assert table.experts.shape == (5, 4) and table.vocab == 5
    assert dict(table.guess([0])) == {3: 1.0, 1: 0.5, 2: 0.5}
    guess = dict(table.guess([1]))
    assert guess[0] == 1.0 and guess[1] == pytest.approx(2 / 3) and guess[2] == pytest.approx(1 / 3) and 3 not in guess
    assert table.guess([4]) == [] and table.guess([7]) == []  # never seen, out of range: no guess
    assert len(table.guess([0, 2])) == 3 + 2  # each token's experts
    # Each token's top 2 against what it routed: token 0 names 3 and 1 (then 2 by order), etc.
    assert table.precision(torch.tensor([2, 4]), torch.tensor([[2, 3], [0, 1]])) == 0.5


def test_a_token_table_refuses_ids_outside_its_vocabulary():
    with pytest.raises(ValueError, match="outside a vocabulary of 3"):
        TokenTable.fit(torch.tensor([0, 5]), torch.tensor([[0], [1]]), num_experts=2, vocab=3)


def test_a_saved_token_table_loads_back_with_the_lookahead(tmp_path):
    table = TokenTable.fit(torch.tensor([0, 1, 1]), torch.tensor([[1, 2], [0, 2], [0, 3]]), num_experts=4)
    predictor = LookaheadPredictor(weights={0: torch.zeros(4, 8)}, biases={0: torch.zeros(4)}, token_table=table)
    predictor.scores[0] = {"table": 0.9}
    predictor.save(str(tmp_path))
    loaded = LookaheadPredictor.load(str(tmp_path))
    assert torch.equal(loaded.token_table.experts, table.experts)
    assert torch.equal(loaded.token_table.chances, table.chances) and loaded.scores[0]["table"] == 0.9
    assert LookaheadPredictor.load(str(tmp_path)).token_table.guess([1]) == table.guess([1])
    predictor.token_table = None
    predictor.save(str(tmp_path))
    assert LookaheadPredictor.load(str(tmp_path)).token_table is None


def test_host_tokens_reads_only_what_waits_for_nothing():
    assert host_tokens(torch.tensor([[3], [4]])) == [3, 4]
    assert host_tokens(torch.zeros(2, 3)) is None  # embeddings, not ids
    assert host_tokens(torch.zeros(2, dtype=torch.long, device="meta")) is None


def _planted_table(experts=(5, 6, 7, 8)) -> TokenTable:
    """Every token of the 128: the first layer's experts ``experts``, each with chance 1."""
    ids = torch.arange(128)
    return TokenTable.fit(ids, torch.tensor(experts).expand(128, -1), num_experts=16, vocab=128)


def _first_layer_table(model, ids: torch.Tensor) -> TokenTable:
    """The table of ``model``'s own first-layer routing on ``ids`` (right about those tokens)."""
    routed = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, a, o: routed.append(o[2].reshape(-1, 4).cpu()))
    with torch.no_grad():
        model(input_ids=ids[None].to(model.get_input_embeddings().weight.device))
    hook.remove()
    return TokenTable.fit(ids, routed[0], num_experts=16, vocab=128)


@pytest.fixture
def guesses_pay(monkeypatch):
    # Every guess pays (no precision gate, no evidence needed), so a guess is copied where room allows.
    monkeypatch.setattr(ot_guesses, "SPECULATE_PRECISION", 0.0)
    monkeypatch.setattr(ot_guesses, "SPECULATE_EVIDENCE", 0.0)
    monkeypatch.setattr(ot_guesses, "SPECULATE_EVIDENCE_LEARNED", 0.0)
    monkeypatch.setattr(ot_speculation, "SPECULATE_EXPERTS", 4)


def test_the_steps_tokens_copy_the_first_layers_experts_before_it_routes(monkeypatch, guesses_pay, device):
    reference = _qwen3().to(device)
    model = _wrap_quarter(_qwen3(), device)
    ids = torch.randint(0, 128, (10,), generator=torch.Generator().manual_seed(1))
    install(pager_of(model), LookaheadPredictor(token_table=_first_layer_table(reference, ids)))
    speculator = pager_of(model).experts.speculator
    first = speculator.routers[0]
    assert speculator.token_table is not None and first.evidence == ot_guesses.SPECULATE_EVIDENCE_LEARNED
    copied_at_embedding, cached_when_routed, guesses = [], [], []
    real_issue, real_ran = ot_speculation.RoutingSpeculator._issue, ot_speculation.RoutingSpeculator.router_ran

    def issue(self, pager, router, confidence, tokens, ahead=1, idle=True):
        before = ot_speculation._cached_experts(pager, router)
        out = real_issue(self, pager, router, confidence, tokens, ahead, idle)
        if router is first:
            guesses.append(set(confidence))
            copied_at_embedding.append(ot_speculation._cached_experts(pager, router) - before)
        return out

    def router_ran(self, router, x):
        if router is first:  # what the first layer finds cached as its router runs
            cached_when_routed.append(ot_speculation._cached_experts(pager_of(model), first))
        return real_ran(self, router, x)

    monkeypatch.setattr(ot_speculation.RoutingSpeculator, "_issue", issue)
    monkeypatch.setattr(ot_speculation.RoutingSpeculator, "router_ran", router_ran)
    got, want = _decode(model, 6, ids=ids), _decode(reference, 6, ids=ids)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # The prefill is not guessed (no pass recorded yet); every decode step is, from its token:
    # the token's first-layer experts in the table.
    tokens = ids[4:9].tolist()
    assert guesses == [{e for e, _ in speculator.token_table.guess([t])} for t in tokens]
    # Copied as the embedding ran, and cached when the first layer's router ran.
    assert any(copied_at_embedding), copied_at_embedding
    assert all(c <= cached for c, cached in zip(copied_at_embedding, cached_when_routed[1:]))
    assert ot.stats(model).guesses["routers"]["model.layers.0.mlp.gate"]["copied_correct"] > 0


def test_a_prefill_and_an_embeddings_input_are_not_guessed(monkeypatch, guesses_pay):
    model = _wrap_quarter(_qwen3())
    install(pager_of(model), LookaheadPredictor(token_table=_planted_table()))
    calls = []
    monkeypatch.setattr(ot_speculation.RoutingSpeculator, "_issue", lambda self, *a, **k: calls.append(a[1]))
    first = pager_of(model).experts.speculator.routers[0]
    with torch.no_grad():
        model(input_ids=torch.arange(8)[None])  # a pass: the router order is known from here on
        model(input_ids=torch.arange(8)[None])  # a prefill of 8 tokens: more than a decode guesses for
        assert first not in calls
        embeds = model.get_input_embeddings().weight[torch.tensor([[3]])]  # (not through the module)
        model(inputs_embeds=embeds)  # no ids: nothing to guess from
        assert first not in calls
        model(input_ids=torch.tensor([[3]]))
    assert first in calls


def test_the_offline_fit_keeps_the_token_table_only_where_it_beats_the_next_token_map():
    model = _qwen3(layers=3)
    ids = torch.randint(0, 128, (64 * 16,), generator=torch.Generator().manual_seed(2))
    held = torch.randint(0, 128, (16 * 16,), generator=torch.Generator().manual_seed(3))
    predictor = fit_offline(model, ids, held, seq=16)
    last = 2
    rival = predictor.scores.get(last, {}).get("learned" if last in predictor.weights else "router", 0.0)
    table = predictor.scores[0]["table"]
    assert 0.0 < table <= 1.0
    assert (predictor.token_table is not None) == (table > rival)
    # A randomly initialised model routes its first layer mostly by token: the table wins here.
    assert predictor.token_table is not None and predictor.token_table.vocab == 128


def test_an_online_refit_counts_a_token_table_from_the_decode_and_keeps_the_better_one():
    from offtensor.moe.refit import OnlineRefit

    model = _wrap_quarter(_qwen3())
    pager = pager_of(model)
    refit = OnlineRefit(pager, every=40, window=48, minimum=40)
    ids = torch.randint(0, 6, (48,), generator=torch.Generator().manual_seed(4))  # six tokens, each seen often
    _decode(model, 42, ids=ids)
    assert refit.refits == 1 and list(refit.tokens) == ids[4:44].tolist()  # every decode step's token
    fitted, speculator = refit.predictor, pager.experts.speculator
    last = len([r for r in speculator.routers if r.stacks]) - 1
    rival = fitted.scores.get(last, {}).get("learned" if last in fitted.weights else "router", 0.0)
    assert (fitted.token_table is not None) == (fitted.scores[0]["table"] > rival)
    # A randomly initialised model routes its first layer by token: the counted table names it.
    assert fitted.token_table is not None and speculator.token_table is fitted.token_table
    assert fitted.scores[0]["table"] > 0.7  # most of them (chance: k / E = 0.25)


def test_an_online_refit_keeps_an_installed_token_table_the_decode_does_not_beat():
    from offtensor.moe.refit import OnlineRefit

    reference = _qwen3()
    model = _wrap_quarter(_qwen3())
    pager = pager_of(model)
    ids = torch.randint(0, 128, (24,), generator=torch.Generator().manual_seed(5))
    table = _first_layer_table(reference, ids)  # right about every token of the decode
    install(pager, LookaheadPredictor(token_table=table))
    refit = OnlineRefit(pager, every=12, window=16, minimum=12)
    _decode(model, 16, ids=ids)
    assert refit.refits == 1
    assert refit.predictor.token_table is table and pager.experts.speculator.token_table is table


def test_a_token_tables_guess_reads_each_token_once_and_anew_after_its_tables_change():
    # (each step's guess looks its tokens' pairs up rather than reading and converting two rows)
    table = TokenTable(torch.tensor([[3, 1, 0], [2, 0, 1]]), torch.tensor([[0.6, 0.3, 0.0], [0.9, 0.1, 0.0]]))
    assert table.guess([0, 1, 7, -1]) == [(3, 0.6000000238418579), (1, 0.30000001192092896), (2, 0.8999999761581421),
                                          (0, 0.10000000149011612)]
    rows = table._rows[5]
    assert table.guess([1]) == [(2, 0.8999999761581421), (0, 0.10000000149011612)] and table._rows[5] is rows
    table.chances[1, 1] = 0.0  # written in place: read anew
    assert table.guess([1]) == [(2, 0.8999999761581421)]
    table.experts = torch.tensor([[5, 4, 0], [6, 0, 1]], dtype=torch.int32)  # replaced: read anew
    assert table.guess([0]) == [(5, 0.6000000238418579), (4, 0.30000001192092896)]
