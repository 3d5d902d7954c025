"""Routing speculation: forward hooks' view of the routers, the guess of the next MoE layer's
experts, and its copies ahead.

The top-k of a router's output tells the expert cache which experts its layer will page
(``ExpertStacks.expect``, for models that select experts one by one); it is read by
``routing.routed_experts``, the one reader of router outputs, so the router's own rule (DeepSeek-V3's
correction bias) decides it. Before layer i's router runs, layer i+1's router weight is applied to
its input (the residual stream changes little from one layer to the next, which MoE-Infinity and
Pre-gated MoE exploit), or where a learned look-ahead is installed (``moe.predictor``: a map fitted
on recorded routing) its weight and bias: a guess of layer i+1's experts, always scored against what layer i+1 pages.
Guesses of experts not cached when guessed (the only ones a copy can save) are scored apart per
router and confidence bin. Such a guess is copied (the most confident one per layer, behind layer
i's own copies, and only into the room of a copy expected to be read much later) when its bin's
recent guesses were at least 70% right (the router's own record, or every router's until it has
one; ``guesses.SPECULATE_WASTE``, off, is a waste budget instead); the guessed experts of layer i+1 are kept from eviction until it pages. Where the learned
look-ahead also maps layer i's input to layer i+2's experts (the same matmul), that guess is
scored in bins of its own and copied only when layer i+1's guess names nothing to copy: its copy
then fills copy time layer i+1 is expected to leave idle, and never queues ahead of one of layer
i+1's misses. Where the learned look-ahead has a token table (``moe.first_layer``), the first MoE
layer is guessed from a decode step's tokens as its embedding runs (``guess_first``); without one,
with SPECULATE_NEXT_STEP, the last layer guesses the next step's first. Where the
learned look-ahead also maps layer i's input to layer i's own experts at the next token (more rows
of the same matmul), their chances go to eviction (``ExpertEviction.next_turn``) before layer i's
copies take their room. A decode step's guess costs one kernel, the router matmul (softmax and
top-k on the host). With ``SPECULATE_COPY``
off nothing is copied and a router is guessed for on a sample of the steps, as one is whose
own record says its look-ahead does not pay (``SPECULATE_SAMPLE_UNPAID``). Each router's record of
its guesses (confidence bins, their precision, the gate a copy must pass) is ``moe.guesses``. Which modules are
routers and which stacks each one selects is learned from the access order of a pass (the stacks
paged after a router fires, before the next one); before the first pass, from names
(``<prefix>.gate`` selects ``<prefix>.experts.*``).

On a GPU nothing here adds a host sync: router outputs and guesses come back through pinned
buffers and events, and are used once the event has completed.
"""

from __future__ import annotations

import weakref
from math import prod

import torch
import torch.nn.functional as F

from .. import _ext
from . import routing
from .predictor import hidden_layer
from .guesses import (CONFIDENCE_BINS, Router, WasteBudget, close_step, guess_bins, host_chances, host_scores, open_guess,
                      ranked_bins, routers_report, score)

# At most this many guessed experts per layer are copied ahead, the most confident first. The copy
# stream is idle only between a layer's last expert copy and the next layer's routing read (its
# attention and router: ~0.3 ms on the DeepSeek-style stack under the H200 profile, less than one
# 25 MB expert's 0.45 ms copy), so one guess fills that gap; more are copied at the price of every
# wrong one (the replay in benchmarks/moe_bench.py: all 8 at 80% accuracy is slower than none;
# benchmarks/moe_sim.py's H200 replay of the trained models: two a layer is slower than one).
SPECULATE_EXPERTS = 1
# Whether a guess that pays is copied at all. On: the trained test models' decode step is
# copy-bound at 25% cached (copy stream ~70% busy under the H200 profile), so copies ahead pay only
# with a strict gate (SPECULATE_PRECISION), one guess a layer (SPECULATE_EXPERTS) and one kernel a
# guess (GUESS_ON_HOST_TOKENS); with those the decode hit rate at 25% rises by 4-7 points over the
# cache alone and the replayed step is no slower than the cache alone was before them (figures in
# benchmarks/results/moe_sim.json and the README's MoE table). Off: guesses are still made, on a
# sample of the steps, and scored (``ot.stats(model).guesses``).
SPECULATE_COPY = True
# A router whose layer missed nothing in the last step and none of whose bins pays (or every router,
# with SPECULATE_COPY off) is guessed for at every SPECULATE_SAMPLE-th step only, which saves a
# guess's kernel (4 us of launch on the compute stream) on steps where no copy would be made. 1:
# every step, the default: with one kernel a guess (GUESS_ON_HOST_TOKENS) the cost is small, and on
# the trained test models at 50% cached, where layers rarely miss, sampling starved the bins of
# evidence (no guess was ever copied; guessing every step brings the hit rate 0.4-1.2 points closer
# to Belady's, benchmarks/results/moe_sim.json).
SPECULATE_SAMPLE = 1
# A router whose own record shows that its look-ahead does not pay (its most guessed bin has
# evidence, and neither its bins, nor the pool's where its own lack evidence, nor those of the
# layer after it guessed two ahead, pass the gate) is guessed for at every SPECULATE_SAMPLE_UNPAID-th
# step only, missed or not: its guesses would be scored, not copied, and they cost host time (on the
# synthetic 256-expert decode of benchmarks/moe_policy_scale.py, whose look-ahead never pays, a
# guess was about 0.28 ms of Python a layer and step on this project's CPU machine). The sample
# keeps its record current, so a look-ahead that improves (a refit) earns its copies back.
SPECULATE_SAMPLE_UNPAID = 4
# Whether the last MoE layer guesses the next decode step's first layer (where the learned
# look-ahead has a map for it: ``moe.predictor.fit(..., seq=)``) and copies it ahead. Off by
# default: the copy is issued at the end of a step, after the last layer's own copies, where one
# layer's compute is left to hide it; under the H200 replay of benchmarks/moe_sim.py (a step ends
# when both streams are idle) it made the trained models' decode step 0.5-3 % slower at 25 % cached
# for 0.3-0.7 points of hit rate (benchmarks/results/moe_sim.json, "next_step").
SPECULATE_NEXT_STEP = False
# Up to this many tokens (decode steps) a guess's softmax and top-k are taken on the host from the
# router scores (E values a token, read back with the layer's routing); beyond it (a prefill) on the
# device. Each kernel is a launch ahead of the layer's routing read: the matmul, softmax and top-k
# of a guess on the device cost the trained models' H200 replay ~0.08 ms a decode step (5%).
GUESS_ON_HOST_TOKENS = 4


def _read_back(packed):
    """(``packed`` on the host, an event or None): on a GPU, pinned staging copies of its tensors
    (a tensor, or a tuple of them) and an event after them, so nothing waits for the device."""
    tensors = packed if isinstance(packed, tuple) else (packed,)
    if not tensors[0].is_cuda:  # (a flag: no device object made, every layer of every step)
        return packed, None
    staged = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
    for host, t in zip(staged, tensors):
        host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return (staged if isinstance(packed, tuple) else staged[0]), event


def lookahead_scores(x: torch.Tensor, weight: torch.Tensor, bias, first) -> torch.Tensor:
    """The look-ahead's kernels: the next layers' router scores from this layer's input, through
    the learned map's hidden layer where it has one (``first``). On a GPU they are launches on the
    compute stream, recorded as ops of their own; a policy clock does not count them as the
    policy's host time (``sim.policy_clock``)."""
    return F.linear(x if first is None else hidden_layer(x, *first), weight, bias)


def _drop_holds(pager, router: Router, wrong) -> None:
    """The copies ``router``'s guesses made of ``wrong`` experts stop being kept for their use
    (``Pager.drop_prefetch_hold``): held until used, each wrong guess kept its room from every other
    copy for steps (at 25% cached on the trained Mixtral-shaped model, 0.3 experts a step more to copy)."""
    if pager is not None:
        for e in wrong:
            for stack in router.stacks:
                pager.drop_prefetch_hold(stack.key_of(e))


def _copy_ahead(pager, router: Router, expert: int, ahead: int) -> bool:
    """Copy ``expert`` of every stack of ``router``'s layer, counted as its guess's (made ``ahead``
    layers before it); False where the pager found no room for one."""
    for stack in router.stacks:
        master = stack.master_ref()
        if master is None or master.flat is None:
            continue
        key = stack.keys[expert]  # (Stack.key_of)
        cached_now = pager.is_cached(key)
        if not pager.prefetch(master, key[1], key[2], key[3], key):  # (master, dtype, lo, hi, key)
            return False
        if not cached_now:
            nbytes = stack.expert_bytes
            router.copied[expert] = router.copied.get(expert, 0) + nbytes
            router.prefetched_bytes += nbytes
            if ahead == 2:
                router.copied2.add(expert)
    return True


# The native extension's pass over a layer's cached copies (csrc/policy.cpp), where built: an expert
# found from its copy's range rather than by looking its key up (at 256 experts a quarter cached,
# a look-up per copy was 70 us of a guess's 110), each stack's copies read from the pager's mapping
# in the same call (a list of their keys made per stack and guess was most of the rest).
_NATIVE_CACHED = _ext.native_function("cached_experts")


def _cached_experts(pager, router: Router) -> frozenset:
    """The experts of ``router``'s layer with every stack cached."""
    stacks = router.stacks
    if pager is None or not stacks:
        return frozenset()
    copies = pager.cached_copies()  # master id -> its cached copies
    if _NATIVE_CACHED is not None:
        return _NATIVE_CACHED(copies, stacks)
    experts = None
    for stack in stacks:  # (every guess: one pass over each stack's cached copies)
        expert_of = stack.experts.get  # (whole experts only: a copy of part of one is no expert cached)
        cached = {expert_of(c.key) for c in copies.get(stack.master_id, ())}
        cached.discard(None)
        experts = cached if experts is None else experts & cached
    return frozenset(experts)


def _before_any_router(stack, expert) -> None:
    """``RoutingSpeculator.used`` before any router fired in a pass: nothing learned from a page.

    After a router fired, ``used`` is the ``setdefault`` of its dict of the stacks paged (``_learned``:
    a dict used as an ordered set, first paged first): the expert cache calls it for every expert
    paged (some 50 a decode step), and that is a call into C rather than an interpreter frame."""


def _firing_cycle(order: list) -> tuple:
    """(router -> the router that fired after it, the last one the first; the last, or None where one
    fired) of a pass's routers in firing order: the cycle the next pass's guesses follow."""
    after = dict(zip(order, order[1:]))
    last = order[-1] if len(order) > 1 else None
    if last is not None:
        after[last] = order[0]
    return after, last


def _guessed_now(router: Router, after, pool) -> bool:
    """Whether ``router``'s layer is guessed for this step (``after``: the layer after it, guessed two
    ahead by the same matmul, or None): every step while a copied guess may save something, else on
    a sample of the steps, which keeps its record scored (``unpaid_steps`` counts the steps it could
    have been guessed for)."""
    period = SPECULATE_SAMPLE
    if SPECULATE_COPY:
        pays = router.paying(pool) or (after is not None and after.paying(pool, 2))  # (bit masks: any bin)
        if not pays and max(router.bin_guessed) >= router.evidence:
            period = SPECULATE_SAMPLE_UNPAID  # its own record says its look-ahead does not pay
        elif pays or router.missed or (after is not None and after.missed):
            return True
        # Else nothing for a copied guess to save (its layer missed nothing in the last step and no
        # bin pays): it is only scored, which needs a sample, not every step (a guess's kernel is a
        # cost on the compute stream: at 50% cached, where a layer rarely misses, guessing every step
        # made the trained Qwen2-MoE's H200 replay 7% slower than the cache alone).
    router.unpaid_steps += 1
    return not (router.unpaid_steps - 1) % period  # the first such step and every period-th


class RoutingSpeculator:
    """Guesses layer i+1's experts when layer i's router runs, and prefetches them."""

    def __init__(self, pager, stacks, routers: list):  # stacks: the ExpertStacks holding this speculator
        self.pager_ref = weakref.ref(pager)
        self._stacks = stacks
        self.routers = routers  # Router, in module order
        self._next = {}  # router -> the router that ran after it in the last pass (the last: the first)
        self._wrap_from = None  # the router that ran last in the last pass: it guesses the next pass's first
        self._order = []  # routers in firing order, this pass
        self._learned = {}  # router -> the stacks paged after it this pass (first paged first: dict keys)
        self.used = _before_any_router  # (stack, expert) paged: learned for the router that fired last
        # [router or None, scores or (ids, confidences), event or None, tokens, the layer after it, its
        # column, wrap, the router whose next-token prediction it holds (None once delivered), that
        # prediction's column]: guesses and predictions not yet used
        self._pending = []
        self._predicting = False  # whether _pending may hold a prediction not yet delivered (set before it)
        self._expected = []  # GPU: (router, pinned ids, event) of router outputs read back without a sync
        self.hooks = []
        self.recorder = None  # moe.refit.OnlineRefit, when one records the routing
        self.token_table = None  # moe.first_layer.TokenTable: the first layer guessed from a step's tokens
        # Every router's uncached guesses per confidence bin, decayed alike (Router.pays): (correct,
        # guessed) of the guesses one layer ahead, then of those two layers ahead.
        self.pool = tuple([0.0] * len(CONFIDENCE_BINS) for _ in range(4))
        self.waste = WasteBudget()  # the expected waste of the recent copies (guesses.SPECULATE_WASTE)
        self._by_group = {r.stacks[0].group: r for r in routers if r.stacks}  # stack group -> its router
        self._ran_order, self._groups_changed = None, False  # what _next and _by_group were made from (step)

    # -------------------------------------------------------------- hooks

    def router_ran(self, router: Router, x: torch.Tensor) -> None:
        self._order.append(router)
        self.used = self._learned.setdefault(router, {}).setdefault  # (one store: the stacks paged from now on)
        shape = x.shape  # (its width, rank and size from one read of the tensor's shape: each read is a torch call)
        width = shape[-1]
        tokens = router.tokens = prod(shape) // max(width, 1)  # (x.numel())
        if self.recorder is not None:
            self.recorder.input(router, x)
        nxt = self._next.get(router)
        if nxt is None or not nxt.stacks or nxt.top_k is None:
            return
        wrap = router is self._wrap_from
        # Where the learned map also predicts this layer's experts at the next token (rows from
        # ``own`` on), the matmul runs every decode step, for eviction, guess or not.
        learned = router.lookahead  # (the input's width: the hidden layer's, where it has one, else the map's)
        if learned is not None and (learned[0].device != x.device or learned[-2].shape[-1] != width):
            learned = None
        own = learned is not None and router.own is not None
        if own and wrap and not router.missed:
            # The last layer's matmul guesses nothing (the next step's first layer is not guessed
            # by default): run only for its prediction where the layer copied something in the
            # last step (at 50% cached, rarely; a kernel every step made the trained models' H200
            # replay 0.5% slower there, benchmarks/moe_sim.py).
            own = False
            self._stacks.eviction.next_turn.forget(router.stacks)  # (stale: made for an earlier turn)
        guess = not wrap or (SPECULATE_NEXT_STEP and learned is not None and tokens <= GUESS_ON_HOST_TOKENS
                             and self.token_table is None)  # (with a token table, the step's tokens guess it)
        after = self._next.get(nxt) if router.split is not None and not wrap else None
        guess = guess and _guessed_now(nxt, after, self.pool)
        if not guess and not (own and tokens <= GUESS_ON_HOST_TOKENS):
            if own:
                self._stacks.eviction.next_turn.forget(router.stacks)  # a prefill: its next turn is not predicted
            return  # (the next pass's first layer is guessed by a learned map only, at decode)
        module = nxt.module_ref()
        bias, first = None, None
        if learned is not None:
            # The learned look-ahead (moe.predictor): logits of nxt's experts, maybe from a hidden layer.
            weight, bias, first = learned[0], learned[1], learned[2:] or None
            if after is not None and (not after.stacks or after.top_k is None):
                after = None  # (and the weight's two-ahead rows, if any, are not read)
        else:
            after = None
            weight = getattr(module, "weight", None)  # (a module's attribute look-up: only where it guesses)
            if module is None or not isinstance(weight, torch.Tensor) or hasattr(weight, "_master") \
                    or weight.device != x.device or weight.shape[-1] != width:
                return  # an offloaded router would be paged for a guess: not worth it
        x = x if len(shape) == 2 else x.reshape(-1, width)  # (a dispatched op; autograd is off: the hook runs under no_grad)
        x = x if x.dtype is weight.dtype else x.to(weight.dtype)
        scores = lookahead_scores(x, weight, bias, first)
        biased = bias is None and routing.correction_bias(module, scores.shape[-1]) is not None
        if tokens <= GUESS_ON_HOST_TOKENS and not biased:
            # A decode step: the router matmul is the guess's one kernel (on a GPU, plus the
            # read-back copy). Its softmax and top-k over a few rows of E scores are done on the
            # host (_host_guess): each kernel is a launch on the compute stream ahead of the
            # layer's routing read, paid every layer of every step (3 kernels a layer cost the
            # trained test models' H200 replay 0.08 ms a decode step, 5% of it).
            self._queue(nxt if guess else None, scores, tokens, after, router.split, wrap,
                        router if own else None, router.own if learned is not None else None)
            return
        if own:
            self._stacks.eviction.next_turn.forget(router.stacks)  # a prefill: its next turn is not predicted
        first = router.split if router.split is not None else router.own
        if first is not None:
            scores = scores[:, :first]  # a prefill guesses one layer ahead only
        # Many tokens (a prefill) or a biased router: top-k on the device, whose values are the
        # confidences (softmax keeps the order).
        k = min(nxt.top_k, scores.shape[-1])
        if biased:
            top = routing.select_experts(scores, k, module)  # DeepSeek-V3 selects on biased sigmoid scores
            scores = scores.float().sigmoid()
            confidence = (scores / scores.sum(-1, keepdim=True)).gather(-1, top)
        else:
            confidence, top = scores.softmax(-1, dtype=torch.float32).topk(k, dim=-1)
        # The guessed ids and each one's confidence, token-major, each token's experts by
        # descending score.
        self._queue(nxt, (top, confidence), tokens)
        # Issued from the pager once this layer's own experts are (ExpertStacks.announce), so the
        # guesses queue behind them on the copy stream.

    def _queue(self, router, packed, tokens: int, after=None, split=None, wrap=False, owner=None, own=None) -> None:
        """A guess for ``router``'s layer: ``packed`` is its scores (a tensor: top-k taken on the
        host; with ``after``, the router of the layer after it, the scores from column ``split`` on
        are the guess two layers ahead for that one; ``wrap``: a guess for the next pass) or (ids,
        confidences). The scores from column ``own`` on are the next-token map's (not a guess);
        with ``owner`` (the router that ran; ``router`` None: no guess), they are its own layer's
        experts at the next token, for eviction (``predictions_ready``). On a GPU they are read
        back without a host sync (``_read_back``); the copies are issued from the pager's next call
        once the event has completed (by then the layer's own routing read has waited for the
        router anyway)."""
        on_host = type(packed) is not tuple and not packed.is_cuda  # (the read-back's own test, without its call)
        packed, event = (packed, None) if on_host else _read_back(packed)
        self._predicting = self._predicting or owner is not None  # (before the item: cut short between, none found)
        self._pending.append([router, packed, event, tokens, after, split, wrap, owner, own])

    def guess_first(self, tokens) -> None:
        """A decode step's input token ids, on the host (None: not read), as its embedding is about
        to run: copy the first MoE layer's experts the token table names for them
        (``moe.first_layer``), as a guess one layer ahead (the same gates, room and scoring)."""
        first, table = self._next.get(self._wrap_from), self.token_table
        usable = table is not None and first is not None and first.stacks and first.top_k is not None
        pairs = table.guess(tokens) if usable and SPECULATE_COPY and tokens else None
        if pairs:
            self._issue(self.pager_ref(), first, ranked_bins(pairs), len(tokens))
            first.next_pass = False  # (made for this pass: scored at its end)

    def router_output(self, router: Router, output) -> None:
        """The router ran: the experts it selected (``routing.routed_experts``: the ids it returns,
        else its top-k by its own rule) are what its layer will page, told to the expert cache
        before the layer pages anything."""
        if not router.stacks or router.top_k is None or router.stacks[0].group in self._stacks.announcing:
            return  # its layer's op announces what it pages (ExpertStacks.announce): no top-k needed
        module = router.module_ref()
        if module is None:
            return
        num_experts = router.stacks[0].num_experts
        ids = routing.routed_experts(output, num_experts, min(router.top_k, num_experts), module)
        if ids is None:
            return
        host, event = _read_back(ids.reshape(-1))
        if event is None:
            self._stacks.expect(router.stacks, set(host.tolist()))
        else:
            self._expected.append((router, host, event))

    def expected_ready(self) -> None:
        """GPU: hand the router outputs that have reached the host to the expert cache."""
        if not self._expected:
            return  # (every layer's entry asks: no list made where none waits)
        keep = []
        for router, host, event in self._expected:
            if event.query():
                self._stacks.expect(router.stacks, set(host.tolist()))
            else:
                keep.append((router, host, event))
        self._expected = keep

    # -------------------------------------------------------------- issuing and scoring

    def predictions_ready(self) -> None:
        """Hand eviction the next-token predictions whose scores have reached the host (before the
        current layer's copies take their room: ``ExpertStacks.announce``)."""
        if not self._predicting:
            return  # (asked at every layer's entry and announce: mostly delivered already)
        waiting = False
        for item in self._pending:
            owner, event = item[7], item[2]
            if owner is None or (event is not None and not event.query()):
                waiting = waiting or owner is not None  # (not yet on the host)
                continue
            item[1] = rows = host_scores(item[1])  # (read once: the guesses of the same scores take their columns)
            self._stacks.eviction.next_turn.predict(owner.stacks, host_chances(rows, item[8]), owner.top_k)
            item[7] = None  # delivered (cut short before, it is delivered again, the same)
        self._predicting = waiting

    def issue_ready(self) -> None:
        """Start the copies of every guess whose ids have reached the host."""
        pending = self._pending
        if not pending:
            return
        if self._predicting:
            self.predictions_ready()  # (it returns at once otherwise: not called, every layer)
        pager = self.pager_ref()
        keep = []
        for item in pending:
            router, packed, event, tokens, after, split, wrap, _, own = item
            if event is not None and not event.query():
                keep.append(item)
                continue
            if router is None:
                continue  # only a next-token prediction (predictions_ready)
            if type(packed) is tuple:
                ids, conf = packed
                bins = ranked_bins(zip(ids.reshape(-1).tolist(), conf.reshape(-1).tolist()))
            else:
                packed = host_scores(packed)  # (as predictions_ready read them, where it did)
                bins = guess_bins(packed, None, split if split is not None else own, router.top_k)
            self._issue(pager, router, bins, tokens)
            router.next_pass = wrap
            if after is not None:
                # Two layers ahead: copied only into copy time the next layer is expected to leave
                # idle (every expert it is guessed to route is cached or being copied), so that
                # such a copy never queues ahead of a miss of the next layer.
                idle = not (router.guess.keys() - router.cached - router.copied.keys())
                self._issue(pager, after, guess_bins(packed, split, own, after.top_k), tokens, 2, idle)
        self._pending = keep

    def _issue(self, pager, router: Router, bins: dict, tokens: int, ahead: int = 1, idle: bool = True) -> None:
        """Open ``router``'s guess made ``ahead`` layers before it (scored at the step's end) and,
        with ``idle``, copy the guessed experts that are not cached and whose confidence bin has
        paid (``Router.pays``), the most confident first, at most SPECULATE_EXPERTS. ``bins``:
        expert -> its confidence bin, the most confident first (``guesses.ranked_bins``)."""
        cached, pool = _cached_experts(pager, router), self.pool
        copy = pager is not None and idle and SPECULATE_COPY
        worth = open_guess(router, bins, cached, tokens, ahead, pool, copy)  # (the experts worth a copy)
        if worth is None:
            self._score(router)  # one left open by a pass that did not end (no step)
            worth = open_guess(router, bins, cached, tokens, ahead, pool, copy)
        if pager is None:
            return
        eviction = self._stacks.eviction
        if ahead == 1:
            eviction.guard(router.stacks, bins)
        for expert in worth[:SPECULATE_EXPERTS]:
            # It may take only the room of copies expected to be used later than itself.
            chance = router.precision(bins[expert], pool, ahead)
            if not self.waste.spend(chance):
                return  # over the waste budget (guesses.SPECULATE_WASTE); the rest are less precise
            next_use = eviction.expected_next_use(router.stacks[0], expert, chance)
            if not eviction.in_spare_room_only(next_use).run(_copy_ahead, pager, router, expert, ahead):
                return  # no room without evicting copies used sooner than the guess

    def routing_known(self, group, keys) -> None:
        """The layer of stack group ``group`` pages the cache keys ``keys`` this pass (announced, or
        its router's output said so): its guesses' copies of other experts are wrong (``_drop_holds``)."""
        router = self._by_group.get(group)
        if router is not None and router.copied:
            first = router.stacks[0].keys  # (Stack.key_of)
            _drop_holds(self.pager_ref(), router, [e for e in router.copied if first[e] not in keys])

    def _score(self, router: Router, used=None) -> None:
        """Close ``router``'s open guesses against the experts its stacks actually paged (``used``,
        where the caller has them; where its routing was never told, ``routing_known``, its wrong
        copies' holds are dropped here)."""
        wrong = score(router, self.pool, used)
        if wrong:
            _drop_holds(self.pager_ref(), router, wrong)

    def step(self) -> None:
        """A pass ended: score open guesses, learn the router order and which stacks each selects."""
        self.issue_ready()
        if self.recorder is not None:
            self.recorder.step()
        pool = self.pool
        for router in self.routers:
            wrong = close_step(router, pool)  # (its guesses scored, whether it missed)
            if wrong:
                _drop_holds(self.pager_ref(), router, wrong)
        # Which stacks each router selects and the order they fire in, as this pass ran: the maps made
        # from them only where they changed (flagged first: a pass cut short between leaves them to the next).
        self.used = _before_any_router
        for router, paged in self._learned.items():
            stacks = list(paged)
            if stacks and stacks != router.stacks:
                self._groups_changed = True
                router.stacks = stacks
        if self._groups_changed:
            self._by_group = {r.stacks[0].group: r for r in self.routers if r.stacks}
            self._groups_changed = False
        order = self._order
        if order and order != self._ran_order:
            self._ran_order = None
            self._next, self._wrap_from = _firing_cycle(order)
            self._ran_order = order
        self._order, self._learned = [], {}

    def reset(self) -> None:
        for r in self.routers:
            r.clear_record()

    def report(self) -> dict:
        return routers_report(self.routers, self.pool, SPECULATE_COPY)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

