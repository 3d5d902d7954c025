"""Hit rate against expert-cache slots, from measured routing: the curve a plan shows for a MoE
model, and the budget where it bends.

``RoutingStats`` keeps, per MoE layer, the share of routed slots each expert took and the share of
a token's experts the previous token also used. A decode is drawn from them (each of a token's k
experts is one of the previous token's with the measured locality, else drawn by popularity) and
run through a per-layer cache of ``s`` slots, least recently used evicted and, for the bound,
Belady's (furthest next use evicted), for s from k to E. The knee is the slot count furthest above
the straight line from no slots to every expert cached: past it, each slot buys less than the
average slot does.
"""

from __future__ import annotations

import random
from typing import Optional

# At most about this many rows of the curve are printed (the knee and the last always).
ROWS = 16


def _draw(popularity: list, locality: float, top_k: int, tokens: int, rng: random.Random) -> list:
    """``tokens`` routings of one layer: lists of ``top_k`` distinct experts."""
    experts = list(range(len(popularity)))
    out, prev = [], []
    for _ in range(tokens):
        chosen = []
        for _ in range(top_k):
            reuse = [e for e in prev if e not in chosen]
            if reuse and rng.random() < locality:
                chosen.append(rng.choice(reuse))
                continue
            while True:
                e = rng.choices(experts, weights=popularity)[0]
                if e not in chosen:
                    break
            chosen.append(e)
        out.append(sorted(chosen))
        prev = chosen
    return out


def _lru(stream: list, slots: int) -> float:
    cache, hits, looks = {}, 0, 0
    for t, experts in enumerate(stream):
        for e in experts:
            looks += 1
            if e in cache:
                hits += 1
            elif len(cache) >= slots:
                del cache[min(cache, key=cache.get)]
            cache[e] = t
    return hits / looks


def _belady(stream: list, slots: int) -> float:
    flat = [e for experts in stream for e in experts]
    nxt, seen = [0] * len(flat), {}
    for i in range(len(flat) - 1, -1, -1):
        nxt[i] = seen.get(flat[i], len(flat))
        seen[flat[i]] = i
    cache, hits = {}, 0
    for i, e in enumerate(flat):
        if e in cache:
            hits += 1
        elif len(cache) >= slots:
            del cache[max(cache, key=cache.get)]
        cache[e] = nxt[i]
    return hits / len(flat)


def hit_curve(routing, tokens: int = 1024, seed: int = 0, slots: Optional[list] = None) -> dict:
    """Decode hit rate against cache slots a layer, averaged over ``routing``'s layers: ``{"slots":
    [...], "lru": [...], "belady": [...], "knee_slots": s, "experts": E, "top_k": k}``."""
    rng = random.Random(seed)
    experts, top_k = len(routing.popularity[0]), routing.top_k
    slots = slots or list(range(top_k, experts + 1))
    streams = [_draw(p, loc, top_k, tokens, rng) for p, loc in zip(routing.popularity, routing.locality)]
    lru = [sum(_lru(s, n) for s in streams) / len(streams) for n in slots]
    belady = [sum(_belady(s, n) for s in streams) / len(streams) for n in slots]
    # The knee: the largest gap above the chord from (0 slots, 0) to (E slots, 1), on the LRU curve.
    knee = max(zip(slots, lru), key=lambda p: p[1] - p[0] / experts)[0]
    return {"slots": slots, "lru": lru, "belady": belady, "knee_slots": knee, "experts": experts, "top_k": top_k}


def format_curve(curve: dict, expert_bytes: int = 0, layers: int = 0, dense_bytes: int = 0) -> list:
    """Table lines: slots a layer, share of the experts, LRU and Belady hit, and with the model's
    sizes the budget those slots take (dense weights + slots x layers x one expert)."""
    from ..pager import format_bytes

    header = "| slots/layer | cached | hit (LRU) | hit (Belady) |" + (" budget |" if expert_bytes else "")
    lines = [header, "|---|---|---|---|" + ("---|" if expert_bytes else "")]
    rows = list(zip(curve["slots"], curve["lru"], curve["belady"]))
    step = max(1, len(rows) // ROWS)
    for i, (n, a, b) in enumerate(rows):
        if i % step and n != curve["knee_slots"] and i != len(rows) - 1:
            continue
        row = f"| {n}{' (knee)' if n == curve['knee_slots'] else ''} | {n / curve['experts']:.0%} | {a:.1%} | {b:.1%} |"
        if expert_bytes:
            row += f" {format_bytes(int(dense_bytes + n * layers * expert_bytes))} |"
        lines.append(row)
    return lines
