"""The learned look-ahead: per MoE layer, a linear map from the layer's router input (its hidden
state) to the next MoE layer's expert scores, fitted by ridge regression on recorded routing.

The router look-ahead (the next layer's router weight applied to this layer's input) guesses from
a weight trained for another input; a map fitted on recorded (hidden state at layer l, experts
routed at layer l + 1) pairs guesses from this very input, and costs the same: one [E, H] matmul a
step on the device, whose scores the speculator reads back as it reads the router look-ahead's.
The fit is least squares with a ridge on one-hot targets (closed form, float64), its scores scaled
by the temperature that makes their softmax the likeliest on the fitted pairs (the speculator's
confidence bins read a softmax). ``compare`` measures it against the router look-ahead on pairs
held out of the fit, and ``LookaheadPredictor.keep`` keeps it only for the layers where it is
right more often. ``save`` / ``load`` keep it beside a checkpoint (safetensors); ``install`` hands
it to a wrapped model's speculator. Where the copy of a guess needs more time than one layer's
compute, a second map guesses two layers ahead from the same input (``weights2``), kept where its
held-out precision is at least TWO_AHEAD_PRECISION; installed, both maps are one matmul.

A third map (``own_weights``) predicts the layer's own experts at the next token, for eviction
rather than for copies: fitted by logistic regression (``fit_logistic``) so that its sigmoids are
each expert's chance of use at the layer's next turn, it replaces the eviction's estimate of that
chance (the layer's token-to-token reuse rate for the experts it just routed, their use frequency
for the others), and is kept where it ranks the next token's experts better than that reuse does.
Installed, it is more rows of the same matmul.

With ``fit(..., hidden=)`` every map of a layer reads one ReLU layer on the router input instead
of the input itself (``fit_hidden``: the layer and the maps fitted together), which ranks routings
no linear map can; installed, it is one kernel more (``hidden_layer``).

The first MoE layer has no layer before it within a step: ``token_table`` (``moe.first_layer``),
where kept, guesses it from the step's input tokens, on the host.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Optional

import torch
import torch.nn.functional as F

from ..pager import BudgetError
from ..safetensors_files import LOOKAHEAD_FILE, read_header_and_metadata, shape_text, tensors
from .first_layer import TokenTable

FILE_NAME = LOOKAHEAD_FILE
# The maps' account of the budget (``Pager.hold_outside``).
LOOKAHEAD_ACCOUNT = "look-ahead maps"
# The ridge, relative to the mean diagonal of the centred Gram matrix (a scale-free strength).
RIDGE = 1e-2
# Softmax temperatures tried for the fitted scores (a one-hot regression's scores lie near [0, 1]).
TEMPERATURES = (1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0)
# A two-ahead map is kept for a layer only where its held-out top-k precision is at least this:
# its guesses are copied only when the next layer is expected to copy nothing of its own
# (speculation), and a map right less often than this would mostly waste that idle copy time.
TWO_AHEAD_PRECISION = 0.6
# The look-ahead with a hidden layer (``fit(..., hidden=HIDDEN)``): every map of a layer reads the
# same ReLU layer of this width on the router input (one kernel with its matmul: ``hidden_layer``), fitted jointly by Adam on minibatches. On the
# trained Mixtral-shaped test model (benchmarks/moe_sim.py's fit and held-out windows) its guesses
# are right 0.81-0.89 of the time one layer ahead and 0.75-0.85 two ahead, the linear maps' 0.72-0.81
# and 0.69-0.76, for two more kernels a guess (256 units: under a point more).
HIDDEN = 128
HIDDEN_EPOCHS, HIDDEN_BATCH, HIDDEN_LR, HIDDEN_DECAY = 30, 512, 2e-3, 1e-5
# The logistic fit of the next-token map: its L2 penalty on the weights (on inputs scaled to unit
# variance per feature) and its L-BFGS iterations. On the trained test models 1e-5 to 1e-3 move
# the held-out top-k precision by under a point; fewer than ~50 iterations leave it short.
OWN_L2 = 1e-4
OWN_ITERATIONS = 100


def one_hot(routed: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, k] expert ids -> [N, E] float64 with a 1 for each routed expert."""
    routed = routed.reshape(routed.shape[0], -1).long()
    return torch.zeros(routed.shape[0], num_experts, dtype=torch.float64).scatter_(1, routed, 1.0)


def fit_ridge(x: torch.Tensor, routed: torch.Tensor, num_experts: int, ridge: float = RIDGE):
    """Least squares with a ridge from hidden states ``x`` [N, H] to the one-hot of ``routed``
    [N, k]: (weight [E, H], bias [E]) as float32 logits (scores times the fitted temperature)."""
    if x.dim() != 2 or routed.shape[0] != x.shape[0] or x.shape[0] < 2:
        raise ValueError(f"offtensor: fit_ridge needs [N, H] hidden states and [N, k] routed ids with the same N "
                         f"(N >= 2), got {tuple(x.shape)} and {tuple(routed.shape)}")
    if int(routed.min()) < 0 or int(routed.max()) >= num_experts:
        raise ValueError(f"offtensor: fit_ridge: routed ids must be below {num_experts}, got "
                         f"{int(routed.min())}..{int(routed.max())}")
    xd = x.double()
    y = one_hot(routed, num_experts)
    xm, ym = xd.mean(0), y.mean(0)
    xc = xd - xm
    gram = xc.T @ xc
    strength = ridge * float(gram.diagonal().mean()) + 1e-12
    w = torch.linalg.solve(gram + strength * torch.eye(gram.shape[0], dtype=torch.float64), xc.T @ (y - ym))
    b = ym - xm @ w
    scores = xd @ w + b
    k = y.sum(1, keepdim=True)
    best, best_nll = TEMPERATURES[0], None
    for t in TEMPERATURES:
        nll = -(torch.log_softmax(scores * t, -1) * y / k).sum(1).mean().item()
        if best_nll is None or nll < best_nll:
            best, best_nll = t, nll
    return (w.T * best).float().contiguous(), (b * best).float().contiguous()


def fit_logistic(x: torch.Tensor, routed: torch.Tensor, num_experts: int, l2: float = OWN_L2,
                 iterations: int = OWN_ITERATIONS):
    """Per expert, the logistic regression of whether ``routed`` [N, k] names it on hidden states
    ``x`` [N, H]: (weight [E, H], bias [E]) as float32 logits whose sigmoids are the experts'
    chances of being routed (calibrated marginals, as eviction needs them; a one-hot least-squares
    fit ranks as well but its scores are no probabilities)."""
    if x.dim() != 2 or routed.shape[0] != x.shape[0] or x.shape[0] < 2:
        raise ValueError(f"offtensor: fit_logistic needs [N, H] hidden states and [N, k] routed ids with the same N "
                         f"(N >= 2), got {tuple(x.shape)} and {tuple(routed.shape)}")
    # A refit can run inside a forward under torch.inference_mode (OnlineRefit): autograd needs
    # normal tensors, made outside it from the recorded ones.
    with torch.inference_mode(False), torch.enable_grad():
        y = one_hot(routed, num_experts).float()
        xf = x.float()
        mean, scale = xf.mean(0), xf.std(0).clamp_min(1e-6)
        xs = (xf - mean) / scale
        w = torch.zeros(num_experts, xs.shape[1], requires_grad=True)
        prior = y.mean(0).clamp(1e-4, 1 - 1e-4)
        b = torch.log(prior / (1 - prior)).clone().requires_grad_(True)
        opt = torch.optim.LBFGS([w, b], max_iter=iterations, line_search_fn="strong_wolfe")

        def loss():
            opt.zero_grad()
            out = F.binary_cross_entropy_with_logits(F.linear(xs, w, b), y) + l2 * (w * w).sum()
            out.backward()
            return out

        opt.step(loss)
    w, b = w.detach() / scale, b.detach()
    return w.contiguous(), (b - w @ mean).contiguous()


def fit_hidden(x: torch.Tensor, heads: list, num_experts: int, hidden: int = HIDDEN, epochs: int = HIDDEN_EPOCHS,
               seed: int = 0):
    """One ReLU layer of ``hidden`` units on router inputs ``x`` [N, H] shared by ``heads``, each
    (routed ids [N, k], rows [N] bool of the tokens it has a target for or None, kind): kind "guess"
    fits a softmax over the experts to the routed ones (its probabilities are a guess's
    confidence, as ``fit_ridge``'s scaled scores are), "chance" a sigmoid per expert (its chance of
    use, as ``fit_logistic``'s). Adam on minibatches in float32 from a seeded start: the same inputs
    give the same maps. Returns ((w1 [hidden, H], b1 [hidden]), [(w [E, hidden], b [E]) per head]),
    the inputs' standardisation folded into w1 and b1."""
    if x.dim() != 2 or x.shape[0] < 2 or any(y.shape[0] != x.shape[0] for y, _, _ in heads):
        raise ValueError(f"offtensor: fit_hidden needs [N, H] hidden states and [N, k] routed ids per head with the "
                         f"same N (N >= 2), got {tuple(x.shape)} and {[tuple(y.shape) for y, _, _ in heads]}")
    with torch.inference_mode(False), torch.enable_grad():  # (as fit_logistic: a refit may run under it)
        gen = torch.Generator().manual_seed(seed)
        xf = x.float()
        mean, scale = xf.mean(0), xf.std(0).clamp_min(1e-6)
        xs = (xf - mean) / scale
        w1 = ((torch.rand(hidden, xs.shape[1], generator=gen) * 2 - 1) / xs.shape[1] ** 0.5).requires_grad_(True)
        b1 = torch.zeros(hidden, requires_grad=True)
        params, targets = [w1, b1], []
        for routed, rows, kind in heads:
            w = ((torch.rand(num_experts, hidden, generator=gen) * 2 - 1) / hidden ** 0.5).requires_grad_(True)
            b = torch.zeros(num_experts, requires_grad=True)
            params += [w, b]
            y = one_hot(routed, num_experts).float()
            targets.append((y / y.sum(1, keepdim=True) if kind == "guess" else y, rows, kind))
        opt = torch.optim.Adam(params, HIDDEN_LR, weight_decay=HIDDEN_DECAY)
        for _ in range(epochs):
            order = torch.randperm(xs.shape[0], generator=gen)
            for start in range(0, xs.shape[0], HIDDEN_BATCH):
                idx = order[start:start + HIDDEN_BATCH]
                h = F.relu(F.linear(xs[idx], w1, b1))
                loss = 0.0
                for n, (y, rows, kind) in enumerate(targets):
                    z = F.linear(h, params[2 + 2 * n], params[3 + 2 * n])
                    if kind == "guess":
                        each = -(torch.log_softmax(z, -1) * y[idx]).sum(1)
                    else:
                        each = F.binary_cross_entropy_with_logits(z, y[idx], reduction="none").mean(1)
                    if rows is not None:
                        each = each[rows[idx]]
                    if each.numel():
                        loss = loss + each.mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    w1, b1 = w1.detach() / scale, b1.detach()
    maps = [(params[2 + 2 * n].detach().contiguous(), params[3 + 2 * n].detach().contiguous()) for n in range(len(heads))]
    return (w1.contiguous(), (b1 - w1 @ mean).contiguous()), maps


def _shifted(routed: torch.Tensor, seq: int):
    """(each token's next token's routed ids [N, k], rows [N]: False for each sequence's last token,
    whose next is not in it) for N / ``seq`` sequences of ``seq`` tokens."""
    if seq is None or routed.shape[0] % seq or seq < 2:
        raise ValueError(f"offtensor: a next-token map needs seq dividing the {routed.shape[0]} tokens, got seq={seq}")
    rows = torch.ones(routed.shape[0] // seq, seq, dtype=torch.bool)
    rows[:, -1] = False
    return routed.roll(-1, 0), rows.reshape(-1)


def _next_token(x: torch.Tensor, routed: torch.Tensor, seq: int):
    """(inputs of tokens 0..seq-2, routed ids of tokens 1..seq-1) of each sequence of ``seq``."""
    if seq is None or x.shape[0] % seq or seq < 2:
        raise ValueError(f"offtensor: a next-token map needs seq dividing the {x.shape[0]} tokens, got seq={seq}")
    xs = x.reshape(-1, seq, x.shape[-1])[:, :-1]
    ys = routed.reshape(-1, seq, routed.shape[-1])[:, 1:]
    return xs.reshape(-1, x.shape[-1]), ys.reshape(-1, routed.shape[-1])


def _pairs(inputs: list, routed: list, i: int, ahead: int, seq: Optional[int]):
    """(router inputs of layer i, routed ids of layer i + ahead) for the same tokens; past the last
    layer, the first layer's of the next token in each sequence of ``seq`` (``fit``)."""
    if i + ahead < len(inputs):
        return inputs[i], routed[i + ahead]
    if seq is None or inputs[i].shape[0] % seq:
        raise ValueError(f"offtensor: the look-ahead past the last MoE layer needs seq dividing the {inputs[i].shape[0]} "
                         f"tokens, got seq={seq}")
    x = inputs[i].view(-1, seq, inputs[i].shape[-1])[:, :-1]
    y = routed[0].view(-1, seq, routed[0].shape[-1])[:, 1:]
    return x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])


def hidden_layer(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor) -> torch.Tensor:
    """relu(x w1^T + b1) for x [N, H]: one kernel (the matmul's epilogue), not two."""
    return torch._addmm_activation(b1, x, w1.t())


def _apply(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A fitted map's expert logits [N, E] for router inputs ``x`` [..., H]."""
    return torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).to(w.dtype), w, b)


def top_k_precision(scores: torch.Tensor, routed: torch.Tensor) -> float:
    """Share of the top-k of ``scores`` [N, E] that ``routed`` [N, k] names."""
    k = routed.shape[-1]
    guess = scores.topk(k, -1).indices
    return float((guess.unsqueeze(-1) == routed.unsqueeze(-2)).any(-1).float().mean())


class LookaheadPredictor:
    """Per MoE layer position (0 = the first MoE layer, in the model's order), the fitted map from
    its router input to the next MoE layer's expert logits: ``weights[i]`` [E, H], ``biases[i]``
    [E]. Layers it does not cover are guessed by the router look-ahead. ``weights2[i]`` /
    ``biases2[i]``, where present, map the same input to the logits of the MoE layer after the next
    (two layers ahead: a guess whose copy has the next layer's compute to finish in).
    ``own_weights[i]`` / ``own_biases[i]``, where present, map it to logits (sigmoid: chance of
    use) of layer i's own experts at the next token, for eviction."""

    def __init__(self, weights: Optional[dict] = None, biases: Optional[dict] = None, scores: Optional[dict] = None,
                 weights2: Optional[dict] = None, biases2: Optional[dict] = None, own_weights: Optional[dict] = None,
                 own_biases: Optional[dict] = None, hidden_layers: Optional[dict] = None, token_table=None):
        # layer -> (w1 [hidden, H], b1): the ReLU layer its maps read instead of the router input
        self.hidden_layers = dict(hidden_layers or {})
        self.weights = dict(weights or {})
        self.biases = dict(biases or {})
        self.weights2 = dict(weights2 or {})
        self.biases2 = dict(biases2 or {})
        self.own_weights = dict(own_weights or {})
        self.own_biases = dict(own_biases or {})
        # layer -> {"learned": precision, "router": precision, "learned2": precision two layers
        # ahead} on held-out pairs (compare); the first layer's "table": the token table's
        self.scores = dict(scores or {})
        # moe.first_layer.TokenTable: the first MoE layer's experts per input token (on the host)
        self.token_table = token_table

    @classmethod
    def fit(cls, inputs: list, routed: list, num_experts: int, ridge: float = RIDGE,
            seq: Optional[int] = None, hidden: Optional[int] = None) -> "LookaheadPredictor":
        """``inputs[i]``: [N, H] router inputs of MoE layer i; ``routed[i]``: [N, k] its routed ids
        (the same N tokens at every layer). Fits layer i -> layer i + 1 for every layer but the
        last, and layer i -> layer i + 2 for every layer but the last two. With ``seq`` (the N
        tokens are N / seq sequences of ``seq`` consecutive tokens) also the last layer -> the
        first layer of the next token (``weights[last]``: the guess of the next decode step's first
        MoE layer, made at the end of this one), and every layer -> its own experts at the next
        token (``own_weights``, ``fit_logistic``). With ``hidden``, each layer's maps read one ReLU
        layer of that width, fitted with them (``fit_hidden``)."""
        if hidden is not None and (not isinstance(hidden, int) or hidden < 1):
            raise ValueError(f"offtensor: LookaheadPredictor.fit(hidden=) is a layer width >= 1 (None: linear maps), "
                             f"got {hidden!r}")
        out = cls()
        if hidden:
            for i in range(len(inputs)):
                out._fit_hidden_layer(i, inputs, routed, num_experts, seq, hidden)
            return out
        for i in range(len(inputs) - (1 if seq is None else 0)):
            x, y = _pairs(inputs, routed, i, 1, seq)
            out.weights[i], out.biases[i] = fit_ridge(x, y, num_experts, ridge)
        for i in range(len(inputs) - 2):
            out.weights2[i], out.biases2[i] = fit_ridge(inputs[i], routed[i + 2], num_experts, ridge)
        if seq is not None:
            for i in range(len(inputs)):
                out.own_weights[i], out.own_biases[i] = fit_logistic(*_next_token(inputs[i], routed[i], seq), num_experts)
        return out

    def _fit_hidden_layer(self, i: int, inputs: list, routed: list, num_experts: int, seq, hidden: int) -> None:
        """``fit``'s maps of layer i with a hidden layer: the next layer's experts (the last layer's:
        the next token's first layer, with ``seq``), the layer after's, its own at the next token."""
        heads, into = [], []
        if i + 1 < len(inputs):
            heads.append((routed[i + 1], None, "guess"))
            into.append((self.weights, self.biases))
        elif seq is not None:
            heads.append((*_shifted(routed[0], seq), "guess"))
            into.append((self.weights, self.biases))
        if i + 2 < len(inputs):
            heads.append((routed[i + 2], None, "guess"))
            into.append((self.weights2, self.biases2))
        if seq is not None:
            heads.append((*_shifted(routed[i], seq), "chance"))
            into.append((self.own_weights, self.own_biases))
        if not heads:
            return
        self.hidden_layers[i], maps = fit_hidden(inputs[i], heads, num_experts, hidden)
        for (weights, biases), (w, b) in zip(into, maps):
            weights[i], biases[i] = w, b

    def features(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """What layer ``layer``'s maps read: its router input, or its hidden layer on it."""
        first = self.hidden_layers.get(layer)
        return x if first is None else hidden_layer(x.reshape(-1, x.shape[-1]).to(first[0].dtype), *first)

    def logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        return _apply(self.weights[layer], self.biases[layer], self.features(layer, x))

    def logits2(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Logits of the experts of MoE layer ``layer + 2`` from layer ``layer``'s router input."""
        return _apply(self.weights2[layer], self.biases2[layer], self.features(layer, x))

    def own_logits(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Logits (sigmoid: chance of use) of MoE layer ``layer``'s experts at the next token."""
        return _apply(self.own_weights[layer], self.own_biases[layer], self.features(layer, x))

    def compare(self, inputs: list, routed: list, router_ahead: list, seq: Optional[int] = None) -> dict:
        """Top-k precision on held-out pairs, per layer: the learned map's and the router
        look-ahead's (``router_ahead[i]``: [N, E] scores of layer i + 1's router on layer i's
        input; for the last layer, with ``seq`` as in ``fit``, the first layer's router on it);
        with ``seq``, the next-token map's (``own``) and the previous token's experts' (``reuse``:
        what eviction ranks by without it) against the next token's. Kept in ``scores``."""
        for i in sorted(self.weights):
            x, y = _pairs(inputs, routed, i, 1, seq)
            ahead = router_ahead[i] if i < len(router_ahead) else None  # (none given: the router's is 0)
            if ahead is not None and i == len(inputs) - 1:  # the next token's: drop each sequence's last
                ahead = ahead.view(-1, seq, ahead.shape[-1])[:, :-1].reshape(x.shape[0], -1)
            self.scores[i] = {"learned": top_k_precision(self.logits(i, x), y),
                              "router": 0.0 if ahead is None else top_k_precision(ahead, y)}
            if i in self.weights2:
                self.scores[i]["learned2"] = top_k_precision(self.logits2(i, inputs[i]), routed[i + 2])
        for i in sorted(self.own_weights):
            if seq is None:
                break
            x, y = _next_token(inputs[i], routed[i], seq)
            prev = _next_token(routed[i], routed[i], seq)[0]
            # The previous token's experts, ties broken by a fixed random order (reuse alone names k).
            reuse = one_hot(prev, self.own_weights[i].shape[0]) + 1e-3 * torch.rand(
                prev.shape[0], self.own_weights[i].shape[0], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
            self.scores.setdefault(i, {}).update(own=top_k_precision(self.own_logits(i, x), y),
                                                 reuse=top_k_precision(reuse, y))
        return self.scores

    def keep(self, two_ahead_precision: float = TWO_AHEAD_PRECISION) -> list:
        """Drop the layers where the router look-ahead was right at least as often (``compare``),
        the two-ahead maps right less than ``two_ahead_precision`` of the time, and the next-token
        maps that do not rank better than the previous token's experts: the layers kept, which
        guess from the learned map."""
        for i, s in list(self.scores.items()):
            if s.get("own", 0.0) <= s.get("reuse", 0.0):
                self.own_weights.pop(i, None)
                self.own_biases.pop(i, None)
            if "learned" not in s:
                continue
            if s["learned"] <= s["router"]:
                self.weights.pop(i, None)
                self.biases.pop(i, None)
            if s.get("learned2", 0.0) < two_ahead_precision:
                self.weights2.pop(i, None)
                self.biases2.pop(i, None)
        for i in list(self.hidden_layers):
            if i not in self.weights:  # (installed only with its next layer's map: ``install``)
                del self.hidden_layers[i]
        return sorted(self.weights)

    # ------------------------------------------------------------------ files

    def save(self, directory: str) -> str:
        from safetensors.torch import save_file

        path = os.path.join(directory, FILE_NAME) if os.path.isdir(directory) else directory
        tensors = {f"weight.{i}": w for i, w in self.weights.items()} | {f"bias.{i}": b for i, b in self.biases.items()}
        tensors |= {f"weight2.{i}": w for i, w in self.weights2.items()}
        tensors |= {f"bias2.{i}": b for i, b in self.biases2.items()}
        tensors |= {f"own_weight.{i}": w for i, w in self.own_weights.items()}
        tensors |= {f"own_bias.{i}": b for i, b in self.own_biases.items()}
        tensors |= {f"hidden_weight.{i}": w for i, (w, _) in self.hidden_layers.items()}
        tensors |= {f"hidden_bias.{i}": b for i, (_, b) in self.hidden_layers.items()}
        if self.token_table is not None:
            tensors |= {"first_experts.0": self.token_table.experts, "first_chances.0": self.token_table.chances}
        save_file(tensors, path, metadata={"scores": json.dumps({str(k): v for k, v in self.scores.items()})})
        return path

    def installed_bytes(self, layers: int) -> int:
        """Bytes ``install`` puts on the device for a model of ``layers`` MoE layers (taken from its
        budget): room to add to ``budget_gb`` to keep the expert cache's room as it was without it."""
        return _bytes_of(_installed_maps(self, i, layers) for i in range(layers))

    @classmethod
    def load(cls, directory: str) -> "LookaheadPredictor":
        """The look-ahead ``save`` wrote, its header checked as the loader checks a checkpoint's and
        its tensors read, not memory-mapped (``safetensors_files.tensors``): a damaged file is an
        error naming it, never a crash."""
        path = os.path.join(directory, FILE_NAME) if os.path.isdir(directory) else directory
        maps = {"weight": {}, "bias": {}, "weight2": {}, "bias2": {}, "own_weight": {}, "own_bias": {},
                "hidden_weight": {}, "hidden_bias": {}, "first_experts": {}, "first_chances": {}}
        entries, meta = read_header_and_metadata(path)
        for name, tensor in tensors(entries):
            kind, _, layer = name.partition(".")
            if kind not in maps or not (layer.isascii() and layer.isdigit() and len(layer) < 10):
                raise ValueError(f"offtensor: {path}: unknown tensor {name!r} in a look-ahead file")
            maps[kind][int(layer)] = tensor
        try:
            scores = {int(k): v for k, v in json.loads(meta.get("scores", "{}")).items()}
        except (ValueError, TypeError, AttributeError, RecursionError) as e:
            raise ValueError(f"offtensor: {path}: its scores metadata is not a JSON map of layers to scores ({e})") from None
        if maps["hidden_weight"].keys() != maps["hidden_bias"].keys():
            raise ValueError(f"offtensor: {path}: hidden layers {sorted(maps['hidden_weight'])} have biases for "
                             f"{sorted(maps['hidden_bias'])}")
        hidden = {i: (w, maps["hidden_bias"][i]) for i, w in maps["hidden_weight"].items()}
        table = None
        if maps["first_experts"] or maps["first_chances"]:
            table = TokenTable(maps["first_experts"].get(0, torch.empty(0)), maps["first_chances"].get(0, torch.empty(0)))
        return cls(maps["weight"], maps["bias"], scores, maps["weight2"], maps["bias2"], maps["own_weight"],
                   maps["own_bias"], hidden, table)


def install(pager, predictor: LookaheadPredictor, device=None) -> list:
    """Hand ``predictor`` to the speculator of a wrapped model's ``pager``: the MoE routers, in
    firing order, guess the next layer from the learned map where it has one, and where that
    layer also has a next-token map, tell eviction their own experts' chances at the next token
    (rows of the same matmul). Returns the names of the routers that guess from it.

    The maps on the pager's device come out of its budget (the maps they replace go back to it),
    and cached copies make room first. Raises, changing nothing, ``ValueError`` where the maps'
    shapes do not fit the routers (``_check_shapes``) and ``BudgetError`` where what is left would
    not hold the model's largest op (its placement's working set)."""
    stacks = getattr(pager, "experts", None)
    speculator = getattr(stacks, "speculator", None)
    if speculator is None:
        raise ValueError("offtensor: install(predictor): this pager has no routing speculator (no offloaded "
                         "expert stacks, or prefetch=False)")
    from .guesses import SPECULATE_EVIDENCE, SPECULATE_EVIDENCE_LEARNED

    routers = [r for r in speculator.routers if r.stacks]
    maps = {i: _installed_maps(predictor, i, len(routers)) for i in range(len(routers))}
    for i, m in maps.items():
        if m is not None:
            _check_shapes(routers, i, *m)
    target = torch.device(device) if device is not None else pager.device
    counted = target == pager.device and pager.budget_bytes is not None
    nbytes = _bytes_of(maps.values()) if counted else 0
    # What the budget holds for maps now: its account, not ``stacks.lookahead``, which an install
    # cut short may not have recorded.
    grow = nbytes - pager.held_outside(LOOKAHEAD_ACCOUNT)
    if grow > 0:  # taken before the maps are allocated (BudgetError, nothing changed, where they do not fit)
        _check_room(pager, stacks, nbytes, grow)
        pager.hold_outside(LOOKAHEAD_ACCOUNT, nbytes)
        stacks.lookahead = (predictor, device, nbytes)
    stacks.eviction.next_turn.clear()  # made by the maps being replaced
    for router in routers:  # the maps being replaced go first: the new ones take their memory
        router.lookahead = router.split = router.own = None
    speculator.token_table = predictor.token_table  # (on the host: nothing of the budget)
    names = []
    for i, router in enumerate(routers):
        if len(routers) > 1:  # the layer it guesses (the last: the next step's first), measured held out
            learned = maps[i] is not None
            routers[(i + 1) % len(routers)].evidence = SPECULATE_EVIDENCE_LEARNED if learned else SPECULATE_EVIDENCE
        if maps[i] is None:
            continue  # (a next-token map alone would be a kernel of its own: not installed)
        router.split, router.own, tensors = maps[i]
        router.lookahead = tuple(t.to(target) for t in tensors)
        names.append(router.name)
    if predictor.token_table is not None:
        routers[0].evidence = SPECULATE_EVIDENCE_LEARNED  # the first layer, guessed from the step's tokens
    if grow <= 0:  # given back once the maps that held it have gone
        pager.hold_outside(LOOKAHEAD_ACCOUNT, nbytes)
        stacks.lookahead = (predictor, device, nbytes)
    return names


def reinstall(pager, lookahead) -> None:
    """Install ``lookahead`` (``ExpertStacks.lookahead``: the predictor, the device it was given)
    for the stacks registered anew with ``pager``; a warning, not an error, where that cannot be."""
    try:
        install(pager, *lookahead[:2])
    except (BudgetError, ValueError) as e:
        warnings.warn(f"{e} The expert stacks were registered again; the learned look-ahead was not re-installed.",
                      RuntimeWarning, stacklevel=3)


def _installed_maps(predictor: LookaheadPredictor, i: int, layers: int):
    """Router ``i``'s maps as installed (``split``, ``own``, its tensors: the weight and bias of one
    matmul, then the hidden layer's where it has one), or None without a learned map."""
    w, b = predictor.weights.get(i), predictor.biases.get(i)
    if w is None:
        return None
    rows, extra, split, own = w.shape[0], [], None, None
    if i in predictor.weights2 and i + 2 < layers:
        # One matmul for every map: the rows from ``split`` on guess two layers ahead, those
        # from ``own`` on are this layer's experts at the next token.
        split = rows
        extra.append((predictor.weights2[i], predictor.biases2[i]))
        rows += predictor.weights2[i].shape[0]
    if i in predictor.own_weights:
        own = rows
        extra.append((predictor.own_weights[i], predictor.own_biases[i]))
    if extra:
        w = torch.cat([w] + [m for m, _ in extra])
        b = torch.cat([b] + [v for _, v in extra])
    tensors = (w, b)
    if i in predictor.hidden_layers:  # its maps read a hidden layer: two kernels more
        tensors += tuple(predictor.hidden_layers[i])
    return split, own, tensors


def _bytes_of(maps) -> int:
    """Bytes of ``_installed_maps``' tensors over ``maps`` (None: a router without a learned map)."""
    return sum(t.numel() * t.element_size() for m in maps if m is not None for t in m[2])


def _check_shapes(routers: list, i: int, split, own, tensors) -> None:
    """Router ``i``'s maps read its router's input and score the experts of the layers they guess:
    a ValueError naming the layer and the shapes where they do not (a look-ahead file of another
    model), before anything is installed."""
    n = len(routers)
    experts = [routers[(i + 1) % n].stacks[0].num_experts]
    if split is not None:
        experts.append(routers[(i + 2) % n].stacks[0].num_experts)
    if own is not None:
        experts.append(routers[i].stacks[0].num_experts)
    weight = getattr(routers[i].module_ref(), "weight", None)
    width = weight.shape[-1] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None
    w, b, *hidden = tensors
    shapes = "[" + ", ".join(shape_text(t.shape) for t in tensors) + "]"
    reads = hidden[0].shape[-1] if hidden else w.shape[-1]
    ok = w.dim() == 2 and w.shape[0] == sum(experts) and tuple(b.shape) == (sum(experts),) \
        and (width is None or reads == width) \
        and (not hidden or (hidden[0].dim() == 2 and tuple(hidden[1].shape) == (hidden[0].shape[0],)
                            and w.shape[-1] == hidden[0].shape[0]))
    if not ok:
        raise ValueError(
            f"offtensor: install(predictor): the learned look-ahead of MoE layer {i} ({routers[i].name}) has "
            f"tensors of shapes {shapes}, but that layer's router reads inputs of width {width} and its maps "
            f"score {' + '.join(map(str, experts))} experts (a look-ahead fitted for another model?)")


def _check_room(pager, stacks, nbytes: int, grow: int) -> None:
    """BudgetError where ``grow`` bytes more of maps (``nbytes`` in all) leave the budget no room for
    the model's largest op."""
    need = stacks.room_needed() if stacks.room_needed is not None else 0
    left = pager.budget_bytes - pager.resident_bytes - grow
    if left < need:
        raise BudgetError(
            f"offtensor: the learned look-ahead's maps need {nbytes} bytes on {pager.device} (the installed "
            f"ones {nbytes - grow}), but the budget of {pager.budget_bytes} bytes holds "
            f"{pager.resident_bytes} bytes of resident weights and must keep {need} bytes for the largest "
            f"paged op, leaving {max(left + grow - need, 0)} bytes for the {grow} bytes more that these maps "
            f"take. Raise budget_gb or offload more weights.")
