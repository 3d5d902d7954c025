"""Writes into an OffloadedTensor inside a torch.compile graph: ``offtensor::write`` and
``offtensor::written``.

torchao's low-bit optimizers (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) compile each parameter's
step with ``fullgraph=True`` and end it with ``p.copy_(new_value)``, so a graph break there is an
error: the write has to be traced.

``copy_`` into a traced OffloadedTensor becomes ``offtensor::write(host, master_id, value)``, which
declares that it writes ``host``, the traced host view, so every op that reads the weight before
the write is scheduled before it. Run on the weight's own host memory it is eager's ``copy_``
(ops/writes.py): under the pager's lock it waits for the copies still reading the master, drops
its cached device copies, then writes; no later page reads stale bytes.

AOTAutograd traces the tensor as its host view and functionalises the write
(``auto_functionalized``: the op writes a copy of the view), and ops after it read that copy
(compile.py pages such a value past the cache). It then writes the input with ``copy_`` of the
updated OffloadedTensor into it, at the graph's end; that ``copy_`` (its host view is no functional
tensor) is recorded as a plain ``copy_`` of the host view, the one write into an input that
AOTAutograd allows in its graph, followed by ``offtensor::written``, which drops the cached copies
made meanwhile. Inductor then writes the input in place with ``write`` itself and removes the
``copy_`` (its re-inplacing of a mutated input copied back); ``aot_eager`` runs both as recorded.
"""

from __future__ import annotations

import torch
from torch._subclasses.functional_tensor import FunctionalTensor, disable_functional_mode

from ..tensor import OffloadedTensor
from .compile import _LIB_NS, _live_master, capturing, keep_dynamo_out_of_dispatch
from .paging import write_master

aten = torch.ops.aten


@torch.library.custom_op(f"{_LIB_NS}::write", mutates_args=("host",))
def write(host: torch.Tensor, master_id: int, value: torch.Tensor, from_device: bool) -> None:
    """``host.copy_(value)``, ``host`` a view of master ``master_id`` or the graph's copy of one;
    ``from_device``: the value was computed on the device (counted as written back)."""
    master = _live_master(master_id, host)
    _refuse_under_capture(master.pager, master, host)
    # As eager copy_. On the graph's copy of the view (aot_eager) the master is written by the
    # copy_ at the graph's end; the wait for earlier reads' copies still keeps that copy_ from
    # overwriting bytes a copy of an earlier read is reading.
    write_master(master, host, value, from_device)


@write.register_fake
def _write_fake(host, master_id, value, from_device):
    keep_dynamo_out_of_dispatch()
    return None


@torch.library.custom_op(f"{_LIB_NS}::written", mutates_args=())
def written(host: torch.Tensor, master_id: int) -> None:
    """Master ``master_id`` was written past the pager (the plain ``copy_`` at a graph's end): drop
    the device copies cached of it since ``write``."""
    master = _live_master(master_id, host)
    master.pager.before_write(master)


@written.register_fake
def _written_fake(host, master_id):
    return None


# Kept although it returns nothing that is used (as compile.new_step is).
torch.fx.node.has_side_effect(torch.ops.offtensor.written.default)


def _refuse_under_capture(pager, master, host) -> None:
    if capturing(pager):
        raise RuntimeError(
            f"offtensor: a compiled graph writes the offloaded weight {master.name!r} ({host.numel() * host.element_size()} "
            f"bytes) under CUDA graph capture: a replay runs no Python to drop the pager's cached copies of it. Keep "
            f"this weight resident to capture the step, or run it without CUDA graphs.")


def traced_copy(func, args, kwargs):
    """What a traced ``dst.copy_(src)`` into an OffloadedTensor records (see the module docstring),
    or None where the call has another shape (the caller breaks the graph)."""
    if func is not aten.copy_.default or len(args) != 2 or set(kwargs) - {"non_blocking"}:
        return None
    dst, src = args
    if not isinstance(dst, OffloadedTensor):
        return None
    host, master_id = dst._host, dst._master.id
    value = src._host if isinstance(src, OffloadedTensor) else src
    if isinstance(host, FunctionalTensor) or torch._C._get_dispatch_mode(_FUNCTIONAL) is None:
        # The user's write: functionalised, or recorded as it is (Dynamo's own run, a trace that
        # does not functionalise).
        write(host, master_id, value, _on_device(src))
    elif isinstance(src, OffloadedTensor) and src._master is dst._master:
        # AOTAutograd's copy_ of the updated input into the input, traced under its
        # functionalisation mode on tensors that are not functional.
        with disable_functional_mode():
            written(host.copy_(value), master_id)
    else:
        return None
    return dst


_FUNCTIONAL = torch._C._TorchDispatchModeKey.FUNCTIONAL


def _on_device(src) -> bool:
    return not isinstance(src, OffloadedTensor) and src.device.type != "cpu"
