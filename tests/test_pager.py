"""The pager's own invariants, driven directly: what it may evict, and when."""

from __future__ import annotations

import torch

import offtensor as ot
from offtensor.pager import Pager, host_layout


class _PrefetchOther:
    """A prefetcher that, whenever anything is paged, asks for one other tensor."""

    def __init__(self, other):
        self.other = other
        self.started = []

    def accessed(self, pager, master, key):
        lo, hi = host_layout(self.other._host)[:2]
        self.started.append(pager.prefetch(self.other._master, self.other.dtype, lo, hi))


def test_a_prefetch_never_evicts_the_copy_its_op_is_about_to_use(device):
    # Room for exactly one copy: prefetching the other tensor would have to evict the one just
    # paged for the current op. On a GPU its block would then be reused under the op.
    pager = Pager(torch.device(device), budget_bytes=4096)
    a = ot.offload(torch.randn(1024), pager=pager)
    b = ot.offload(torch.randn(1024), pager=pager)
    pager.prefetcher = _PrefetchOther(b)
    view, entry = pager.page(a._host, a._master)
    assert entry.key in pager._cache and entry.users == 1
    assert pager.prefetcher.started == [False]
    assert torch.equal(view, a._host)
    pager.release([entry])
    assert pager.snapshot().peak_device_bytes <= 4096


def test_a_prefetch_may_evict_copies_no_op_is_using(device):
    pager = Pager(torch.device(device), budget_bytes=8192)
    a, b, c = (ot.offload(torch.randn(1024), pager=pager) for _ in range(3))
    for t in (a, b):
        _, entry = pager.page(t._host, t._master)
        pager.release([entry])
    pager.prefetcher = _PrefetchOther(c)
    view, entry = pager.page(a._host, a._master)  # a hit; b is the least recently used
    assert pager.prefetcher.started == [True]
    assert entry.key in pager._cache
    assert pager.snapshot().evictions == 1 and pager.snapshot().prefetches == 1
    pager.release([entry])
    hits = pager.snapshot().hits
    view, entry = pager.page(c._host, c._master)
    assert pager.snapshot().hits == hits + 1 and pager.snapshot().prefetch_hits == 1
    assert torch.equal(view.cpu(), c._host)
    pager.release([entry])
    assert pager.snapshot().peak_device_bytes <= 8192


def test_a_prefetch_never_evicts_an_earlier_prefetch_still_to_be_used(device):
    # Room for two copies: the one in use and one prefetch. A second prefetch would have to evict
    # the first before it is used: a copy thrown away for one needed later.
    pager = Pager(torch.device(device), budget_bytes=8192)
    a, b, c = (ot.offload(torch.randn(1024), pager=pager) for _ in range(3))

    class PrefetchBoth(_PrefetchOther):
        def accessed(self, pager, master, key):
            for other in (b, c):
                self.other = other
                super().accessed(pager, master, key)

    pager.prefetcher = PrefetchBoth(b)
    view, entry = pager.page(a._host, a._master)
    assert pager.prefetcher.started == [True, False]
    pager.release([entry])
    pager.prefetcher = None
    view, entry = pager.page(b._host, b._master)
    assert pager.snapshot().prefetch_hits == 1
    pager.release([entry])
