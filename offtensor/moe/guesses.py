"""One router's record of its guesses: the confidence bins of a guess (the look-ahead probability
of the guessed expert), their decayed precision on experts not cached when guessed, the gate a
guess must pass before its copy is made, and the figures reported for them (``ot.stats(model).
guesses``), and the scoring of its open guesses against what its layer paged (``score``). Also
the host side of a decode step's guess: the softmax and top-k of a few rows of look-ahead scores,
ranked by confidence, and the chances of a next-token map's logits (``host_chances``).
``speculation`` makes the guesses, has them scored into these records and copies the ones whose
record pays.
"""

from __future__ import annotations

import math
import weakref
from bisect import bisect_left
from functools import reduce
from operator import add, itemgetter

from torch import nn

from .. import _ext
from . import routing

# Speculation is scored on what it can save: only a guess of an expert that is NOT cached when the
# guess is made costs a copy, so a router's guesses are scored apart by their confidence (the
# look-ahead probability of the guessed expert, in CONFIDENCE_BINS bins) on uncached experts only.
# An uncached guess is copied only when the guesses of its router and bin have been right at least
# SPECULATE_PRECISION of the time: its copy then saves a miss on the critical path more often than
# it spends the copy stream for nothing. Guesses are scored whether or not they were copied, so a
# bin earns (or loses) speculation by its record before any byte is spent on it.
# The gate is set by the H200 replay of benchmarks/moe_sim.py (experts of Qwen3-30B-A3B's bytes, 25%
# cached, ms per decode step, one guess a layer, the committed look-ahead): at 0.7 the step is 3.1 /
# 9.5 / 1.3% faster than the cache alone (Qwen3 / Qwen2 / Mixtral) with 0.45 / 0.64 / 0.47 of the
# guessed layers' misses covered and 0.13 / 0.13 / 0.23 of the copied bytes wasted; at 0.6 2.9 /
# 9.6 / 1.5% with 0.53 / 0.67 / 0.50 covered and 0.17 / 0.14 / 0.24 wasted (each wrong copy delays
# the next layer's own copies by most of an expert's copy, a right one saves only the gap before
# that layer's routing read). The coverage-against-waste curve of the gates is in
# benchmarks/results/moe_sim.json. Looser gates cover more misses for more bytes (SPECULATE_WASTE
# below).
SPECULATE_PRECISION = 0.7
# The same gate for a guess made two layers ahead (copied only into copy time the next layer is
# expected to leave idle). Kept at SPECULATE_PRECISION: at 0.5 benchmarks/moe_sim.py's trained
# models at 25% cached covered 2-5 points more misses for 4-6 points more bytes wasted and no more
# hits (the speculation_curve in benchmarks/results/moe_sim.json).
SPECULATE_PRECISION_IDLE = 0.7
# Upper edges of the confidence bins (a guess's look-ahead probability; top-k of a softmax over
# E experts: 1 / E is chance).
CONFIDENCE_BINS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_EDGES = CONFIDENCE_BINS[:-1]  # (ranked_bins: a bisection over these needs no cap at the last bin)
_NO_RECORD = ((0.0,) * len(CONFIDENCE_BINS),) * 2  # (a bin's record where no pool is given)
_NO_POOL = _NO_RECORD * 2  # (the same, one and two ahead: the native extension's pool where none is given)
# A bin's precision is correct / guessed over its recent uncached guesses: both counts decay by
# this factor per scored guess, and at least SPECULATE_EVIDENCE guesses must stand behind it.
PRECISION_DECAY = 0.98
SPECULATE_EVIDENCE = 8.0
# A layer guessed by a learned look-ahead (moe.predictor), whose precision was measured on
# held-out routing before it was installed, needs this many: on the trained Mixtral-shaped test
# model (top-2 of 16, 4 layers) few guesses are of uncached experts, and at 8 no bin had earned a
# copy within 160 decode steps. (4 for every router lets an untrained router's lucky guesses be
# copied: tests/test_moe.py's decode bytes.)
SPECULATE_EVIDENCE_LEARNED = 4.0
# The copy gate by expected waste, off by default (None): a one-ahead guess needs a bin at least
# SPECULATE_PRECISION_FLOOR right (a bin short of evidence takes the record of the nearest less
# confident bin that has it: precision rises with confidence), a layer's uncached guesses are
# copied most precise first (up to SPECULATE_EXPERTS), and each copy is made only while the
# expected share of wasted bytes over the recent copies (1 - each copy's bin precision, decayed by
# WASTE_DECAY per copy) stays at most SPECULATE_WASTE, so very precise copies earn room for less
# precise ones (with one copy a layer a budget of 0.3 rarely binds: the floor, the borrowed evidence
# and the order decide). Off because the H200 replay does not pay for it: at 25% cached, with the
# committed look-ahead, one copy a layer at 0.3 covers 0.55 / 0.70 / 0.57 (Qwen3 / Qwen2 / Mixtral)
# of the guessed layers' misses with 0.18 / 0.16 / 0.22 of the bytes wasted (the fixed gate: 0.45 /
# 0.64 / 0.47 with 0.13 / 0.13 / 0.23), and the step is 2.7 / 9.4 / 1.8% faster than the cache alone
# (the fixed gate: 3.1 / 9.5 / 1.3%); up to top-k copies a layer at 0.25, 1.9 / 8.8 / 1.8%: each
# copy ahead takes room that at 25% cached is read again soon, so the bytes copied a step grow by
# about what the copies take off the critical path (benchmarks/moe_sim.py, "waste_budget_30",
# "waste_budget_25_top_k").
SPECULATE_WASTE = None
SPECULATE_PRECISION_FLOOR = 0.5
WASTE_DECAY = 0.98


class Router:
    __slots__ = ("name", "module_ref", "stacks", "top_k", "bin_correct", "bin_guessed", "guessed", "correct",
                 "routed", "uncached_guessed", "uncached_correct", "misses", "copied_experts", "copied_correct",
                 "prefetched_bytes", "wasted_bytes", "tokens", "guess", "cached", "copied", "guess_tokens",
                 "unpaid_steps", "missed", "misses_seen", "lookahead", "evidence", "split", "guess2", "cached2",
                 "bin2_correct", "bin2_guessed", "copied2", "copied2_experts", "copied2_correct", "next_pass", "own")

    def __init__(self, name: str, module: nn.Module):
        self.name = name
        self.module_ref = weakref.ref(module)
        self.stacks: list = []  # Stack objects this router selects experts of
        self.top_k = routing.attribute_top_k(module)
        # Decayed counts of its uncached guesses per confidence bin (their running precision).
        self.bin_correct = [0.0] * len(CONFIDENCE_BINS)
        self.bin_guessed = [0.0] * len(CONFIDENCE_BINS)
        self.clear_record()
        self.tokens = 0  # tokens of its last real routing
        self.guess = None  # open guess: expert -> confidence bin, scored when the step ends
        self.cached = frozenset()  # experts cached (every stack) when the open guess was made
        self.copied = {}  # expert -> bytes the open guess copied for it
        self.guess_tokens = 0
        self.unpaid_steps = 0  # steps it could have been guessed for, on a sample only (speculation._guessed_now)
        self.missed = True  # whether its stacks missed in the last step (a guess could have saved a copy)
        self.misses_seen = 0  # its stacks' misses counted at the end of the last step
        # (weight [E, H], bias [E]) of the learned look-ahead of the next layer from this router's
        # input (moe.predictor.install), on the device, then (w1, b1) where it reads a hidden layer
        # (ReLU of w1 x + b1; weight is then [E, hidden]); None: the next router's weight guesses.
        self.lookahead = None
        # Where the learned look-ahead's weight also holds the map two layers ahead (its rows from
        # ``split`` on: the experts of the layer after the next), the next layer's expert count.
        self.split = None
        # Where it also holds this layer's own experts at the next token (moe.predictor's next-token
        # map: its rows from ``own`` on, logits of a sigmoid), eviction is told their chances.
        self.own = None
        # The open guess of this layer made two layers ahead (expert -> bin), the experts cached
        # then, and its own bins' decayed counts (a guess from further away is right less often).
        self.guess2 = None
        self.cached2 = frozenset()
        self.bin2_correct = [0.0] * len(CONFIDENCE_BINS)
        self.bin2_guessed = [0.0] * len(CONFIDENCE_BINS)
        self.next_pass = False  # whether the open guess is for the next pass (made by the last router)
        self.copied2 = set()  # experts the open two-ahead guess copied
        self.evidence = SPECULATE_EVIDENCE  # guesses a bin needs (SPECULATE_EVIDENCE_LEARNED: guessed by a learned map)

    def clear_record(self) -> None:
        """Its guesses' counts start again (``ot.reset_stats``)."""
        self.guessed = self.correct = self.routed = self.prefetched_bytes = self.wasted_bytes = 0
        # Guesses of experts not cached when guessed, how many were routed, the routed experts not
        # cached at guess time (the misses a guess could cover), guesses copied and routed.
        self.uncached_guessed = self.uncached_correct = self.misses = self.copied_experts = self.copied_correct = 0
        self.copied2_experts = self.copied2_correct = 0  # copies made by two-ahead guesses, those routed

    def pays(self, confidence_bin: int, pool=None, ahead: int = 1) -> bool:
        """Whether an uncached guess in this bin is right often enough to be worth its copy: by its
        own record once it has SPECULATE_EVIDENCE guesses, until then by ``pool`` (every router's
        record of that bin, (correct, guessed) lists), so a router need not wait for evidence of
        its own before its first copy (on the trained test models a bin took 20-40 decode steps)."""
        correct, guessed = self._evidenced(confidence_bin, pool, ahead)
        gate = SPECULATE_PRECISION if ahead == 1 else SPECULATE_PRECISION_IDLE
        if SPECULATE_WASTE is not None and ahead == 1:
            gate = SPECULATE_PRECISION_FLOOR  # the waste budget decides (RoutingSpeculator._issue)
        return guessed >= self.evidence and correct >= gate * guessed

    def _evidenced(self, confidence_bin: int, pool=None, ahead: int = 1):
        """``_record``, or with the waste budget (SPECULATE_WASTE) and too few guesses in the bin,
        the record of the nearest less confident bin with enough."""
        correct, guessed = self._record(confidence_bin, pool, ahead)
        if SPECULATE_WASTE is not None:
            for lower in range(confidence_bin - 1, -1, -1):
                if guessed >= self.evidence:
                    break
                correct, guessed = self._record(lower, pool, ahead)
        return correct, guessed

    def _record(self, confidence_bin: int, pool=None, ahead: int = 1):
        """(correct, guessed) decayed counts of a bin (of the guesses made ``ahead`` layers ahead):
        its own, or the pool's until it has evidence."""
        own = (self.bin_correct, self.bin_guessed) if ahead == 1 else (self.bin2_correct, self.bin2_guessed)
        correct, guessed = own[0][confidence_bin], own[1][confidence_bin]
        if guessed < self.evidence and pool is not None:
            pool = pool if ahead == 1 else pool[2:]
            correct, guessed = pool[0][confidence_bin], pool[1][confidence_bin]
        return correct, guessed

    def precision(self, confidence_bin: int, pool=None, ahead: int = 1) -> float:
        """The measured precision of its uncached guesses in a bin (0 without a record)."""
        correct, guessed = self._evidenced(confidence_bin, pool, ahead)
        return correct / guessed if guessed else 0.0

    def record(self, confidence_bin: int, right: bool, ahead: int, pool) -> None:
        """Score one uncached guess made ``ahead`` layers before this layer: its bin's decayed
        counts, the pool's (``RoutingSpeculator.pool``) and, one ahead, the totals."""
        if ahead == 1:
            self.uncached_guessed += 1
            self.uncached_correct += right
            correct, guessed, pool_correct, pool_guessed = self.bin_correct, self.bin_guessed, pool[0], pool[1]
        else:
            correct, guessed, pool_correct, pool_guessed = self.bin2_correct, self.bin2_guessed, pool[2], pool[3]
        b = confidence_bin  # (its own counts, then the pool's: each the same decayed sum)
        correct[b] = PRECISION_DECAY * correct[b] + right
        guessed[b] = PRECISION_DECAY * guessed[b] + 1.0
        pool_correct[b] = PRECISION_DECAY * pool_correct[b] + right
        pool_guessed[b] = PRECISION_DECAY * pool_guessed[b] + 1.0

    def pays_any(self, pool=None, ahead: int = 1) -> bool:
        """Whether any of its bins (of the guesses made ``ahead`` layers ahead) pays (asked of every
        router at every decode step)."""
        return self.paying(pool, ahead) != 0

    def paying(self, pool=None, ahead: int = 1) -> int:
        """The bins (of the guesses made ``ahead`` layers ahead) that pay, as a bit mask (bin b: bit
        b): ``pays`` of each, in one pass where the gate is fixed (in the native extension's loop
        where it is built), asked once for a guess's every expert rather than a call per expert."""
        if SPECULATE_WASTE is not None:
            return sum(1 << b for b in range(len(CONFIDENCE_BINS)) if self.pays(b, pool, ahead))
        gate = SPECULATE_PRECISION if ahead == 1 else SPECULATE_PRECISION_IDLE
        if _NATIVE_PAYING is not None:
            return _NATIVE_PAYING(self, _NO_POOL if pool is None else pool, ahead, gate)
        own = (self.bin_correct, self.bin_guessed) if ahead == 1 else (self.bin2_correct, self.bin2_guessed)
        shared, evidence = _NO_RECORD if pool is None else (pool[:2] if ahead == 1 else pool[2:]), self.evidence
        mask = 0
        for b, (correct, guessed, pool_correct, pool_guessed) in enumerate(zip(*own, *shared)):
            if guessed < evidence:
                correct, guessed = pool_correct, pool_guessed  # (_record: the pool's until it has evidence)
            if guessed >= evidence and correct >= gate * guessed:
                mask |= 1 << b
        return mask

    def worth(self, bins: dict, cached, pool, ahead: int = 1) -> list:
        """The experts of a guess made ``ahead`` layers ahead (``bins``: expert -> its confidence bin,
        the most confident first) worth a copy, in the order they are copied (``copy_order``): not
        ``cached``, not copied by its open guesses yet, and in a bin that ``pays`` (one native call
        where the gate is fixed)."""
        if SPECULATE_WASTE is None and _NATIVE_WORTH is not None:
            return _NATIVE_WORTH(self, _NO_POOL if pool is None else pool, ahead,
                                 SPECULATE_PRECISION if ahead == 1 else SPECULATE_PRECISION_IDLE, bins, cached)
        paying, copied = self.paying(pool, ahead), self.copied
        return copy_order(self, [e for e, b in bins.items() if paying >> b & 1 and e not in cached and e not in copied],
                          bins, pool, ahead)

    def report(self, pool=None) -> dict:
        return guess_report(self.guessed, self.correct, self.routed, self.uncached_guessed, self.uncached_correct,
                             self.misses, self.copied_experts, self.copied_correct, self.prefetched_bytes,
                             self.wasted_bytes) | {"copied_two_ahead": self.copied2_experts,
                                                   "copied_two_ahead_correct": self.copied2_correct}



def score(router: Router, pool, used=None) -> list:
    """Close ``router``'s open guesses against the experts its stacks actually paged (``pool``:
    every router's bins, ``RoutingSpeculator.pool``; ``used``: those experts where the caller has
    them). Returns the experts its guesses copied that its layer did not page (wrong copies)."""
    guess, guess2 = router.guess, router.guess2
    if guess is None and guess2 is None:
        return []
    if used is None:
        used = set()
        for stack in router.stacks:
            used |= stack.used
    if _NATIVE_SCORE is not None:
        # (the steps below in one call: every router every decode step; a Ctrl-C lands before or
        # after the whole scoring)
        return _NATIVE_SCORE(router, pool, used, PRECISION_DECAY)
    router.guess = router.guess2 = None
    if not used:
        return []  # its layer has not run yet (a forward cut short): nothing to score against
    # The misses a guess could cover: routed experts not cached when the first guess was made
    # (a two-ahead copy makes its expert cached by the time of the one-ahead guess).
    router.misses += len(used - (router.cached2 if guess2 is not None else router.cached))
    router.routed += len(used)
    for ahead, open_guess in ((1, guess), (2, guess2)):
        if open_guess is None:
            continue
        cached = router.cached if ahead == 1 else router.cached2
        if ahead == 1:
            router.guessed += len(open_guess)
            router.correct += len(open_guess.keys() & used)
        for e, b in open_guess.items():
            if e not in cached:  # a guess of a cached expert costs nothing and saves nothing
                router.record(b, e in used, ahead, pool)
        if ahead == 2:
            router.copied2_experts += len(router.copied2)
            router.copied2_correct += len(router.copied2 & used)
    router.copied_experts += len(router.copied)
    router.copied_correct += len(router.copied.keys() & used)
    wrong = [e for e in router.copied if e not in used]
    router.wasted_bytes += sum(router.copied[e] for e in wrong)
    router.copied = {}
    if router.guess_tokens == 1 and len(used) and router.top_k is None:
        router.top_k = len(used)
    return wrong


def close_step(router: Router, pool) -> list:
    """A pass ended, for ``router``: the experts its stacks paged (one token picks exactly top_k of
    them), its open guesses scored (``score``) unless made for the pass to come, and whether its
    stacks missed since the last pass's end. Returns the experts its guesses copied that its layer
    did not page (wrong copies). In one native call where built (every router every decode step)."""
    if _NATIVE_CLOSE is not None:
        return _NATIVE_CLOSE(router, pool, PRECISION_DECAY)
    used = set()  # (its layer's experts paged this pass: read once, for top_k and the score)
    for stack in router.stacks:
        used |= stack.used
    if router.tokens == 1 and used:
        router.top_k = len(used)  # one token picks exactly top_k experts
    wrong = []
    if router.next_pass:
        router.next_pass = False  # made for the pass to come: scored once that has run
    else:
        wrong = score(router, pool, used)
    misses = sum(s.misses for s in router.stacks)
    router.missed = misses != router.misses_seen  # (a reset of the counters reads as a miss)
    router.misses_seen = misses
    return wrong


def open_guess(router: Router, bins: dict, cached, tokens: int, ahead: int, pool, copy: bool):
    """Open ``router``'s guess made ``ahead`` layers before it (``bins``: expert -> its confidence
    bin, the most confident first; ``cached``: the experts cached as it is made), to be scored at
    the step's end, and return its experts worth a copy (``Router.worth``; none unless ``copy``).
    None, with nothing changed, where a guess left open by a pass that did not end must be scored
    first (``score``). In one native call where the gate is fixed (every guess of every decode step:
    the records' stores and the worth in one step rather than a dozen)."""
    if SPECULATE_WASTE is None and _NATIVE_OPEN is not None:
        gate = (SPECULATE_PRECISION if ahead == 1 else SPECULATE_PRECISION_IDLE) if copy else None
        return _NATIVE_OPEN(router, bins, cached, tokens, ahead, _NO_POOL if pool is None else pool, gate)
    if ahead == 1:
        if router.guess is not None:
            return None
        router.guess, router.cached, router.guess_tokens = bins, cached, tokens
        if router.guess2 is None:
            router.copied = {}
    else:
        if router.guess is not None or router.guess2 is not None:
            return None
        router.guess2, router.cached2, router.copied, router.copied2 = bins, cached, {}, set()
    return router.worth(bins, cached, pool, ahead) if copy else []


def copy_order(router: Router, experts: list, bins: dict, pool, ahead: int) -> list:
    """The uncached guesses worth a copy in the order they are copied: by confidence (as ranked),
    or with the waste budget (SPECULATE_WASTE) by their bins' measured precision."""
    if SPECULATE_WASTE is None:
        return experts
    return sorted(experts, key=lambda e: -router.precision(bins[e], pool, ahead))


class WasteBudget:
    """The expected wasted copies of the recent copies ahead and the copies made, both decayed by
    WASTE_DECAY per copy, held to SPECULATE_WASTE."""

    def __init__(self):
        self.wasted = self.made = 0.0

    def spend(self, chance: float) -> bool:
        """Whether one more copy, right with ``chance``, keeps the expected wasted share within the
        budget (always, without one); if so it is counted."""
        if SPECULATE_WASTE is None:
            return True
        if self.wasted + 1.0 - chance > SPECULATE_WASTE * (self.made + 1.0):
            return False
        self.wasted = WASTE_DECAY * self.wasted + 1.0 - chance
        self.made = WASTE_DECAY * self.made + 1.0
        return True


def ratio(a, b):
    return a / b if b else None


def guess_report(guessed, correct, routed, uncached_guessed, uncached_correct, misses, copied, copied_correct,
                  prefetched_bytes, wasted_bytes) -> dict:
    """``accuracy``/``recall``: all guesses against the routed experts. What speculation can save:
    ``uncached_precision`` (guesses of experts not cached when guessed that were routed),
    ``miss_coverage`` (share of the misses, routed experts not cached at guess time, that those
    guesses named: what copying every guess would cover), ``covered_misses`` (share of the misses
    a copied guess covered), ``wasted_share`` (copied bytes no op read)."""
    return {
        "guessed": guessed, "correct": correct, "routed": routed,
        "accuracy": ratio(correct, guessed), "recall": ratio(correct, routed),
        "uncached_guessed": uncached_guessed, "uncached_correct": uncached_correct,
        "uncached_precision": ratio(uncached_correct, uncached_guessed),
        "misses": misses, "miss_coverage": ratio(uncached_correct, misses),
        "copied_experts": copied, "copied_correct": copied_correct, "covered_misses": ratio(copied_correct, misses),
        "prefetched_bytes": prefetched_bytes, "wasted_bytes": wasted_bytes,
        "wasted_share": ratio(wasted_bytes, prefetched_bytes),
    }


def routers_report(routers: list, pool, copying: bool) -> dict:
    """Every router's guesses together, and each one's (``ot.stats(model).guesses``)."""
    total = guess_report(*(sum(getattr(r, f) for r in routers) for f in (
        "guessed", "correct", "routed", "uncached_guessed", "uncached_correct", "misses", "copied_experts",
        "copied_correct", "prefetched_bytes", "wasted_bytes")))
    return total | {"routers": {r.name: r.report(pool) | {"speculating": copying and r.pays_any(pool)}
                                for r in routers if r.stacks}}


# The native extension's loops for the host side of a guess (csrc/guesses.cpp: on the scores'
# tensor itself, or its rows as Python lists) and the guesses' records (csrc/guess_records.cpp),
# where it is built with them; without it, the interpreter's steps here. A row of 32 experts: some
# 3 us against 8; of 256: 9 against 44. Every MoE layer of every decode step runs them, each in one
# call rather than dozens of interpreter steps.
_NATIVE_GUESS, _NATIVE_CHANCES = _ext.native_function("guess_rows"), _ext.native_function("chance_rows")
_NATIVE_BINS, _NATIVE_RANKED = _ext.native_function("guess_bins"), _ext.native_function("rank_bins")
_NATIVE_PAYING, _NATIVE_WORTH = _ext.native_function("paying_bins"), _ext.native_function("worth_copies")
_NATIVE_SCORE, _NATIVE_CLOSE = _ext.native_function("score_guess"), _ext.native_function("close_step")
_NATIVE_OPEN = _ext.native_function("open_guess")


def host_rows(scores) -> list:
    """A few rows of scores as lists of Python floats (``scores``: a tensor, or already its rows)."""
    if isinstance(scores, list):
        return scores
    # (a decode step's scores are [tokens, E] already: a reshape is a dispatched op of its own)
    return (scores if scores.dim() == 2 else scores.reshape(-1, scores.shape[-1])).tolist()


def host_guess(scores, top_k) -> list:
    """(expert, softmax probability) of each row's ``top_k`` highest scores (all, with None), computed
    on the host from a few rows of router scores (a tensor, or its ``host_rows``; no kernel: see
    speculation.RoutingSpeculator.router_ran): in the native extension's loop where it is built (the
    same arithmetic in the same order: the same pairs), else the interpreter's."""
    rows = host_rows(scores)
    if _NATIVE_GUESS is not None:
        return _NATIVE_GUESS(rows, top_k)
    out = []
    exp = math.exp
    for row in rows:
        top = max(row)
        # (added one after another, as the native loop adds them: Python 3.12's sum compensates)
        scale = 1.0 / reduce(add, [exp(v - top) for v in row], 0.0)
        # (heapq.nlargest's documented equivalent, ties included, and faster for a few dozen)
        for e in sorted(range(len(row)), key=row.__getitem__, reverse=True)[:top_k]:
            out.append((e, exp(row[e] - top) * scale))
    return out


def host_scores(scores):
    """A guess's scores (a tensor of a few rows) as the host side reads them, once for all of its
    reads: the tensor itself where the native extension reads its memory (``guess_bins``,
    ``host_chances``: no Python float made per score), else ``host_rows``."""
    return scores if _NATIVE_BINS is not None else host_rows(scores)


def host_chances(scores, lo: int = 0) -> list:
    """Per expert, its chance of use at a layer's next turn from the next-token map's logits of a
    few rows (one a token of the turn; its columns from ``lo`` on): 1 - prod(1 - sigmoid), on the
    host like ``host_guess``."""
    if _NATIVE_CHANCES is not None:
        chances = _NATIVE_CHANCES(scores, lo)  # (None: a tensor it does not read, read as rows below)
        return chances if chances is not None else _NATIVE_CHANCES(host_rows(scores), lo)
    rows = host_rows(scores)
    if lo:
        rows = [r[lo:] for r in rows]
    out = [1.0] * len(rows[0])
    for row in rows:
        for e, v in enumerate(row):
            out[e] *= 1.0 - (1.0 / (1.0 + math.exp(-v)) if v > -60.0 else 0.0)
    return [1.0 - v for v in out]


def ranked_bins(pairs) -> dict:
    """(expert, confidence) pairs -> expert: the bin of its highest confidence, the most confident
    first (ties in the order given: a reversed sort keeps equal keys in order). A confidence's bin
    is the first whose upper edge is at least it (the last above them all; a NaN, which compares
    with nothing, the first): ``bisect_left`` over every upper edge but the last, which is the
    bisection over all of them capped at the last bin."""
    if _NATIVE_RANKED is not None and type(pairs) is list:
        bins = _NATIVE_RANKED(pairs, _EDGES)  # (None: pairs it leaves to the steps below)
        if bins is not None:
            return bins
    edges, bins = _EDGES, {}
    for e, p in sorted(pairs, key=itemgetter(1), reverse=True):
        if e not in bins:  # (an expert's highest confidence: the first of its pairs in this order)
            bins[e] = bisect_left(edges, p)
    return bins


def guess_bins(scores, lo, hi, top_k) -> dict:
    """``ranked_bins(host_guess([r[lo:hi] for r in host_rows(scores)], top_k))``: a guess's experts,
    the most confident first, and their confidence bins, from the columns [lo, hi) of a few rows of
    look-ahead scores (``host_scores``; None: from the first, to the last). In one native pass where
    it is built (the same pairs, sorted stably as ``ranked_bins`` sorts them: the same bins in the
    same order), which leaves a row with a NaN probability, or a tensor it does not read, to the
    steps here."""
    if _NATIVE_BINS is not None:
        bins = _NATIVE_BINS(scores, lo, hi, top_k, _EDGES)
        if bins is not None:
            return bins
    return ranked_bins(host_guess([r[lo:hi] for r in host_rows(scores)], top_k))
