"""How much a build from config.json may register, given the files it must match: every parameter
of the model needs a tensor of its own in the files, so a build that registers far more parameters
than the files hold tensors is stopped there, with a ``CheckpointError`` naming config.json, before
it spends minutes and gigabytes on modules no file can fill (a config giving 10**9 experts, one
module each, beside a small checkpoint).

Layer counts are checked before the build (``configs.py``); this bounds what they cannot see: any
field that makes the build repeat a module (an expert per ``num_experts``, whatever its name).
"""

from __future__ import annotations

import os
import re

from ..safetensors_files import CheckpointError
from .scoped import ScopedHooks

# Measured on the meta builds of transformers' default configs (every model type that builds): at
# most 1.4 distinct parameters are registered per parameter the model ends with (parameters tied or
# replaced while it is built: Zamba2's shared blocks), 142 more at most, and 2.7 modules per
# parameter. Each parameter left needs a tensor of its own in the files, so twice the files'
# tensors, plus an allowance for a checkpoint of few tensors, never refuses a checkpoint that loads.
PARAMETERS_PER_TENSOR, PARAMETER_ALLOWANCE = 2, 1024
MODULES_PER_TENSOR, MODULE_ALLOWANCE = 4, 4096
# Whatever the files list (a header holds a million one-byte tensors), no build registers more,
# which bounds its time and memory (SwitchTransformers' experts up to the ceiling: 35 s, 1.2 GB). The largest published model of
# one module per expert, SwitchTransformers' switch-c-2048 (2048 experts a sparse layer), registers
# 61,709 parameters and 154,181 modules; remote code building DeepSeek-V3's layout per expert at
# Kimi-K2's size (384 experts, 60 layers) about 70,000 parameters.
MAX_PARAMETERS = 1 << 17
MAX_MODULES = 1 << 19

# Config fields that count repeated modules (num_experts, n_routed_experts, num_local_experts,
# num_hidden_layers...), named when a build goes past the files.
_COUNT = re.compile(r"(^|_)(num|n)_|(^|_)(experts|layers|blocks|heads|groups|codebooks)$")


class Registrations:
    """What one build has registered (distinct parameters, modules) against its limits."""

    __slots__ = ("parameters", "modules", "parameter_limit", "module_limit", "tensors", "fields", "root", "files",
                 "repeated")

    def __init__(self, entries: dict, root: str, fields=tuple):
        """``entries``: the files' tensors; ``fields()``: the config's (dotted name, int value) pairs."""
        tensors = len(entries)
        self.parameters, self.modules = set(), 0  # ids of the parameters registered; modules registered
        self.parameter_limit = min(PARAMETERS_PER_TENSOR * tensors + PARAMETER_ALLOWANCE, MAX_PARAMETERS)
        self.module_limit = min(MODULES_PER_TENSOR * tensors + MODULE_ALLOWANCE, MAX_MODULES)
        self.tensors, self.fields, self.root = tensors, fields, root
        self.files = len({e.file for e in entries.values()})
        self.repeated = None  # the last module registered under a numbered name (an expert, a layer)

    def parameter(self, module, name: str, param) -> None:
        if param is None or id(param) in self.parameters:  # a tie registers one parameter twice
            return
        self.parameters.add(id(param))
        if len(self.parameters) > self.parameter_limit:
            self.refuse("parameters", self.parameter_limit, MAX_PARAMETERS, module, name)

    def module(self, parent, name: str, child) -> None:
        if child is None:
            return
        self.modules += 1
        if name[-1:].isdigit():
            self.repeated = (parent, name)
        if self.modules > self.module_limit:
            self.refuse("modules", self.module_limit, MAX_MODULES, parent, name)

    def refuse(self, what: str, limit: int, ceiling: int, module, name: str):
        """Stop the build: a CheckpointError naming config.json, the count fields the files cannot
        give a tensor each (the likely cause), and the module the build was repeating."""
        counts = sorted(((v, n) for n, v in self.fields()
                         if v > self.tensors and _COUNT.search(n.rpartition(".")[2])), reverse=True)
        fields = f" (check {', '.join(f'{n} = {v}' for v, n in counts[:3])})" if counts else ""
        if limit >= ceiling:
            why = f"more than offtensor builds for any checkpoint (at most {ceiling}; the {self.files} file(s) " \
                  f"list {self.tensors} tensors)"
        else:
            per, allowance = ((PARAMETERS_PER_TENSOR, PARAMETER_ALLOWANCE) if what == "parameters"
                              else (MODULES_PER_TENSOR, MODULE_ALLOWANCE))
            why = f"but the {self.files} file(s) of {self.root!r} hold {self.tensors} tensors, and each parameter " \
                  f"needs one of its own (a build may register {per} {what} a tensor, and {allowance} more)"
        parent, child = self.repeated or (module, name)
        raise CheckpointError(f"offtensor: cannot load {self.root}: "
                              f"{os.path.join(self.root, 'config.json')!r}{fields} makes the model register more "
                              f"than {limit} {what}, {why}: the config is not this checkpoint's (the build was stopped "
                              f"after {type(parent).__name__}.{child})")


# ``with counted(Registrations(...)):`` counts this thread's registrations while the frame that
# entered the block runs (``scoped.py``), and stops the build once they pass the limits.
counted = ScopedHooks(parameter=lambda state, module, name, param: state.parameter(module, name, param),
                      module=lambda state, parent, name, child: state.module(parent, name, child))
