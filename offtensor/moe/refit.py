"""Fitting the learned look-ahead from recorded routing: offline (``fit_offline``: a model's
routers' inputs and routed experts over token sequences, fitted, compared on held-out ones, kept
and saved beside the checkpoint) or during a run (``OnlineRefit``: the routing a wrapped model
records as it decodes, each MoE layer's router input and the experts its layer then paged, one
token a step, refitted now and then and installed in place of the look-ahead it guessed from).

The last quarter of the recorded window is held out of each online fit and measures the refitted
maps against the router look-ahead (and the next-token maps against the previous token's experts),
layer by layer (``LookaheadPredictor.keep``), so a refit keeps only what it measured as better;
the first MoE layer's token table (``first_layer``), counted from the window's tokens, is measured
there against the one installed and the last layer's map, the same way. A
refit runs on the host at the start of a forward: one [H, H] solve in float64 per least-squares
map (three a layer at most) and a logistic fit of the next-token map, so ``every`` should be
hundreds of steps on a model with a wide hidden state.
"""

from __future__ import annotations

import warnings
from collections import deque

import torch
import torch.nn.functional as F

from ..pager import BudgetError
from .first_layer import TokenTable, input_embeddings
from .predictor import RIDGE, LookaheadPredictor, install
from .routing import _router_modules, model_top_k, routed_experts


def record_routing(model, ids: torch.Tensor, seq: int, batch: int = 8):
    """Per MoE router of ``model`` (module order, its firing order): its inputs [N, H] and routed
    ids [N, k] over ``ids`` cut into sequences of ``seq`` tokens, run as prefills ``batch`` at a
    time (N: every token, sequence by sequence), and the router look-ahead on them (the next
    router's scores; the last router's: the first router's, for the next token)."""
    routers, top_k = _router_modules(model), model_top_k(model)
    if not routers or top_k is None:
        raise ValueError(f"offtensor: record_routing: {type(model).__name__} has no MoE routers (a gate / router "
                         f"with a [num_experts, hidden] weight beside routed expert stacks) or no top-k")
    usable = ids.numel() // seq * seq
    if usable < 2 * seq:
        raise ValueError(f"offtensor: record_routing needs at least two sequences of {seq} tokens, got {ids.numel()}")
    xs, routed = [[] for _ in routers], [[] for _ in routers]

    def seen(i, module, args, output):
        xs[i].append(args[0].reshape(-1, args[0].shape[-1]).detach().float().cpu())
        routed[i].append(routed_experts(output, routers[i][2], top_k, module).cpu())

    hooks = [module.register_forward_hook(lambda m, a, o, i=i: seen(i, m, a, o)) for i, (_, module, _) in enumerate(routers)]
    try:
        with torch.no_grad():
            sequences = ids.reshape(-1)[:usable].view(-1, seq)
            for start in range(0, sequences.shape[0], batch):
                model(sequences[start:start + batch])
    finally:
        for h in hooks:
            h.remove()
    xs, routed = [torch.cat(v) for v in xs], [torch.cat(v) for v in routed]
    ahead = [F.linear(x, routers[(i + 1) % len(routers)][1].weight.detach().float().cpu()) for i, x in enumerate(xs)]
    return xs, routed, ahead


def fit_offline(model, ids: torch.Tensor, held_out: torch.Tensor, seq: int, save=None,
                ridge: float = RIDGE, hidden=None) -> LookaheadPredictor:
    """The learned look-ahead of ``model`` fitted on the routing of token ids ``ids``, compared
    with the router look-ahead (and its next-token maps with the previous token's experts) on
    ``held_out`` and kept per layer where it was right more often, both recorded in sequences of
    ``seq`` tokens (``record_routing``); with ``save`` (a checkpoint directory), written beside
    it as ``lookahead.safetensors``; with ``hidden``, its maps read a hidden layer of that width
    (``LookaheadPredictor.fit``). ``install`` hands it to a wrapped model."""
    fx, fr, _ = record_routing(model, ids, seq)
    hx, hr, ha = record_routing(model, held_out, seq)
    experts = _router_modules(model)[0][2]
    predictor = LookaheadPredictor.fit(fx, fr, experts, ridge, seq=seq, hidden=hidden)
    predictor.compare(hx, hr, ha, seq=seq)
    predictor.keep()
    fit_token_table(model, predictor, ids, fr[0], held_out, hr[0])
    if save is not None:
        predictor.save(save)
    return predictor


def fit_token_table(model, predictor: LookaheadPredictor, ids: torch.Tensor, routed: torch.Tensor,
                    held_out: torch.Tensor, held_routed: torch.Tensor) -> float:
    """``predictor``'s token table (``first_layer.TokenTable``) counted from token ids ``ids`` and
    the first MoE layer's ``routed`` experts at them (``record_routing``'s first, in its order),
    kept where on ``held_out`` and ``held_routed`` it names that layer's experts more often than
    the last layer's next-token map does (its score, ``compare``); its held-out precision."""
    routers = _router_modules(model)
    vocab = getattr(input_embeddings(model), "num_embeddings", None) or int(max(ids.max(), held_out.max())) + 1
    table = TokenTable.fit(ids.reshape(-1)[:routed.shape[0]], routed, routers[0][2], vocab)
    return _keep_best_table(predictor, [table], held_out.reshape(-1)[:held_routed.shape[0]], held_routed,
                            len(routers))


def _keep_best_table(predictor: LookaheadPredictor, tables: list, ids: torch.Tensor, routed: torch.Tensor,
                     layers: int) -> float:
    """``predictor.token_table``: the most precise of ``tables`` (None for one missing; ties to the
    first) on held-out ``ids`` and the first layer's ``routed`` experts there, where it names them
    more often than the last of ``layers`` MoE layers' guess of the next token's does (``compare``'s
    score), else None; its precision, kept in ``scores[0]["table"]``."""
    scored = [(table.precision(ids, routed), -n, table) for n, table in enumerate(tables) if table is not None]
    precision, _, best = max(scored, key=lambda s: s[:2], default=(0.0, 0, None))
    predictor.scores.setdefault(0, {})["table"] = precision
    last = layers - 1  # its guess of the next token's first layer: the rival
    rival = predictor.scores.get(last, {}).get("learned" if last in predictor.weights else "router", 0.0)
    predictor.token_table = best if precision > rival else None
    return precision


class OnlineRefit:
    """Records decode routing through a wrapped model's speculator and refits its look-ahead every
    ``every`` recorded steps, on the last ``window`` of them (at least ``minimum``); with
    ``save`` (a checkpoint directory), each refit is written beside it (``lookahead.safetensors``)."""

    def __init__(self, pager, every: int = 256, window: int = 2048, minimum: int = 64, ridge: float = RIDGE,
                 save=None):
        stacks = getattr(pager, "experts", None)
        speculator = getattr(stacks, "speculator", None)
        if speculator is None:
            raise ValueError("offtensor: OnlineRefit: this pager has no routing speculator (no offloaded expert "
                             "stacks, or prefetch=False)")
        if every < 1 or minimum < 8 or window < minimum:
            raise ValueError(f"offtensor: OnlineRefit needs every >= 1, minimum >= 8 and window >= minimum, got "
                             f"every={every}, window={window}, minimum={minimum}")
        self.pager, self.speculator = pager, speculator
        self.every, self.minimum, self.ridge, self.save = every, minimum, ridge, save
        self.steps = deque(maxlen=window)  # per recorded step: [(router input [H], routed ids [k])] by layer
        self.tokens = deque(maxlen=window)  # per recorded step: its input token, or None where not read
        self._token = None  # this pass's input token (``tokens_in``)
        self._inputs = {}  # router -> its input this pass
        self.since = 0  # steps recorded since the last refit
        self.refits = 0
        self.predictor = None  # the last refitted predictor
        speculator.recorder = self

    def input(self, router, x: torch.Tensor) -> None:
        """``router`` ran on ``x``: kept for the step when it is one token (a decode step)."""
        if x.numel() == x.shape[-1]:
            self._inputs[router] = x.detach().reshape(-1).float().clone()

    def tokens_in(self, tokens) -> None:
        """The pass's input token ids on the host (its embedding's pre-hook; None: not read): kept
        for the step when one token."""
        self._token = tokens[0] if tokens and len(tokens) == 1 else None

    def step(self) -> None:
        """A pass ended (before its routing is cleared): record it if every MoE layer decoded one
        token, and refit once ``every`` steps have been recorded since the last."""
        routers = [r for r in self.speculator.routers if r.stacks]
        inputs, self._inputs = self._inputs, {}
        token, self._token = self._token, None
        record = []
        for router in routers:
            used = set().union(*(s.used for s in router.stacks))
            x = inputs.get(router)
            if x is None or not used or len(used) != router.top_k:
                return  # not a one-token pass through every layer
            record.append((x, torch.tensor(sorted(used))))
        self.steps.append(record)
        self.tokens.append(token)
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
        self._fit_token_table(fit, routed[0], cut, len(routers), num_experts)
        self.predictor, self.since, self.refits = fit, 0, self.refits + 1
        if self.save is not None:
            fit.save(self.save)
        try:
            return install(self.pager, fit)
        except BudgetError as e:  # (a refit runs inside a forward: the decode goes on as it was)
            warnings.warn(f"{e} The look-ahead installed before this refit stays.", RuntimeWarning, stacklevel=2)
            return []

    def _fit_token_table(self, fit: LookaheadPredictor, routed: torch.Tensor, cut: int, layers: int,
                         num_experts: int) -> None:
        """``fit``'s token table: the installed one or one counted from the window's first three
        quarters (where every step's token was read), whichever names the first layer's experts
        more often on the last quarter, kept where it beats the last layer's map."""
        installed = self.speculator.token_table
        if len(self.tokens) != routed.shape[0] or None in self.tokens:  # (a token not read: a busy stream)
            fit.token_table = installed
            return
        ids = torch.tensor(list(self.tokens))
        counted = TokenTable.fit(ids[:cut], routed[:cut], num_experts)
        _keep_best_table(fit, [installed, counted], ids[cut:], routed[cut:], layers)

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
