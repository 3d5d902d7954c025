"""Experts chosen one by one, on meta: the routing reads of an MoE layer that loops over its
routed experts (``for e in selected.unique().tolist(): torch.where(selected == e)``, as the
reference DeepSeek models and vLLM-style layers do, or transformers' eager experts:
``expert_mask.sum(...).nonzero()``) answered from the planned routing while ``ot.plan`` replays.

A grouped GEMM's routing on meta is drawn in ``ops.planned``; a layer that selects its experts one
by one reads its routing on the host instead (``unique``, ``nonzero``, ``bincount``, or the ids
themselves: ``selected.tolist()``), which a meta tensor cannot answer. Inside an MoE block (the
module holding an ``experts`` module with stacked expert weights) ``PlannedSelection`` draws the
layer's routing from the same ``planned_ends`` (the plan's measured routing, or distinct experts
drawn uniformly) and answers those reads from it: the distinct experts as host values, each
expert's routed rows as a meta tensor of their count, in the order the layer asks for them, each
token's experts where it reads the ids. Outside MoE blocks nothing is answered: a read of values
on meta fails there as it would without a plan. Each read is a host sync on a GPU and is recorded
as one."""

from __future__ import annotations

import threading
from typing import Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..moe import is_routed_stack
from ..ops.planned import planned_ends
from ..ops.rows import host_sync

aten = torch.ops.aten
_UNIQUE = {aten._unique2.default, aten._unique.default}
_READS = _UNIQUE | {aten.nonzero.default, aten.bincount.default, aten._to_copy.default}


def moe_blocks(model: nn.Module) -> dict:
    """MoE block -> its experts' count: the parent of each module holding a stack of routed experts
    (``routing.is_routed_stack``: 3 dims or more under an ``experts`` module)."""
    blocks = {}
    for name, module in model.named_modules():
        if name.rpartition(".")[2] != "experts":
            continue
        sizes = [t.shape[0] for stack, t in module.named_parameters(recurse=False)
                 if is_routed_stack(f"{name}.{stack}", t.shape)]
        if sizes:
            blocks[model.get_submodule(name.rpartition(".")[0])] = max(sizes)
    return blocks


class _Layer:
    """The planned routing of one MoE block's call: rows routed per expert, drawn at its first read."""

    __slots__ = ("experts", "rows", "counts", "chosen", "next")

    def __init__(self, experts: int, rows: int):
        self.experts, self.rows = experts, rows
        self.counts: Optional[list] = None  # rows routed to each expert
        self.chosen: list = []  # experts with routed rows, ascending
        self.next = 0  # the next of them whose rows a nonzero asks for

    def draw(self, rows: Optional[int] = None) -> None:
        if self.counts is None:
            ends = planned_ends(self.experts, max(rows if rows is not None else self.rows, 1))
            self.counts = [b - a for a, b in zip([0] + ends[:-1], ends)]
            self.chosen = [e for e, n in enumerate(self.counts) if n]

    def selected(self, shape) -> torch.Tensor:
        """The routing itself, each token's experts (``shape``: [tokens, top_k]), on the host: the
        chosen experts' rows in order, slot by slot (a token's slots name distinct experts where
        no expert has more rows than there are tokens, as routing never gives one)."""
        self.draw(shape.numel())
        order = [e for e in self.chosen for _ in range(self.counts[e])]
        k = shape[-1] if len(shape) else 1
        return torch.tensor(order, dtype=torch.int64).reshape(k, -1).t().reshape(shape)

    def rows_of_next(self) -> int:
        """Rows of the next chosen expert, in the order the layer loops over them (0 past the last)."""
        self.draw()
        if self.next >= len(self.chosen):
            return 0
        self.next += 1
        return self.counts[self.chosen[self.next - 1]]


class PlannedSelection(TorchDispatchMode):
    """While entered, the host reads of routing inside ``model``'s MoE blocks on meta are answered
    from the planned routing (see the module docstring); ``top_k`` tokens' rows a token. Entered
    outside the plan's recorder, which then records each read as an op before it gets here."""

    def __init__(self, model: nn.Module, top_k: Optional[int], pager=None):
        super().__init__()
        self.blocks = moe_blocks(model)
        self.top_k = top_k or 1
        self.pager = pager
        self._local = threading.local()  # .layers: the MoE blocks running now, innermost last
        self._hooks = []

    def __enter__(self):
        if not self.blocks:
            return self  # a dense model: no op of it is looked at
        try:
            for block, experts in self.blocks.items():
                self._hooks.append(block.register_forward_pre_hook(self._enter_block(experts)))
                self._hooks.append(block.register_forward_hook(self._leave_block))
            return super().__enter__()
        except BaseException:  # (an interrupt before the with statement holds it: no hook left behind)
            self._remove_hooks()
            raise

    def __exit__(self, *exc):
        if not self.blocks:
            return None
        self._remove_hooks()
        self._local.layers = []
        return super().__exit__(*exc)

    def _remove_hooks(self) -> None:
        while self._hooks:
            self._hooks.pop().remove()

    def _enter_block(self, experts: int):
        def hook(module, args):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            tokens = x.numel() // max(x.shape[-1], 1) if x is not None and x.dim() else 1
            self._layers().append(_Layer(experts, tokens * self.top_k))
        return hook

    def _leave_block(self, module, args, output):
        layers = self._layers()
        if layers:
            layers.pop()

    def _layers(self) -> list:
        layers = getattr(self._local, "layers", None)
        if layers is None:
            layers = self._local.layers = []
        return layers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        layers = self._layers()
        if func not in _READS or not layers or not isinstance(args[0], torch.Tensor) or not args[0].is_meta:
            return func(*args, **kwargs)
        layer, x = layers[-1], args[0]
        if func is aten._to_copy.default and not _routing_to_host(layer, x, kwargs):
            return func(*args, **kwargs)
        host_sync(self.pager)  # a GPU reads the routing here
        if func is aten._to_copy.default:
            return layer.selected(x.shape).to(kwargs.get("dtype") or x.dtype)
        if func in _UNIQUE:
            return self._unique(func, layer, x, args, kwargs)
        if func is aten.bincount.default:
            layer.draw(x.numel())
            length = max(kwargs.get("minlength", args[2] if len(args) > 2 else 0) or 0, layer.experts)
            return torch.tensor(layer.counts + [0] * (length - layer.experts), dtype=torch.int64)
        if x.dim() == 1 and x.shape[0] in (layer.experts, layer.experts + 1):
            # Which experts have rows (transformers' eager experts: a mask summed per expert, one
            # more for the index that stands for no expert).
            layer.draw()
            return torch.tensor(layer.chosen, dtype=torch.int64).reshape(-1, 1)
        # The rows routed to the next expert the layer loops over (torch.where(selected == e)).
        return torch.empty((layer.rows_of_next(), x.dim()), dtype=torch.int64, device="meta")

    @staticmethod
    def _unique(func, layer: _Layer, x: torch.Tensor, args, kwargs):
        """The distinct experts of the layer's routing (``x``: its selected ids), on the host; an
        inverse on meta and the counts on the host where asked for."""
        layer.draw(x.numel())
        values = torch.tensor(layer.chosen, dtype=torch.int64)
        inverse = torch.empty(x.shape, dtype=torch.int64, device="meta")
        if func is aten._unique.default:
            return values, inverse
        flags = dict(zip(("sorted", "return_inverse", "return_counts"), args[1:]), **kwargs)
        counts = torch.tensor([layer.counts[e] for e in layer.chosen], dtype=torch.int64)
        return (values, inverse if flags.get("return_inverse") else inverse[:0],
                counts if flags.get("return_counts") else counts[:0])


def _routing_to_host(layer: _Layer, x: torch.Tensor, kwargs) -> bool:
    """Whether a copy of meta ``x`` is the layer's routing read on the host (``selected.tolist()``,
    ``.cpu()``): integer ids, one a routed row, to the host."""
    device = kwargs.get("device")
    return (device is not None and torch.device(device).type == "cpu" and not x.is_floating_point()
            and not x.is_complex() and x.dtype != torch.bool and x.numel() == layer.rows and x.dim() >= 1)
