"""A dense offloaded tensor updated in place by a sparse COO tensor: ``param.add_(grad)`` where the
gradient of an ``nn.Embedding(sparse=True)`` (or ``EmbeddingBag``) is sparse, as SGD, Adagrad and
SparseAdam step it. Only the rows the sparse tensor names change, so only they are paged, updated
on the device and written back to the host master: a sparse embedding is chosen for a table far
larger than one batch's rows, and the generic write would page the whole table (or, larger than
the room, cut it in slices, which a sparse tensor cannot be).

Bit for bit: the sparse tensor's entries keep their order (an uncoalesced gradient names a row once
per lookup, and the kernel adds them in turn), with each row index renumbered into the table of
the rows it names, so every element gets the same additions in the same order from the same kernel."""

from __future__ import annotations

import torch

from ..tensor import OffloadedTensor
from .rows import read_to_host

aten = torch.ops.aten

# In-place ops of a dense tensor and a sparse one that leave the rows the sparse one does not name
# as they are.
SPARSE_ROW_OPS = frozenset({aten.add_.Tensor, aten.sub_.Tensor})


def sparse_rows_update(args) -> bool:
    """Whether ``args`` are an offloaded dense tensor and a plain sparse COO tensor."""
    if len(args) < 2:
        return False
    self, other = args[0], args[1]
    return (type(other) is torch.Tensor and other.layout is torch.sparse_coo and isinstance(self, OffloadedTensor)
            and other.sparse_dim() >= 1)


def update_rows(func, args, kwargs):
    """``func(self, other, **kwargs)`` on the rows of ``self`` that ``other`` names only."""
    self, other = args[0], args[1]
    if other.shape != self.shape:
        # torch's own refusal (dense-sparse addition does not broadcast), from a stand-in of
        # self's shape that holds one element.
        func(torch.zeros((), dtype=self.dtype).expand(self.shape), other.cpu(), *args[2:], **kwargs)
    indices = other._indices()
    if indices.shape[1] == 0:
        return self
    pager = self._master.pager
    rows, renumbered = torch.unique(read_to_host(indices[0], pager), return_inverse=True)
    local = torch.sparse_coo_tensor(
        torch.cat([renumbered.to(indices.device).unsqueeze(0), indices[1:]]), other._values(),
        (rows.numel(), *other.shape[1:]), is_coalesced=other.is_coalesced(), check_invariants=False)
    # The rows handler pages only these rows (in chunks where they do not fit the room together);
    # the result is a plain device tensor, as any op's output is.
    table = aten.index_select.default(self, 0, rows.to(self.device))
    func(table, local, *args[2:], **kwargs)
    # Straight into the host master (ops/writes.py's index_put_): its cached copies are dropped.
    aten.index_put_.default(self, [rows], table)
    return self
