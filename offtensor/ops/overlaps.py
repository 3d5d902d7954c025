"""Torch's memory-overlap rules, applied to OffloadedTensors through their host views.

An op that writes one view of a host master and reads another of the same master is checked by
torch itself when it runs whole: its aliasing arguments view one device copy
(``paging._page_aliases``). An op run in slices, or on the host from the master, must check first:
slices of two views that overlap otherwise read elements an earlier slice wrote, and an op's
out-of-place form on the host reads none its in-place kernel would have written."""

from __future__ import annotations

import torch

PARTIAL_OVERLAP = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a "
                   "single memory location. Please clone() the tensor before performing the operation.")


def refuse_partial_overlap(written: torch.Tensor, read: torch.Tensor) -> None:
    """torch's ``assert_no_partial_overlap(written, read)`` over two host views of one storage."""
    if partial_overlap(written, read):
        raise RuntimeError(PARTIAL_OVERLAP) from None  # (not chained to the BudgetError that sent the op here)


def partial_overlap(w: torch.Tensor, a: torch.Tensor) -> bool:
    """``get_overlap_status(w, a) == Partial`` in torch: dense views whose byte ranges meet, but not
    as the same range with the same strides. (Views that are not dense are torch's "too hard",
    which it lets through.)"""
    if not w.numel() or not a.numel() or not (dense(w) and dense(a)):
        return False
    w0, a0 = w.data_ptr(), a.data_ptr()
    w1, a1 = w0 + w.numel() * w.element_size(), a0 + a.numel() * a.element_size()
    if w0 == a0 and w1 == a1:
        return w.stride() != a.stride()
    return w0 < a1 and a0 < w1


def disjoint(w: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether no byte of ``a`` is a byte of ``w``: their byte ranges, whatever the strides, do not meet."""
    (w0, w1), (a0, a1) = _byte_range(w), _byte_range(a)
    return not w.numel() or not a.numel() or w1 <= a0 or a1 <= w0


def dense(t: torch.Tensor) -> bool:
    """torch's ``is_non_overlapping_and_dense``: the elements fill one range, in some order of dims."""
    expected = 1
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _byte_range(t: torch.Tensor) -> tuple:
    lo = hi = 0
    for size, stride in zip(t.shape, t.stride()):
        (lo, hi) = (lo + (size - 1) * stride, hi) if stride < 0 else (lo, hi + (size - 1) * stride)
    start = t.data_ptr()
    return start + lo * t.element_size(), start + (hi + 1) * t.element_size()
