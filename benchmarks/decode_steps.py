"""The one greedy decode loop of the decode benchmarks (cuda_graph_decode.py, pool_graph_decode.py)
and the one capture of a decode step as a CUDA graph, so every variant they compare is timed alike."""

from __future__ import annotations

import time

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode(step, start: torch.Tensor, tokens: int, device: torch.device, warmup: int = 0):
    """``tokens`` greedy steps from ``start`` (``step(token) -> logits``), after ``warmup`` untimed
    steps from it: (the tokens, seconds per token)."""
    with torch.no_grad():
        for _ in range(warmup):
            step(start)
        token, out = start, []
        sync(device)
        began = time.perf_counter()
        for _ in range(tokens):
            token = step(token).argmax(-1)
            out.append(token)
        sync(device)
    return torch.cat(out, -1), (time.perf_counter() - began) / tokens


def graphed(step, start: torch.Tensor, device: torch.device, counter=None):
    """``step`` captured once as a CUDA graph (after two warm-up calls on a side stream): a callable
    with its signature, and how much ``counter()`` grew during the capture (None without one: e.g.
    the bytes a replay copies, which replays run no Python to count)."""
    with torch.no_grad():
        static_token = start.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step(static_token)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        before = counter() if counter is not None else None
        with torch.cuda.graph(graph):
            static_logits = step(static_token)
        grown = counter() - before if counter is not None else None

    def replay(token):
        static_token.copy_(token)
        graph.replay()
        return static_logits

    return replay, grown
