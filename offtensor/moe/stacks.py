"""The offloaded stacks of routed experts as the pager sees them: per-stack counters, the layer
order of a pass, and ``ExpertStacks``, the one object the pager holds as ``pager.experts``.

The pager already caches every paged byte range by (master, dtype, lo, hi); a routed expert is one
such range of a stacked-expert tensor (``experts.w1[e]``, ``gate_up_proj[e:e+1]``). ``ExpertStacks``
adds what that cache does not know about experts: the offloaded stacks by master, grouped by layer;
per-stack counters (hits, misses, bytes copied, evictions); the layer order of the last pass. It
is the pager's observer and eviction policy for experts, and hands each event to the part that
owns it: the eviction policy (``eviction.ExpertEviction``: frequencies, reuse, victims), the
issuer of the current layer's copies (``prefetch.ExpertIssuer``: announce, expect) and the
routing speculator (``speculation.RoutingSpeculator``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from .. import _ext
from .eviction import ExpertEviction
from .eviction import order as eviction_order
from .prefetch import ExpertIssuer
from .stack import LayerOrder, Stack

if TYPE_CHECKING:
    from .speculation import RoutingSpeculator

# The pager's calls for every expert it pages, copies or evicts, each in one native call where the
# extension is built (csrc/bookkeeping.cpp): the same steps on the same objects, in the same order,
# as the methods below, without their six calls and forty attribute reads per expert paged.
_NATIVE_ACCESSED = _ext.native_function("expert_accessed")
_NATIVE_COPIED = _ext.native_function("expert_copied")
_NATIVE_EVICTED = _ext.native_function("expert_evicted")


class ExpertStacks:
    """The pager's view of routed experts: stacks by master, counters, and the parts it hands to."""

    __slots__ = ("by_master", "speculator", "layers", "eviction", "issuer", "_stack_bytes", "compute", "compute_choice",
                 "room_needed", "lookahead", "__weakref__")

    def __init__(self, compute: str = "device", compute_choice=None):
        self.by_master: dict = {}  # master id -> Stack
        self.speculator: Optional[RoutingSpeculator] = None
        self.layers = LayerOrder()
        self.eviction = ExpertEviction(self.by_master, self.layers)
        self.issuer = ExpertIssuer(self.layers)
        self._stack_bytes = 0  # bytes of every registered stack
        # Where an expert that is not cached is computed: "device", "host" or "auto"; for "auto",
        # stack group -> ((most routed rows, on the host), ...) from the replay (ops/host_experts.py).
        self.compute = compute
        self.compute_choice = compute_choice
        # () -> the bytes the model's largest op pages at once (its placement's working set), which
        # device memory taken from the budget must leave room for; None where nobody said.
        self.room_needed = None
        # The learned look-ahead its speculator's routers guess from (``moe.predictor.install``):
        # (predictor, device, bytes of its maps on the pager's device, taken from the budget), or None.
        self.lookahead = None

    @property
    def announcing(self) -> set:
        """Stack groups whose op announces its experts: their routers' top-k need not be read."""
        return self.issuer.announcing

    def register(self, name: str, t: torch.Tensor) -> None:
        # Experts are whole contiguous slices along dim 0, so an expert's cache key is computable
        # from its index; a stack viewed with other strides is left to the plain cache.
        if t.dim() >= 2 and t.shape[0] > 1 and t._host.is_contiguous():
            stack = self.by_master[t._master.id] = Stack(name, t)
            self._stack_bytes += stack.expert_bytes * stack.num_experts

    def is_stack(self, master_id: int) -> bool:
        return master_id in self.by_master

    # -------------------------------------------------------------- the pager's call sites

    def accessed(self, key, hit: bool) -> None:
        """An op paged ``key`` (of a stack, or a dense weight's copy): a cache hit or a copy it waited
        for. (It runs for every expert paged: the parts' state is read here, each part called once.)"""
        if _NATIVE_ACCESSED is not None:
            return _NATIVE_ACCESSED(self, key, hit)
        stack = self.by_master.get(key[0])
        if stack is None:
            self.eviction.touch(key)
            return
        issuer = self.issuer
        if key in issuer.issued_for_op:
            hit = issuer.seen(key, hit)
        if hit:
            stack.hits += 1
        else:
            stack.misses += 1
        expert = stack.experts.get(key)
        if expert is None:
            expert = stack.expert_of(key)
        current = stack.group == self.layers.current
        self.eviction.used(key, issuer.shares.get(expert, 1.0) if current else 1.0, stack, expert, current)
        stack.used.add(expert)
        if self.speculator is not None:
            self.speculator.used(stack, expert)

    def announce(self, pager, master_id: int, experts, tokens=None) -> None:
        """The op about to run pages these experts of ``master_id``'s layer (every stack of it),
        ``tokens[i]`` tokens routed to ``experts[i]`` where the op knows the counts.

        A use counts towards an expert's frequency in proportion to its tokens (the most routed
        expert of the op counts 1): after a prefill, which routes its tokens to most experts of a
        layer, the experts that took many tokens are the likelier picks of the next token, and
        the frequency should say so rather than rank them all alike.

        Eviction may then take the layer's other experts, whose next use is a step away. The
        layer's missing experts are all issued now, every stack of the layer, before the op pages
        them one at a time: the copy stream gets the whole layer at once, and the guess for the
        next layer (issued right after) queues behind them instead of ahead of them."""
        stack = self.by_master.get(master_id)
        if stack is None:
            return
        issuer = self.issuer
        if stack.group == self.layers.current:
            if issuer.repeats(stack.group, experts, tokens):
                return  # the layer's other stack announced the same (paging would enter no layer)
        else:
            self._enter(stack)  # (paging without its guesses: they go behind this layer's copies, below)
        group = self.eviction.stack_groups()[stack.group]
        speculator = self.speculator
        if speculator is not None:
            speculator.predictions_ready()  # this layer's next turn, before its copies take room
        known = speculator.routing_known if speculator is not None else None
        if issuer.announce(pager, stack, group, experts, tokens, known) and speculator is not None:
            speculator.issue_ready()

    def paging(self, master_id: int, issue_guesses: bool = True) -> None:
        """An op is about to page from ``master_id``: before its lookup, so that eviction for this
        very copy knows which layer's stacks are current. Where no op of the layer announced its
        experts (a model that selects them one by one), guesses whose ids have reached the host
        are issued here."""
        stack = self.by_master.get(master_id)
        if stack is not None and stack.group != self.layers.current:
            self._enter(stack)
        if issue_guesses and self.speculator is not None and self.issuer.announced is None:
            self.speculator.issue_ready()

    def _enter(self, stack: Stack) -> None:
        """``stack``'s layer, not the current one, starts paging."""
        speculator = self.speculator
        if speculator is not None:
            speculator.expected_ready()
            speculator.predictions_ready()
        self.issuer.entered(stack.group)
        self.eviction.entered(stack.group)
        self.layers.enter(stack.group)
        if speculator is not None and self.layers.needed is not None:
            speculator.routing_known(stack.group, self.layers.needed)  # (its router's output said)

    def expect(self, stacks: list, experts) -> None:
        """A router's output says its layer will page these experts of ``stacks`` (``ExpertIssuer.expect``)."""
        self.issuer.expect(stacks, experts)

    def guard(self, stacks: list, experts) -> None:
        """The guess of ``stacks``' layer names these experts (``ExpertEviction.guard``)."""
        self.eviction.guard(stacks, experts)

    def in_spare_room_only(self, next_use=None):
        """Copies issued inside (guesses) take only room whose next use is expected later than
        ``next_use`` layers and far away (``ExpertEviction.in_spare_room_only``)."""
        return self.eviction.in_spare_room_only(next_use)

    def expected_next_use(self, stack: Stack, expert: int, chance: float) -> float:
        """Expected layers until a guessed expert is used (``ExpertEviction.expected_next_use``)."""
        return self.eviction.expected_next_use(stack, expert, chance)

    def copied(self, key, nbytes: int, prefetch: bool) -> None:
        """The pager copied ``key`` (``nbytes``, ahead of its use with ``prefetch``)."""
        if _NATIVE_COPIED is not None:
            return _NATIVE_COPIED(self, key, nbytes, prefetch)
        stack = self.by_master.get(key[0])
        if stack is None:
            self.eviction.touch(key)
            return
        stack.bytes_h2d += nbytes
        if prefetch and not self.issuer.issuing:
            stack.prefetched_bytes += nbytes
        self.eviction.copied(key, stack, stack.expert_of(key), stack.group == self.layers.current)

    def evicted(self, key) -> None:
        if _NATIVE_EVICTED is not None:
            return _NATIVE_EVICTED(self, key)
        self.eviction.evicted(key)
        stack = self.by_master.get(key[0])
        if stack is not None:
            stack.evictions += 1

    def victim(self, view, room: int, candidates):
        """The pager's eviction policy for a model with offloaded experts (``ExpertEviction.victim``)."""
        return self.eviction.victim(view, room, candidates)

    def order(self, view, candidates) -> list:
        """The policy's ranking of every evictable copy (``eviction.order``)."""
        return eviction_order(self.eviction, view, candidates)

    def step(self) -> None:
        """A forward begins: decay use frequencies, close the last step's guesses."""
        self.eviction.decay()
        if self.speculator is not None:
            self.speculator.step()
        self.eviction.measure_reuse(turn=True)  # (and every stack's experts used this step become its last step's)
        self.layers.step()
        self.issuer.step()
        self.eviction.step()

    def routed_keys(self) -> dict:
        """Cache key -> bytes of every expert slice paged since the step began (for the measure
        "bytes moved vs routed experts that were not cached" in tests and benchmarks)."""
        return {stack.key_of(e): stack.expert_bytes for stack in self.by_master.values() for e in stack.used}

    def reset(self) -> None:
        for stack in self.by_master.values():
            stack.hits = stack.misses = stack.bytes_h2d = stack.prefetched_bytes = stack.evictions = 0
        if self.speculator is not None:
            self.speculator.reset()

    def report(self) -> dict:
        return {s.name: s.report() for s in self.by_master.values()}

