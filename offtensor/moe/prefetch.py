"""What the current MoE layer says it pages, and the copies of its experts issued at once.

An op that knows its experts (``_grouped_mm``, the index ops) ``announce``s them: the layer's
missing experts are issued at once, every stack of the layer, before the op pages them one at a
time, and its unrouted experts become evictable. A model that selects its experts one by one
announces nothing; there the router's output says which experts its layer will page (``expect``):
eviction may take the others once the layer starts, but nothing is copied ahead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _ext

if TYPE_CHECKING:
    from .stack import LayerOrder, Stack

# The native extension's key set of a layer's experts (csrc/policy.cpp, the same as eviction's
# guard uses), where built: one call at every MoE layer's announce rather than a loop per stack.
_NATIVE_KEYS = _ext.native_function("expert_keys")


class ExpertIssuer:
    """The current op's experts (``announce`` / ``expect``) and the copies issued ahead of it."""

    __slots__ = ("layers", "announcing", "issued_for_op", "issuing", "announced", "shares", "_expected", "_last")

    def __init__(self, layers: "LayerOrder"):
        self.layers = layers  # ExpertStacks' LayerOrder: announce sets what the current op pages
        # Stack groups whose op announces its experts (``_grouped_mm``, the index ops): their
        # routers' top-k need not be read back (RoutingSpeculator.router_output).
        self.announcing = set()
        # Plain attributes rather than properties or lookup methods: ExpertStacks reads them for
        # every expert paged (``accessed``, ``paging``).
        self.issued_for_op = set()  # keys announce copied ahead of their op: misses, though found on the device
        self.issuing = False  # whether the copies being made now are announce's (the layer's own, not copies ahead)
        self.announced = None  # the key set the current layer's announce issued (None: none yet)
        self._last = None  # (group, experts, tokens, the key set) of the last announce
        self.shares = {}  # expert -> its share of the current layer's tokens (announce), most routed = 1
        # group -> keys its router's output says the layer will page (RoutingSpeculator.router_output),
        # for models that select experts one by one and so announce nothing
        self._expected = {}

    def seen(self, key, hit: bool) -> bool:
        """Whether an op's use of ``key`` counts as a hit: a copy announce made for this very op is
        a miss the op did not wait for in line."""
        if key in self.issued_for_op:
            self.issued_for_op.discard(key)
            return False
        return hit

    def share(self, expert: int) -> float:
        """``expert``'s share of the current layer's tokens (1 where the op did not say)."""
        return self.shares.get(expert, 1.0)

    def entered(self, group) -> None:
        """``group``'s layer starts paging: what its router's output said it pages, if anything."""
        self.shares = {}
        self.layers.needed = self._expected.pop(group, None)
        self.announced = None

    def announce(self, pager, stack: "Stack", group: list, experts, tokens=None, known=None) -> bool:
        """Issue the copies of ``experts`` of every stack in ``group`` (``stack``'s layer) that are
        not cached; ``tokens[i]`` tokens routed to ``experts[i]`` where the op knows the counts.
        ``known(group, keys)``, if given, is told the layer's keys before any copy is issued.
        False when the layer's other stack already announced the same experts (nothing issued)."""
        experts = list(map(int, experts))
        most = max(tokens, default=0) if tokens is not None and len(tokens) == len(experts) else 0
        self.shares = {e: n / most for e, n in zip(experts, tokens)} if most > 0 else {}
        # The layer's key set in one native pass where built (every stack's keys of the experts, in
        # the order the interpreter's loop adds them); the copies below index each stack's keys again
        # only where they issue (the layer's second stack, whose set is the same, issues nothing).
        if _NATIVE_KEYS is not None and type(group) is list:
            needed = _NATIVE_KEYS(group, experts)
        else:
            needed = {s.keys[e] for s in group for e in experts}
        if needed == self.announced:
            self._last = (stack.group, experts, tokens, self.announced)
            return False  # the layer's second stack (down after gate_up): already issued
        self.layers.needed = self.announced = needed
        self._last = (stack.group, experts, tokens, needed)
        self.announcing.add(stack.group)
        if known is not None:
            known(stack.group, needed)
        # The layer's own experts are paged right after anyway: they take the victims in-line paging
        # would (no _spare_room_only restriction), only sooner.
        is_cached, prefetch, issued = pager.is_cached, pager.prefetch, self.issued_for_op
        self.issuing = True
        try:
            for s in group:
                master = s.master_ref()
                if master is None or master.flat is None:
                    continue
                keys = s.keys
                for e in experts:
                    key = keys[e]
                    if is_cached(key):
                        continue
                    if not prefetch(master, key[1], key[2], key[3], key):
                        break  # the budget holds no more at once: the rest is paged in line
                    issued.add(key)
        finally:
            self.issuing = False
        return True

    def repeats(self, group, experts, tokens) -> bool:
        """Whether announcing ``experts`` (``tokens``) for ``group`` now would change nothing: the
        last announce was the same, for the same layer, and nothing has reset it since (the layer's
        second grouped GEMM, down after gate_up, skips computing its key set again)."""
        last = self._last
        if type(experts) is not list or not (tokens is None or type(tokens) is list):
            return False
        return (last is not None and last[3] is self.announced and last[0] == group
                and last[1] == experts and last[2] == tokens)

    def expect(self, stacks: list, experts) -> None:
        """A router's output says its layer will page these experts of ``stacks``: once the layer
        starts paging, eviction may take the layer's other experts (as after ``announce``), but
        nothing is copied ahead, since the model's own routing may differ (groups)."""
        if stacks:
            self._expected[stacks[0].group] = {s.key_of(int(e)) for s in stacks for e in experts}

    def step(self) -> None:
        """A step ended: nothing it announced or expected carries over."""
        self.announced = None
        self.issued_for_op = set()
        self._expected = {}
