"""Host lifetimes: every host source of a copy still in flight, kept until that copy completes."""

from __future__ import annotations

import collections
from typing import Optional

import torch


class HostLifetimes:
    """Host sources of copies that may still be running, each kept with its completion token.

    The host-lifetime rule (docs/design.md, "lifetimes"): a master, a gathered-rows buffer or a temporary must outlive
    every asynchronous copy reading it, on a GPU (where freeing would ``cudaHostUnregister`` and
    unmap memory under a DMA) exactly as on the emulated device. A record is
    ``[storage_ptr, token, src, stream]``. A transient copy on a GPU's compute stream gets no
    event of its own (``token`` None): once ``SEAL_EVERY`` such records are pending, one event
    recorded on their stream, after all of them, completes them together.
    """

    SEAL_EVERY = 32
    __slots__ = ("_ops", "_records", "_unsealed")

    def __init__(self, ops):
        self._ops = ops
        self._records: "collections.deque[list]" = collections.deque()
        self._unsealed = 0

    def keep(self, src: torch.Tensor, token, stream=None) -> list:
        record = [storage_ptr(src), token, src, stream]
        self._records.append(record)
        if token is None:
            self._unsealed += 1
            if self._unsealed >= self.SEAL_EVERY:
                self._seal()
        self.collect()
        return record

    def _seal(self) -> None:
        events = {}
        for record in self._records:
            if record[1] is None:
                event = events.get(record[3])
                if event is None:
                    event = events[record[3]] = self._ops.new_event(record[3])
                record[1] = event
        self._unsealed = 0

    def collect(self) -> None:
        """Drop the records of finished copies, oldest first (copies mostly finish in order)."""
        records, done = self._records, self._ops.done
        while records and records[0][1] is not None and done(records[0][1]):
            records.popleft()

    def wait_for(self, storage_ptr: Optional[int]) -> None:
        """Block until no copy reads the host storage at ``storage_ptr`` (every storage if None)."""
        kept = collections.deque()
        for record in self._records:
            if storage_ptr is None or record[0] == storage_ptr:
                if record[1] is None:
                    self._ops.block_stream(record[3])  # a transient copy without an event: its stream
                    self._unsealed -= 1
                else:
                    self._ops.block(record[1])
            else:
                kept.append(record)
        self._records = kept

    def __len__(self) -> int:
        return len(self._records)


def storage_ptr(t: Optional[torch.Tensor]) -> Optional[int]:
    return None if t is None else t.untyped_storage().data_ptr()
