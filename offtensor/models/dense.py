"""A stack of dense MLP layers, ``x @ w1 @ w2`` per layer: the workload the H200 figures of
docs/benchmarks.md were measured on (24 layers, 8192 x 24576, bf16, 805 MB a layer), written as plain PyTorch. Build it
under ``torch.device("meta")`` to plan it without its 19.3 GB (``ot.plan``)."""

from __future__ import annotations

import torch
from torch import nn


class DenseLayer(nn.Module):
    def __init__(self, hidden: int, ffn: int, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(hidden, ffn, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(ffn, hidden, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x):
        return x @ self.w1 @ self.w2


class DenseStack(nn.Module):
    def __init__(self, layers: int = 24, hidden: int = 8192, ffn: int = 24576, dtype=torch.bfloat16, device=None):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(hidden, ffn, dtype, device) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def layer_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.layers[0].parameters())
