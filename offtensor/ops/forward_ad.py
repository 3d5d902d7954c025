"""Forward-mode AD with an offloaded weight as a primal (``forward_ad.make_dual(w, t)``,
``torch.func.jvp`` / ``jacfwd`` with respect to a wrapped model's own parameters): refused where
the dual is made. Giving a tensor a tangent asks whether the tangent can share the primal's
layout (``_has_same_storage_numel``) or makes a zero tangent of that layout
(``_new_zeros_with_same_feature_meta``): both read the whole storage, which pages the whole
weight (a ``BudgetError`` at small budgets), and where it fits torch's own forward-AD views then
fail an internal assert on the wrapper. Only the setting of a forward-mode tangent calls these two
ops, so refusing them costs no other op anything."""

from __future__ import annotations

import torch

from ..tensor import OffloadedTensor
from .table import implements

aten = torch.ops.aten


@implements(aten._has_same_storage_numel.default, aten._new_zeros_with_same_feature_meta.default)
def refuse_forward_ad(func, types, args, kwargs):
    tangent, primal = args[0], args[1]
    weight = primal if isinstance(primal, OffloadedTensor) else tangent
    name = weight._master.name
    what = f"'{name}'" if name is not None else f"of shape {tuple(weight.shape)}"
    role = "primal" if weight is primal else "tangent"
    where = " (to functional_call, in its parameters dict)" if role == "primal" else ""
    raise NotImplementedError(
        f"offtensor: forward-mode AD with the offloaded weight {what} ({weight.host_nbytes} bytes) as a {role} "
        f"(forward_ad.make_dual, or torch.func.jvp / jacfwd with respect to a wrapped model's parameters) is not "
        f"supported: the dual would need the whole weight on the device. Pass a plain device copy, "
        f"w.materialize(), as the {role}{where}")
