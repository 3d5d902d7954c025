"""Device-memory arithmetic of one pager: what the budget holds and what is left of it.

Three amounts share a budget: resident weights (plain device tensors the model keeps, counted by
the layer that places them, ``wrap``), copies of host masters paged onto the device (cached,
transient, in flight), and device memory the pager does not page into (the expert pools, the
learned look-ahead's maps), each under an account of its own (``hold_outside``), which is taken
out of ``budget_bytes`` itself: ``budget_bytes`` is what resident weights and paged copies may use,
``whole()`` the budget as given. The high-water mark of all three is ``stats.peak_device_bytes``.
The layers above change the resident count only through ``recount_resident`` / ``hold_resident``;
the pager moves ``paged_bytes``.
"""

from __future__ import annotations

import math
from typing import Optional

GiB = 1 << 30


class BudgetError(RuntimeError):
    """The budget cannot hold what an op needs at once."""


class Budget:
    """``budget_bytes`` (None: no budget, nothing cached) and the bytes counted against it."""

    __slots__ = ("budget_bytes", "resident_bytes", "paged_bytes", "offloaded_bytes", "outside", "outside_bytes", "stats")

    def __init__(self, budget_bytes: Optional[int], stats):
        self.budget_bytes = budget_bytes
        self.resident_bytes = 0  # plain weights on the device, as the placing layer counted them
        self.paged_bytes = 0  # copies of host masters on the device: cached, transient, in flight
        self.offloaded_bytes = 0  # bytes of the host masters this pager pages from
        self.outside = {}  # account -> bytes of the budget it holds outside paging (hold_outside)
        self.outside_bytes = 0  # their sum: device memory the budget limits as it does paged copies
        self.stats = stats  # the pager's live OffloadStats, whose peak_device_bytes is kept here

    # ------------------------------------------------------------------ the placing layer's calls

    def recount_resident(self, nbytes: int) -> None:
        """Resident weights now hold ``nbytes`` (a recount after placing, unwrapping or deleting
        weights); the peak is left alone, as a recount is no new allocation of paged copies."""
        self.resident_bytes = nbytes

    def hold_resident(self, nbytes: int) -> None:
        """Resident weights grew to ``nbytes`` (a weight moved onto the device): counted in the peak."""
        self.resident_bytes = nbytes
        self.note_peak()

    def hold_outside(self, account: str, nbytes: int) -> int:
        """``account`` (the expert pools, the look-ahead's maps) holds ``nbytes`` of the budget from
        now on, and what it held before comes back; returns the change (> 0: the budget shrank).

        A set, not a transfer: the account and the budget change by three stores with no point
        between them where Python raises a Ctrl-C, and a call repeated changes nothing. So a caller
        cut short anywhere (between taking the bytes and recording what holds them, say) is put
        right by setting the account again, and no byte is lost or counted twice."""
        outside = self.outside
        change = nbytes - outside.get(account, 0)
        budget = self.budget_bytes - change
        held = self.outside_bytes + change
        outside[account] = nbytes
        self.budget_bytes = budget
        self.outside_bytes = held
        return change

    # ------------------------------------------------------------------ the pager's

    def whole(self) -> Optional[int]:
        """The budget as given: what paging may use plus what the outside accounts hold."""
        return None if self.budget_bytes is None else self.budget_bytes + self.outside_bytes

    def room(self) -> int:
        """Bytes of copies the budget holds beside the resident weights (what the arena may hold)."""
        return max(0, self.budget_bytes - self.resident_bytes)

    def fits(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more copies fit now, without evicting anything."""
        return self.budget_bytes is None or self.resident_bytes + self.paged_bytes + nbytes <= self.budget_bytes

    def add_paged(self, nbytes: int) -> None:
        self.paged_bytes += nbytes
        self.note_peak()

    def note_peak(self) -> None:
        # What the whole budget limits: the pools' and maps' device bytes too, so that the peak is
        # comparable with the budget the user gave (``whole``) however those accounts changed.
        used = self.resident_bytes + self.paged_bytes + self.outside_bytes
        if used > self.stats.peak_device_bytes:
            self.stats.peak_device_bytes = used

    def shortfall_error(self, what: str, nbytes: int, in_use: int, device) -> BudgetError:
        """The error for an op whose ``nbytes`` do not fit beside the resident weights and the
        ``in_use`` bytes of copies the current op holds."""
        budget = self.budget_bytes
        return BudgetError(
            f"offtensor: paging {what} needs {nbytes} bytes on {device}, but the budget of {budget} bytes "
            f"holds {self.resident_bytes} bytes of resident weights and {in_use} bytes of copies that the "
            f"current op is using, leaving {budget - self.resident_bytes - in_use} bytes. "
            f"Raise budget_gb, or offload more weights so fewer stay resident."
        )


def smallest_budget_gb(nbytes: int) -> float:
    """The least ``budget_gb``, to three significant digits, whose budget holds ``nbytes``."""
    if nbytes <= 0:
        return 0.0
    digits = max(0, 2 - math.floor(math.log10(nbytes / GiB)))
    step = 10.0 ** -digits
    gb = round(math.ceil(nbytes / GiB / step) * step, digits)
    while int(gb * GiB) < nbytes:  # budget_bytes truncates: never suggest a budget a byte short
        gb = round(gb + step, digits)
    return gb
