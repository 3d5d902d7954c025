"""torch.ao.quantization's eager mode (``quantize_dynamic``, ``prepare``, ``quantize``, ``convert``,
``fuse_modules``) in place on a wrapped model: refused before it sets anything.

Those flows find the modules to quantise by ``type(module)`` in their mappings (``nn.Linear`` ->
its dynamic quantised form), and every module of a wrapped model has wrap's subclass of its class
(model/assignment.py). In place they would find none, and the model would stay in floating point
without an error. Their copies (``inplace=False``, the default) are of torch's own classes and
quantise as the unwrapped model does, so only the in-place flow is refused.

Their first step, ``propagate_qconfig_``, reads each module's ``qconfig`` (``getattr(module,
"qconfig", default)``) before it sets one, and ``convert``'s ``swap_module`` reads it before it
looks the module's type up. A wrapped module's class answers those reads through a property: from
the qconfig pass it refuses, and from the swap of a module that has a qconfig (set by hand, then
``convert``); anywhere else a module without a qconfig has none, and one set is kept in the
module's ``__dict__`` as before. FX graph mode's ``prepare_fx`` runs the same qconfig pass over
the model's own modules (its graph module shares them), so it is refused there too, with the copy
that works for it.

``fuse_modules`` (and ``fuse_modules_qat``) look each group's types up the same way, through
``type_before_parametrizations``, whose first read is the module's ``parametrizations``: read from
there on behalf of ``fuse_known_modules``, the same property refuses (torch's own message, "did not
find fuser method for: (Conv2d, BatchNorm2d, ReLU)", names types it can fuse); anywhere else it
answers as a module without the property would."""

from __future__ import annotations

import sys

from torch import nn

_ABSENT = object()


def _watched(name: str, check):
    """A property named ``name`` that answers as the module's ``__dict__`` entry would (an
    AttributeError where it has none, so that ``nn.Module.__getattr__`` looks in its tables), after
    ``check(module, value or _ABSENT, caller's frame)`` has had the chance to refuse the read."""

    def get(self):
        value = self.__dict__.get(name, _ABSENT)
        check(self, value, sys._getframe(1))
        if value is _ABSENT:
            raise AttributeError(name)
        return value

    def set_(self, value):
        self.__dict__[name] = value

    def delete(self):
        try:
            del self.__dict__[name]
        except KeyError:
            raise AttributeError(name) from None

    return property(get, set_, delete)


def _check_qconfig(module, qconfig, caller) -> None:
    if caller.f_globals.get("__name__", "").startswith("torch.ao.quantization"):
        # The qconfig pass, before it sets any; convert's swap of a module given one (by hand).
        if caller.f_code.co_name == "_propagate_qconfig_helper" or (
                caller.f_code.co_name == "swap_module" and qconfig is not _ABSENT and qconfig is not None):
            if _from_fx(caller):
                _refuse(module, how="FX graph mode (prepare_fx / prepare_qat_fx, which prepares the model's own "
                        "modules)", copy="prepare_fx(copy.deepcopy(model), ...)")
            _refuse(module)


def _from_fx(frame) -> bool:
    """Whether ``frame`` runs on behalf of the FX graph mode's entry points (``quantize_fx``)."""
    for _ in range(8):
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_globals.get("__name__") == "torch.ao.quantization.quantize_fx":
            return True
    return False


def _check_parametrizations(module, value, caller) -> None:
    if caller.f_code.co_name != "is_parametrized" or caller.f_globals.get("__name__") != "torch.nn.utils.parametrize":
        return
    # is_parametrized <- type_before_parametrizations <- (a generator expression's frame) <- the fuser
    fuser = caller.f_back
    for _ in range(3):
        if fuser is None:
            return
        if fuser.f_code.co_name == "fuse_known_modules" and fuser.f_globals.get(
                "__name__", "").startswith("torch.ao.quantization"):
            _refuse(module, "fuse", "fuse_modules(model, ...) without inplace=True")
        fuser = fuser.f_back


QCONFIG = _watched("qconfig", _check_qconfig)
# (none in __dict__: nn.Module.__getattr__ answers, with the ModuleDict a parametrization registers)
PARAMETRIZATIONS = _watched("parametrizations", _check_parametrizations)


def _refuse(module: nn.Module, verb: str = "quantise", copy: str = "quantize_dynamic(model, ...) without inplace=True",
            how: str = "in place (inplace=True)") -> None:
    user_class = type(module).__dict__.get("_offtensor_user_class", type(module))
    # Quantisation would go on and change nothing; fusion would stop at torch's "did not find fuser
    # method" for types it can fuse.
    outcome, done = (("cannot fuse", "fused") if verb == "fuse" else
                     ("would quantise nothing", "quantised or given a qconfig"))
    raise TypeError(
        f"offtensor: torch.ao.quantization {how} on a wrapped model {outcome}: it "
        f"finds the modules to {verb} by type(module), and each module of a wrapped model has offtensor's "
        f"subclass of its class (here of {user_class.__module__}.{user_class.__qualname__}). {verb.title()} a copy "
        f"({copy} gives one with torch's own classes), or {verb} before wrap_model. No module was {done}.")
