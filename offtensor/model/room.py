"""The room a wrapped model's budget keeps for paging: reserved before a weight is offloaded after
wrapping, and planned again when resident weights grow (a weight the policy keeps, a cast)."""

from __future__ import annotations

import warnings

import torch

from .. import placement
from ..pager import BudgetError, covering_range
from ..tensor import OffloadedTensor
from .groups import collect_groups, tensor_bytes
from .state import State


def reserve_paging_room(state: State, full_name: str, t: torch.Tensor, resident: int, kind: str = "",
                         tileable: bool = True) -> None:
    """Before ``t`` is offloaded beside ``resident`` bytes of resident weights: make sure the budget
    can page it, whole or in tiles (ops compute linear, mm, bmm and conv ops on a weight larger
    than the room in output tiles), and reserve that working set. ``tileable=False``: a leaf of a
    wrapper subclass, read whole by the subclass's kernels (``placement.Weight.tileable``)."""
    pager = state.pager
    nbytes = tensor_bytes(t)  # offloading keeps an expanded tensor's stride-0 layout
    ws = placement.working_set(full_name, tuple(t.shape), nbytes)
    narrow = False
    for slices in (placement.TILE_ALIGN, 1) if tileable else ():  # bit-identical tiles first (see tile_working_set)
        if resident + max(ws, state.working_set_bytes) > pager.budget_bytes:
            ws = placement.tile_working_set(tuple(t.shape), nbytes, ws, slices)
            narrow = slices < placement.TILE_ALIGN
    if resident + max(ws, state.working_set_bytes) > pager.budget_bytes:
        raise BudgetError(
            f"offtensor: {kind}{full_name} ({nbytes} bytes) needs {ws} bytes on the device to be paged, but only "
            f"{pager.budget_bytes - resident} of the budget's {pager.budget_bytes} bytes are not resident "
            f"weights; raise budget_gb or offload more"
        )
    if narrow:  # the same fallback, and the same warning, as wrap-time placement's
        placement.warn_narrow_tiles(pager.budget_bytes, f"{kind}{full_name}", stacklevel=2)
    whole = placement.working_set(full_name, tuple(t.shape), nbytes)
    if tileable and ws < whole:
        placement.warn_inexact_tiles([placement.Weight([full_name], nbytes, tuple(t.shape), ws, dtype=t.dtype)],
                                     stacklevel=3)
    state.working_set_bytes = max(state.working_set_bytes, ws)


def replan_paging_room(state: State, resident: int, why: str) -> None:
    """Resident weights grow to ``resident`` bytes and leave less room than the paging planned for
    (a weight the policy keeps, a cast that the policy keeps resident): plan the room again, each
    offloaded weight whole if it fits, else in tiles as placement would have chosen at that room,
    so ``working_set_bytes`` says what paging needs now. Raises a BudgetError, before anything
    changes, if some offloaded weight cannot be paged in the room left even one slice at a time."""
    pager, model = state.pager, state.model_ref()
    room = pager.budget_bytes - resident
    need, narrow = 0, None
    for group in collect_groups(model) if model is not None else ():
        if not group.is_offloaded:
            continue
        w = group.weight()
        ws = w.working_set
        for slices in (placement.TILE_ALIGN, 1):
            if ws > room:
                ws = placement.tile_working_set(w.shape, w.nbytes, ws, slices)
                narrow = w.name if slices < placement.TILE_ALIGN and narrow is None else narrow
        if ws > room:
            raise BudgetError(
                f"offtensor: {why} leaves {max(room, 0)} of the budget's {pager.budget_bytes} bytes for paging, but the "
                f"offloaded '{w.name}' ({w.nbytes} bytes) needs {ws} bytes on the device at once even one slice at a "
                f"time; raise budget_gb or let the policy offload more"
            )
        need = max(need, ws)
    if narrow is not None:
        placement.warn_narrow_tiles(pager.budget_bytes, f"'{narrow}'", stacklevel=3)
    state.working_set_bytes = need


def warn_view_of_a_bigger_master(full_name: str, t: OffloadedTensor) -> None:
    """``t``, assigned as ``full_name``, is a view of an offloaded weight whose host master holds
    more than it covers (a shard taken after wrapping: quantise -> wrap -> shard): the master
    stays whole, so this process keeps every byte of it. Say so, naming the weight and the bytes."""
    lo, hi = covering_range(t._host)
    covered = (hi - lo) * t._host.element_size()
    if covered < t._master.nbytes:
        warnings.warn(
            f"offtensor: {full_name} is assigned a view of {t._host.numel() * t._host.element_size()} bytes (paging "
            f"covers {covered}) of an offloaded host master of "
            f"{t._master.nbytes} bytes (a shard or slice taken of a weight that was already offloaded); the master "
            f"stays whole, so host memory keeps all {t._master.nbytes} bytes. To hold only the shard, shard (or "
            f"parallelize) first and call ot.wrap_model afterwards, on each rank.", UserWarning, stacklevel=5)
