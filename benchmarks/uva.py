"""A UVA-style offload, the baseline the offloading benchmarks measure against: a weight stays in
pinned host memory and the kernels read it in place, through its device address, on every use (no
copy, no cache), as vLLM's ``cpu_offload_gb`` does (a CUDA tensor over
``cudaHostGetDevicePointer`` of the pinned bytes).

The device address comes from the native extension (``offtensor::host_device_address``); an
extension built without it falls back to the host address, which is the device address of
``cudaHostAlloc`` memory (torch's ``pin_memory``) on every system with unified addressing.
"""

from __future__ import annotations

import torch


class _DeviceView:
    """``__cuda_array_interface__`` over ``nbytes`` bytes at device address ``address``."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


def device_address(pinned: torch.Tensor) -> int:
    op = getattr(torch.ops.offtensor, "host_device_address", None)
    return op(pinned) if op is not None else pinned.data_ptr()


def uva_view(weight: torch.Tensor, device: torch.device, keep: list) -> torch.Tensor:
    """A CUDA tensor of ``weight``'s values that lives in pinned host memory (appended to ``keep``,
    which must outlive the view): reads of it by a kernel cross the host link each time."""
    pinned = weight.detach().contiguous().pin_memory()
    keep.append(pinned)
    raw = pinned.view(torch.uint8).view(-1)
    view = torch.as_tensor(_DeviceView(device_address(raw), raw.numel()), device=device)
    return view.view(weight.dtype).view(weight.shape)


def offload_params(model, names, device: torch.device) -> list:
    """Replace the parameters ``names`` of ``model`` by UVA views of their values (the model's other
    weights are left where they are); returns the pinned tensors to keep alive with the model."""
    keep: list = []
    for name in names:
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        view = uva_view(getattr(module, attr), device, keep)
        setattr(module, attr, torch.nn.Parameter(view, requires_grad=False))
    return keep
