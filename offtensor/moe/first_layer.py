"""The first MoE layer's experts guessed from a step's input tokens.

Nothing within a step runs before the first MoE layer to guess it from, and a guess made at the
end of the step before (the last layer's next-token map) must predict the next token first: on the
trained test models it names the first layer's experts 0.62-0.63 of the time. Once a decode step's
token is known, its first layer's routing depends mostly on it: the router reads the token's
embedding plus one attention layer's output. A table of each token's likeliest experts at the first
MoE layer, counted from recorded routing, names them 0.83-0.92 of the time on the same models'
held-out text; the guess costs a row lookup on the host and no kernel. Its copies start when the
step's embedding runs, ahead of the first layer's attention and router (the input embeddings'
forward pre-hook: ``hooks.attach``; the copies are ``speculation.RoutingSpeculator.guess_first``'s).

The token ids are read on the host only where that waits for nothing: ids on the host, or on a GPU
whose stream has finished its work (a decode loop reads its sampled token before the next step, so
the stream is idle then); otherwise the step is not guessed.
"""

from __future__ import annotations

from typing import Optional

import torch

# Each token keeps this many times the top-k of its likeliest experts (the guess copies fewer: the
# confidence gate and SPECULATE_EXPERTS decide).
KEEP_PER_TOP_K = 2
# At most this many tokens' pairs are kept read (``TokenTable.guess``).
KEEP_TOKENS = 1 << 16


class TokenTable:
    """Per token id, the first MoE layer's likeliest experts and the share of the token's recorded
    occurrences routed to each: ``experts`` [V, m] (int32), ``chances`` [V, m] (float32, 0 where a
    token was never seen or has fewer than m experts)."""

    __slots__ = ("experts", "chances", "_rows")

    def __init__(self, experts: torch.Tensor, chances: torch.Tensor):
        if experts.shape != chances.shape or experts.dim() != 2:
            raise ValueError(f"offtensor: TokenTable: experts {tuple(experts.shape)} and chances "
                             f"{tuple(chances.shape)} must be the same [vocab, m] shape")
        self.experts, self.chances = experts.to(torch.int32).cpu(), chances.float().cpu()
        # The pairs of the tokens guessed so far, read from the tables once (two row reads and two
        # conversions a token were most of a step's first-layer guess): (experts, chances, their
        # versions, vocab, token -> its pairs), made anew when either table is replaced or written.
        self._rows = None

    @classmethod
    def fit(cls, ids: torch.Tensor, routed: torch.Tensor, num_experts: int, vocab: Optional[int] = None) -> "TokenTable":
        """Counted from ``ids`` [N] and the first MoE layer's routed experts ``routed`` [N, k] at
        those tokens; ``vocab``: the number of token ids (the largest seen + 1 by default)."""
        ids, routed = ids.reshape(-1).long(), routed.reshape(ids.numel(), -1).long()
        if ids.numel() == 0:
            raise ValueError("offtensor: TokenTable.fit needs recorded tokens, got none")
        vocab = int(ids.max()) + 1 if vocab is None else vocab
        if int(ids.max()) >= vocab or int(ids.min()) < 0:
            raise ValueError(f"offtensor: TokenTable.fit: token ids span {int(ids.min())}..{int(ids.max())}, "
                             f"outside a vocabulary of {vocab}")
        cells = (ids[:, None] * num_experts + routed).reshape(-1)
        counts = torch.bincount(cells, minlength=vocab * num_experts).view(vocab, num_experts).float()
        seen = torch.bincount(ids, minlength=vocab).clamp(min=1).float()
        m = min(num_experts, KEEP_PER_TOP_K * routed.shape[1])
        chances, experts = (counts / seen[:, None]).topk(m, dim=1)
        return cls(experts, chances)

    @property
    def vocab(self) -> int:
        return self.experts.shape[0]

    def guess(self, tokens: list) -> list:
        """(expert, chance) pairs of the given token ids' likeliest experts (none for a token out of
        range or never seen)."""
        experts, chances, rows = self.experts, self.chances, getattr(self, "_rows", None)  # (unset: a table pickled without it)
        if rows is None or rows[0] is not experts or rows[1] is not chances or rows[2] != _version(experts) \
                or rows[3] != _version(chances):
            rows = self._rows = (experts, chances, _version(experts), _version(chances), experts.shape[0], {})
        vocab, known = rows[4], rows[5]
        out = []
        for t in tokens:  # (a decode step's few rows)
            pairs = known.get(t) if type(t) is int else None
            if pairs is None:
                if not 0 <= t < vocab:
                    continue
                pairs = tuple((e, p) for e, p in zip(experts[t].tolist(), chances[t].tolist()) if p > 0.0)
                if type(t) is int:
                    if len(known) >= KEEP_TOKENS:
                        known.clear()  # (bounded: a long run over a large vocabulary starts again)
                    known[t] = pairs
            out.extend(pairs)
        return out

    def precision(self, ids: torch.Tensor, routed: torch.Tensor) -> float:
        """Top-k precision on ``ids`` and the first layer's ``routed`` [N, k] (held-out text): the
        share of the routed experts among each token's k likeliest (an unseen token's: none)."""
        ids, routed = ids.reshape(-1).long(), routed.reshape(ids.numel(), -1).long()
        k = routed.shape[1]
        inside, rows = ids < self.vocab, ids.clamp(max=self.vocab - 1)
        top, known = self.experts[rows, :k].long(), self.chances[rows, :k] > 0
        hit = ((top.unsqueeze(-1) == routed.unsqueeze(-2)) & known.unsqueeze(-1)).any(-2) & inside[:, None]
        return float(hit.float().mean())


def _version(t: torch.Tensor):
    """``t``'s count of in-place writes, or None for an inference tensor, which keeps none (a table
    counted under ``torch.inference_mode``: nothing here writes a table in place)."""
    return None if t.is_inference() else t._version


def input_embeddings(model) -> Optional[torch.nn.Module]:
    """The module that embeds ``model``'s input token ids (transformers' ``get_input_embeddings``), or None."""
    get = getattr(model, "get_input_embeddings", None)
    try:
        found = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    return found if isinstance(found, torch.nn.Module) else None


def host_tokens(ids) -> Optional[list]:
    """A decode step's token ids on the host, where reading them waits for no device work: ids on
    the host, or on a GPU whose current stream is idle; else None."""
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex():
        return None
    if ids.device.type == "cpu":
        return ids.reshape(-1).tolist()
    if ids.device.type == "cuda" and not torch.cuda.is_current_stream_capturing() \
            and torch.cuda.current_stream(ids.device).query():  # (a stream being captured is never read)
        return ids.reshape(-1).tolist()
    return None
