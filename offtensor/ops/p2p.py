"""Point-to-point transfers (``send``, ``recv_``, ``recv_any_source_``: ``isend``, ``irecv``,
``batch_isend_irecv``, ``send``, ``recv``) with OffloadedTensor buffers return at once, as they do
with plain tensors, and a received buffer reaches its host master when its ``Work`` completes.

Waiting for the transfer before returning, as the collectives do, deadlocks the common exchange in
which each rank posts its ``isend`` and then its ``irecv``: the peer's receive is posted only after
its own send has returned. So:

- a send goes out from a device copy the op owns (``Pager.copy_out``: outside the cache and the
  budget), which the backend keeps alive until the transfer is done, as it does any plain send
  buffer (gloo's Work holds it; NCCL records it on its stream). Its host source lives until the
  copy has completed (the pager's host lifetimes), so nothing the transfer reads can be freed or
  reused under it, whenever the caller waits;
- a receive lands in a device buffer of its own, and a helper thread waits for the backend's Work
  and then writes the buffer back to the master (every alias sees it, cached copies are dropped).
  The Work returned completes only after that write-back: ``req = dist.irecv(buf, src);
  req.wait()`` then reads the received values, exactly. Like a plain receive buffer, the
  OffloadedTensor holds its old values until then.
"""

from __future__ import annotations

import threading

import torch

from ..tensor import OffloadedTensor
from . import compile as _compile
from .paging import write_back

POINT_TO_POINT = ("send", "recv_", "recv_any_source_")


def is_point_to_point(func) -> bool:
    return func.namespace == "c10d" and func._opname in POINT_TO_POINT


def takes_async_path(args, kwargs) -> bool:
    """Whether every OffloadedTensor buffer can take this module's path: not while torch.compile
    traces it (the graph pages at run time; the collectives' waited path handles that)."""
    tensors = kwargs["tensors"] if "tensors" in kwargs else args[0]
    return all(not isinstance(t, OffloadedTensor) or not _compile.is_traced(t._host) for t in tensors)


def point_to_point(func, args, kwargs):
    """Run ``func`` (a c10d send or receive; its first argument is the ``Tensor[]`` buffers) with
    each OffloadedTensor buffer replaced as this module's docstring says; returns its Work."""
    in_kwargs = "tensors" in kwargs
    tensors = kwargs["tensors"] if in_kwargs else args[0]
    receiving = func._opname != "send"
    if receiving:
        _refuse_coalesced_receive(tensors)
        received = [(t, torch.empty(t.shape, dtype=t.dtype, device=t._master.pager.device))
                    for t in tensors if isinstance(t, OffloadedTensor)]
        buffers = iter(b for _, b in received)
        plain = [next(buffers) if isinstance(t, OffloadedTensor) else t for t in tensors]
    else:
        plain = [t._master.pager.copy_out(t._host) if isinstance(t, OffloadedTensor) else t for t in tensors]
    if in_kwargs:
        work = func(*args, **{**kwargs, "tensors": plain})
    else:
        work = func(plain, *args[1:], **kwargs)
    return _written_back_on_completion(work, received) if receiving else work


def _written_back_on_completion(work, received):
    """A Work that completes once ``work`` has and every (OffloadedTensor, buffer) pair of
    ``received`` is written back; its future's value is the OffloadedTensors (a plain receive's is
    its tensors), or the error that the transfer or the write-back raised."""
    from torch._C._distributed_c10d import Work, _create_work_from_future

    backend_work = Work.unbox(work)  # its wait releases the GIL (the boxed object's may not)
    done = torch.futures.Future()

    def finish():
        try:
            backend_work.wait()
            for t, buf in received:
                write_back(t, buf)
        except BaseException as e:  # noqa: BLE001 (handed to whoever waits)
            done.set_exception(e)
            return
        done.set_result([t for t, _ in received])

    threading.Thread(target=finish, name="offtensor-recv", daemon=True).start()
    return _create_work_from_future(done).boxed()


def _refuse_coalesced_receive(tensors) -> None:
    """Inside a coalescing block (NCCL's ``batch_isend_irecv``) the backend returns one Work for
    the whole batch at its end, and no Work of the receive's own to write back after."""
    from torch.distributed.distributed_c10d import _world

    if _world.pg_coalesce_state:
        t = next(t for t in tensors if isinstance(t, OffloadedTensor))
        raise NotImplementedError(
            f"offtensor: a receive into an OffloadedTensor of shape {tuple(t.shape)} ({t.host_nbytes} bytes of host "
            f"master) inside a coalesced batch (batch_isend_irecv on a backend that coalesces, such as NCCL) is not "
            f"supported: the batch's one Work gives no point at which to write it back. Receive into a plain tensor "
            f"and copy_ it into the OffloadedTensor after waiting."
        )
