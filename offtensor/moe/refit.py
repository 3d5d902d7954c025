"""Online refit of the learned look-ahead: the routing a wrapped model records as it decodes (each
MoE layer's router input and the experts its layer then paged, one token a step), refitted now and
then (``moe.predictor``'s ridge fit) and installed in place of the look-ahead it guessed from.

The last quarter of the recorded window is held out of each fit and measures the refitted map
against the router look-ahead, layer by layer (``LookaheadPredictor.keep``), so a refit keeps
only what it measured as better. A refit runs on the host at the start of a forward: one [H, H]
solve in float64 per map (three maps a layer at most), so ``every`` should be hundreds of steps
on a model with a wide hidden state.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.nn.functional as F

from .predictor import RIDGE, LookaheadPredictor, install


class OnlineRefit:
    """Records decode routing through a wrapped model's speculator and refits its look-ahead every
    ``every`` recorded steps, on the last ``window`` of them (at least ``minimum``)."""

    def __init__(self, pager, every: int = 256, window: int = 2048, minimum: int = 64, ridge: float = RIDGE):
        stacks = getattr(pager, "experts", None)
        speculator = getattr(stacks, "speculator", None)
        if speculator is None:
            raise ValueError("offtensor: OnlineRefit: this pager has no routing speculator (no offloaded expert "
                             "stacks, or prefetch=False)")
        if every < 1 or minimum < 8 or window < minimum:
            raise ValueError(f"offtensor: OnlineRefit needs every >= 1, minimum >= 8 and window >= minimum, got "
                             f"every={every}, window={window}, minimum={minimum}")
        self.pager, self.speculator = pager, speculator
        self.every, self.minimum, self.ridge = every, minimum, ridge
        self.steps = deque(maxlen=window)  # per recorded step: [(router input [H], routed ids [k])] by layer
        self._inputs = {}  # router -> its input this pass
        self.since = 0  # steps recorded since the last refit
        self.refits = 0
        self.predictor = None  # the last refitted predictor
        speculator.recorder = self

    def input(self, router, x: torch.Tensor) -> None:
        """``router`` ran on ``x``: kept for the step when it is one token (a decode step)."""
        if x.numel() == x.shape[-1]:
            self._inputs[router] = x.detach().reshape(-1).float().clone()

    def step(self) -> None:
        """A pass ended (before its routing is cleared): record it if every MoE layer decoded one
        token, and refit once ``every`` steps have been recorded since the last."""
        routers = [r for r in self.speculator.routers if r.stacks]
        inputs, self._inputs = self._inputs, {}
        record = []
        for router in routers:
            used = set().union(*(s.used for s in router.stacks))
            x = inputs.get(router)
            if x is None or not used or len(used) != router.top_k:
                return  # not a one-token pass through every layer
            record.append((x, torch.tensor(sorted(used))))
        self.steps.append(record)
        self.since += 1
        if self.since >= self.every and len(self.steps) >= self.minimum:
            self.refit()

    def refit(self) -> list:
        """Fit on the first three quarters of the window, keep per layer what beats the router
        look-ahead on the last quarter, install it: the routers that now guess from it."""
        steps = list(self.steps)
        layers = len(steps[0])
        inputs = [torch.stack([s[i][0] for s in steps]).cpu() for i in range(layers)]
        routed = [torch.stack([s[i][1] for s in steps]) for i in range(layers)]
        cut = len(steps) * 3 // 4
        routers = [r for r in self.speculator.routers if r.stacks]
        num_experts = routers[0].stacks[0].num_experts
        fit = LookaheadPredictor.fit([x[:cut] for x in inputs], [y[:cut] for y in routed], num_experts,
                                     self.ridge, seq=cut)
        held_x, held_y = [x[cut:] for x in inputs], [y[cut:] for y in routed]
        fit.compare(held_x, held_y, self._router_ahead(routers, held_x), seq=len(steps) - cut)
        fit.keep()
        self.predictor, self.since, self.refits = fit, 0, self.refits + 1
        return install(self.pager, fit)

    @staticmethod
    def _router_ahead(routers, inputs) -> list:
        """The router look-ahead on held-out inputs: the next router's weight (the last layer's: the
        first router's, for the next token), or nothing where that weight is not a plain tensor."""
        out = []
        for i, x in enumerate(inputs):
            module = routers[(i + 1) % len(routers)].module_ref()
            weight = getattr(module, "weight", None)
            if not isinstance(weight, torch.Tensor) or hasattr(weight, "_master") or weight.shape[-1] != x.shape[-1]:
                break  # compare gives the router look-ahead 0 from here on
            out.append(F.linear(x, weight.detach().float().cpu()))
        return out
