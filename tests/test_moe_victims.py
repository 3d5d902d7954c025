"""The expert cache's victim search keeps each stack's candidates from one search to the next
(``eviction.KeptBest``) only while they are what a search from scratch would find: a decode
evicts exactly the same experts, in the same order, with them as without them."""

from __future__ import annotations

import pytest

from offtensor.moe import eviction

pytest.importorskip("transformers")
from test_moe_predictor import _decode, _qwen3, _wrap_quarter  # noqa: E402  (a tiny Qwen3-MoE, a quarter of its experts cached)


def _victims(monkeypatch, kept: bool) -> list:
    chosen = []
    search = eviction.ExpertEviction.victim

    def victim(self, view, room, candidates):
        if not kept:
            self._kept.renew()  # every layer ranked anew: a search from scratch
        entry = search(self, view, room, candidates)
        chosen.append(None if entry is None else entry.key)
        return entry

    with monkeypatch.context() as m:
        m.setattr(eviction.ExpertEviction, "victim", victim)
        model = _wrap_quarter(_qwen3())
        logits = _decode(model, 12)
    return chosen, logits


def test_kept_candidates_evict_what_a_search_from_scratch_evicts(monkeypatch):
    fresh, fresh_logits = _victims(monkeypatch, kept=False)
    kept, kept_logits = _victims(monkeypatch, kept=True)
    assert len(fresh) > 20  # the budget makes the decode evict
    assert _relative(kept) == _relative(fresh)
    assert all(a.equal(b) for a, b in zip(kept_logits, fresh_logits))


def _relative(keys: list) -> list:
    """Victim keys with master ids numbered by first appearance (each run wraps its own model)."""
    ids = {}
    out = []
    for k in keys:
        if k is None:
            out.append(None)
            continue
        out.append((ids.setdefault(k[0], len(ids)),) + tuple(k[1:]))
    return out
