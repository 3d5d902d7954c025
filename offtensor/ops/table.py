"""The per-op table of OffloadedTensor handlers and ``implements``, the one way into it."""

from __future__ import annotations

import torch

# OpOverload -> handler(func, types, args, kwargs): filled by ``implements`` at import, and by
# ops/__init__.py's torch_dispatch with the schema-chosen handler of an op met for the first time.
OP_TABLE: dict = {}


def implements(*ops):
    """Register a handler ``(func, types, args, kwargs)`` for OpOverloads; duplicates raise."""

    def register(handler):
        for op in ops:
            if not isinstance(op, torch._ops.OpOverload):
                raise TypeError(f"register OpOverloads such as aten.x.default, not {op!r}")
            if op in OP_TABLE:
                raise RuntimeError(f"offtensor: {op} already has a handler ({OP_TABLE[op].__name__})")
            OP_TABLE[op] = handler
        return handler

    return register
