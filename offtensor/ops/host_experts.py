"""Routed experts computed where they live (``expert_compute="host"`` / ``"auto"``): which experts of
an op run from their host masters instead of being copied, and that host compute itself.

An expert that is cached on the device (or being copied there) runs on the device. One that is not
runs on the host when the model's ``expert_compute`` says so ("host"; "auto" where the wrap-time
replay chose the host for this layer and this many routed rows), unless the budget has unclaimed
room for it: then it is copied as under "device", since that copy evicts nothing (a prefill fills
the room, a decode then finds its cache full). For a host expert its tokens' activations are copied
to host memory, the expert's GEMMs run on the host master's own view (no weight byte is copied)
and the result is copied back; the op's device experts are issued first, so the device computes
them while the host computes the rest.
"""

from __future__ import annotations

import torch

from ..tensor import OffloadedTensor
from .tiling import as_linear_weight


def _stack(pager, master_id: int):
    """The expert stack of ``master_id`` when its model computes uncached experts off the device."""
    experts = pager.experts
    if experts is None or experts.compute == "device":
        return None, None
    return experts, experts.by_master.get(master_id)


def host_chosen(experts, stack, rows: int) -> bool:
    """Whether ``stack``'s layer computes an uncached expert of ``rows`` routed rows on the host:
    always under "host"; under "auto" what the replay chose for that many rows of one expert
    (``expert_compute_choice``: group -> ((most rows, on the host), ...), in increasing rows)."""
    if experts.compute == "host":
        return True
    table = (experts.compute_choice or {}).get(stack.group)
    if not table:
        return False
    for most, on_host in table:
        if rows <= most:
            return on_host
    return table[-1][1]


def split_groups(weight: OffloadedTensor, groups: list):
    """(device groups, host groups) of a grouped GEMM's (expert, start, end) groups."""
    pager = weight._master.pager
    experts, stack = _stack(pager, weight._master.id)
    if stack is None or not groups or pager.budget_bytes is None:
        return groups, []
    device, host = [], []
    budget = pager.budget
    claimed = 0
    for group in groups:
        e, start, end = group
        if pager.is_cached(stack.key_of(e)) or not host_chosen(experts, stack, end - start):
            device.append(group)
        elif budget.fits(claimed + stack.expert_bytes):
            claimed += stack.expert_bytes  # unclaimed room: the copy evicts nothing
            device.append(group)
        else:
            host.append(group)
    return device, host


def expert_on_host(weight: OffloadedTensor, rows: int):
    """For ``F.linear(x, stack[e])`` of a model that selects experts one by one: the expert index
    when that expert is to be computed on the host, else None."""
    pager = weight._master.pager
    experts, stack = _stack(pager, weight._master.id)
    if stack is None or pager.budget_bytes is None:
        return None
    host = weight._host
    step = stack.expert_bytes // host.element_size()
    first = (host.storage_offset() - stack.base) // step
    if host.dtype != stack.dtype or not 0 <= first < stack.num_experts:
        return None
    key = stack.key_of(first)
    span = sum((n - 1) * s for n, s in zip(host.shape, host.stride()) if n)
    if host.storage_offset() + span >= key[3]:
        return None  # more than one expert: left to the device path
    if pager.is_cached(key) or not host_chosen(experts, stack, rows):
        return None
    if pager.budget.fits(stack.expert_bytes):
        return None  # unclaimed room: copied, evicting nothing
    return first


def to_host(x: torch.Tensor, pager) -> torch.Tensor:
    """A host copy of the device activations ``x`` (pinned on a GPU, so the result's way back is async)."""
    out = torch.empty(x.shape, dtype=x.dtype, device="cpu", pin_memory=pager.device.type == "cuda")
    out.copy_(x)
    return out


def to_device(y: torch.Tensor, pager) -> torch.Tensor:
    """``y`` (a host result) copied back to the device."""
    if pager.device.type == "cuda":
        y = y.pin_memory()
    out = torch.empty(y.shape, dtype=y.dtype, device=pager.device)
    out.copy_(y, non_blocking=True)
    return out


def computed(pager, host_in: torch.Tensor, host_out: torch.Tensor, weight_bytes: int, flops: int) -> None:
    """One expert computed on the host: counted, and recorded on the timeline's host lane."""
    moved = host_in.numel() * host_in.element_size() + host_out.numel() * host_out.element_size()
    pager.count_host_compute(moved)
    recorder = pager.recorder
    if recorder is not None:
        recorder.host_computed(flops, weight_bytes, str(host_out.dtype).removeprefix("torch."), moved)


def host_linear(x: torch.Tensor, weight: OffloadedTensor, bias) -> torch.Tensor:
    """``F.linear(x, weight)`` of one expert of a stack, computed from its host master."""
    recorder = weight._master.pager.recorder
    if recorder is not None:  # the host's own ops are not device ops: recorded as one host-lane record
        return recorder.quiet(_host_linear)(x, weight, bias)
    return _host_linear(x, weight, bias)


def _host_linear(x: torch.Tensor, weight: OffloadedTensor, bias) -> torch.Tensor:
    pager = weight._master.pager
    host_bias = None
    if bias is not None:
        host_bias = bias._host if isinstance(bias, OffloadedTensor) else to_host(bias, pager)
    host_x = to_host(x, pager)
    host = weight._host
    y = torch._C._nn.linear(host_x, as_linear_weight(host_x, weight, host), host_bias)
    computed(pager, host_x, y, host.numel() * host.element_size(), 2 * y.numel() * host_x.shape[-1])
    return to_device(y, pager)


def host_grouped(func, x: torch.Tensor, weight: OffloadedTensor, bias, out_dtype, offs_dtype, groups: list) -> dict:
    """A function giving expert -> device result of a grouped GEMM's ``groups`` computed on the host, one
    ``_grouped_mm`` (or transformers' fallback: ``out_dtype`` None) of one group each on the host
    master's view, the same call the device would run on its copy. The activations of every group
    are copied to the host first, before the caller issues its device experts, so that copy waits
    for nothing the device still has to compute."""
    pager = weight._master.pager
    host_x = [to_host(x[start:end], pager) for _, start, end in groups]
    host_bias = None
    if bias is not None:
        host_bias = bias._host if isinstance(bias, OffloadedTensor) else to_host(bias, pager)

    def run_all():
        out = {}
        for (e, start, end), xe in zip(groups, host_x):
            size = torch.tensor([end - start], dtype=offs_dtype)
            expert = weight._host[e : e + 1]
            if out_dtype is False:
                y = func(xe, expert, size)
            else:
                y = func(xe, expert, size, None if host_bias is None else host_bias[e : e + 1], out_dtype)
            computed(pager, xe, y, expert.numel() * expert.element_size(), 2 * y.numel() * xe.shape[-1])
            out[e] = to_device(y, pager)
        return out

    return run_all
