"""In-place ops on an offloaded table that change only the rows another tensor names: only those
rows are paged, updated on the device and written back to the host master, where the generic write
pages the whole table (or, larger than the room, cuts it in slices).

- A sparse COO tensor added in (``param.add_(grad)``, ``sub_``): the gradient of an
  ``nn.Embedding(sparse=True)`` (or ``EmbeddingBag``), as SGD, Adagrad and SparseAdam step it. A
  sparse embedding is chosen for a table far larger than one batch's rows, and a sparse tensor has
  no slices to cut. Bit for bit: the sparse tensor's entries keep their order (an uncoalesced
  gradient names a row once per lookup, and the kernel adds them in turn), with each row index
  renumbered into the table of the rows it names, so every element gets the same additions in the
  same order from the same kernel.
- ``embedding_renorm_``: an ``nn.Embedding(max_norm=...)`` (or ``EmbeddingBag``) rescales the rows it
  looks up, in place, before each lookup; each row by its own norm, so the same kernel on the
  table of those rows gives them bit for bit.

"""

from __future__ import annotations

import torch

from ..tensor import OffloadedTensor
from .rows import read_to_host

aten = torch.ops.aten


def sparse_rows_update(args) -> bool:
    """Whether ``args`` are an offloaded dense tensor and a plain sparse COO tensor."""
    if len(args) < 2:
        return False
    self, other = args[0], args[1]
    return (type(other) is torch.Tensor and other.layout is torch.sparse_coo and isinstance(self, OffloadedTensor)
            and other.sparse_dim() >= 1)


def sparse_update(func, args, kwargs):
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
    return _on_rows(self, rows, lambda table: func(table, local, *args[2:], **kwargs))


def renorm_rows(args) -> bool:
    """Whether ``embedding_renorm_``'s table is offloaded and its indices a plain tensor."""
    return isinstance(args[0], OffloadedTensor) and len(args) > 1 and type(args[1]) is torch.Tensor


def renorm_update(func, args, kwargs):
    """``embedding_renorm_(self, indices, max_norm, norm_type)`` on the rows ``indices`` names only."""
    self, indices = args[0], args[1]
    if indices.numel() == 0:
        return self
    rows = read_to_host(indices, self._master.pager).reshape(-1).to(torch.int64)
    # (a negative index counts from the end, as torch's kernel selects it)
    rows = torch.unique(torch.where(rows < 0, rows + self.shape[0], rows))
    if int(rows[0]) < 0 or int(rows[-1]) >= self.shape[0]:
        bad = int(rows[-1]) if int(rows[-1]) >= self.shape[0] else int(rows[0])
        raise IndexError(f"select(): index {bad} out of range for tensor of size {list(self.shape)} at dimension 0")
    local = torch.arange(rows.numel(), dtype=indices.dtype, device=indices.device)
    return _on_rows(self, rows, lambda table: func(table, local, *args[2:], **kwargs))


def _on_rows(self: OffloadedTensor, rows: torch.Tensor, update) -> OffloadedTensor:
    """``update`` run on a device table of ``self``'s ``rows`` (unique, ascending, on the host),
    which are then written back."""
    # The rows handler pages only these rows (in chunks where they do not fit the room together);
    # the result is a plain device tensor, as any op's output is.
    table = aten.index_select.default(self, 0, rows.to(self.device))
    update(table)
    # Straight into the host master (ops/writes.py's index_put_): its cached copies are dropped.
    aten.index_put_.default(self, [rows], table)
    return self


# Each op: (whether its arguments are a table and what names its rows, the update on those rows).
ROW_WRITES = {
    aten.add_.Tensor: (sparse_rows_update, sparse_update),
    aten.sub_.Tensor: (sparse_rows_update, sparse_update),
    aten.embedding_renorm_.default: (renorm_rows, renorm_update),
}
