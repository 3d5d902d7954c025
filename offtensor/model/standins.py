"""Host stand-ins of a wrapper-subclass weight whose leaves are offloaded: the same class rebuilt
(``__tensor_unflatten__``) over plain host tensors, so the class's own code (a transform reading
the weight, the class's cast) computes from host memory instead of paging every leaf onto the
device. What ``ot.on_host`` lends and what a cast of a wrapped model computes from."""

from __future__ import annotations

import torch

from .. import leaves
from ..tensor import OffloadedTensor

HOST = torch.device("cpu")


def has_offloaded_leaves(t) -> bool:
    """``t`` is a wrapper subclass at least one of whose leaves is an OffloadedTensor."""
    return leaves.is_wrapper(t) and any(isinstance(leaf, OffloadedTensor) for leaf in leaves.leaf_tensors(t))


class HostStandIn:
    """``wrapper`` rebuilt over host tensors: an offloaded leaf as its host master (a view of the
    master's memory, no copy), a leaf already on the host as itself, a leaf resident on a GPU as a
    host copy (its bytes are small beside the budget's; ``write_back`` copies them back, so an
    in-place write through the stand-in reaches the resident leaf as it reaches a master).

    ``tensor`` is dressed as ``wrapper``: its attributes (Parameter-ness, ``weight_loader``...)
    and ``requires_grad``; ``pairs`` lists (original leaf, host leaf) in flatten order."""

    def __init__(self, wrapper: torch.Tensor):
        self.wrapper = wrapper
        self.pairs = []
        self.copies = []  # (resident device leaf, its host copy)
        with torch.no_grad():
            rebuilt = leaves.rebuild(wrapper, self._host_leaf)
        self.tensor = dressed_like(wrapper, rebuilt)

    def _host_leaf(self, leaf: torch.Tensor) -> torch.Tensor:
        if isinstance(leaf, OffloadedTensor):
            host = leaf._host
        elif leaf.device.type == HOST.type or leaf.is_meta:
            host = leaf.detach()
        else:
            host = leaf.detach().to(HOST)
            self.copies.append((leaf, host))
        self.pairs.append((leaf, host))
        return host

    def offloaded_masters(self) -> list:
        return [leaf._master for leaf, _ in self.pairs if isinstance(leaf, OffloadedTensor)]

    def write_back(self) -> None:
        """Copy the host copies of resident GPU leaves back (what a transform wrote through them)."""
        with torch.no_grad():
            for leaf, host in self.copies:
                leaf.copy_(host)


def dressed_like(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new`` (``old``'s class rebuilt around other leaves) with ``old``'s own attributes, not its
    inner tensors (``new`` holds its own), and ``old``'s ``requires_grad``: a Parameter stays one
    (a wrapper subclass's Parameter-ness is its ``_is_param`` attribute)."""
    inner = set(leaves.inner_names(old))
    new.__dict__.update({k: v for k, v in old.__dict__.items() if k not in inner})
    if new.requires_grad != old.requires_grad:
        new.requires_grad_(old.requires_grad)
    return new
