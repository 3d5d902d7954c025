"""The plain tensors inside traceable wrapper subclasses (DTensor, torchao's quantised tensors...).

offtensor offloads only plain dense tensors: the *leaves*. A wrapper subclass that follows the
``__tensor_flatten__`` / ``__tensor_unflatten__`` protocol (what torch.compile and FSDP2 rely on)
names its inner tensors; this module walks those names recursively (torchao's Float8 data inside a
DTensor's local shard is two levels down), and replaces a leaf in place on the object that holds
it (``setattr``), so the outer object keeps its class, its Parameter identity and its attributes
while its bytes live in an OffloadedTensor. Never the other way round: an OffloadedTensor never
wraps a subclass.

Nothing here imports the rest of offtensor: a class that is a leaf although it has the protocol
(OffloadedTensor itself) says so with a class attribute ``_OFFTENSOR_LEAF = True``.
"""

from __future__ import annotations

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def is_leaf(t) -> bool:
    """A tensor offtensor can hold as it is: plain, a Parameter, an OffloadedTensor, or a subclass
    that owns real storage (made by ``_make_subclass``, as vLLM's Parameter subclasses are) and
    names no inner tensors."""
    if not isinstance(t, torch.Tensor):
        return False
    cls = type(t)
    if cls in _PLAIN or getattr(cls, "_OFFTENSOR_LEAF", False):
        return True
    return not hasattr(cls, "__tensor_flatten__") and _has_storage(t)


def _has_storage(t: torch.Tensor) -> bool:
    # A wrapper subclass (_make_wrapper_subclass) has a storage whose data pointer cannot be read.
    try:
        t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def is_wrapper(t) -> bool:
    """A tensor subclass whose plain leaves offtensor can reach (``__tensor_flatten__``)."""
    return isinstance(t, torch.Tensor) and not is_leaf(t) and hasattr(type(t), "__tensor_flatten__")


def check_flattenable(t, what: str = "tensor") -> None:
    """Raise a clear error for a tensor subclass whose inner tensors cannot be reached: it has no
    ``__tensor_flatten__``, so offtensor cannot tell which bytes are its values."""
    if isinstance(t, torch.Tensor) and not is_leaf(t) and not is_wrapper(t):
        raise TypeError(
            f"offtensor: cannot offload {what} of shape {tuple(t.shape)} ({t.numel() * t.element_size()} bytes): its "
            f"class {type(t).__module__}.{type(t).__qualname__} is a tensor subclass without __tensor_flatten__ / "
            f"__tensor_unflatten__, so its inner tensors cannot be found; give the class that protocol (as DTensor and "
            f"torchao's tensors have), or keep it out of offloading with policy={{'keep': [...]}}"
        )


def inner_names(t: torch.Tensor) -> list:
    """The attribute names ``t.__tensor_flatten__`` gives whose values are tensors (DTensor also
    names its device mesh there, which is no tensor)."""
    names, _ = t.__tensor_flatten__()
    return [n for n in names if isinstance(getattr(t, n, None), torch.Tensor)]


def leaves(t: torch.Tensor, what: str = "tensor") -> list:
    """``(owner, attribute, leaf)`` for every plain leaf inside ``t``, depth first, in flatten
    order; ``[]`` when ``t`` is a leaf itself. A subclass without the protocol at any depth raises."""
    if is_leaf(t):
        return []
    check_flattenable(t, what)
    found = []
    for name in inner_names(t):
        inner = getattr(t, name)
        if is_leaf(inner):
            found.append((t, name, inner))
        else:
            found.extend(leaves(inner, f"{what} (its {name})"))
    return found


def leaf_tensors(t: torch.Tensor):
    """``t`` itself when it is a leaf, else its leaves: the tensors whose bytes ``t`` holds."""
    if is_leaf(t):
        return (t,)
    return tuple(leaf for _, _, leaf in leaves(t))


def replace_leaf(owner: torch.Tensor, name: str, new: torch.Tensor) -> None:
    """Make ``owner.name`` be ``new``; the outer object and everything else on it stay."""
    setattr(owner, name, new)


def rebuild(t: torch.Tensor, convert) -> torch.Tensor:
    """A new object of ``t``'s class whose leaves are ``convert(leaf)``, built through
    ``__tensor_unflatten__`` (``t`` is left as it was): ``ot.offload`` of a subclass."""
    if is_leaf(t):
        return convert(t)
    check_flattenable(t)
    names, context = t.__tensor_flatten__()
    inner = {}
    for name in names:
        value = getattr(t, name)
        inner[name] = rebuild(value, convert) if isinstance(value, torch.Tensor) else value
    return type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())


def nested_wrappers(t: torch.Tensor) -> list:
    """``(owner, attribute, wrapper)`` for every wrapper subclass inside ``t`` (a torchao tensor as
    a DTensor's local shard), innermost first: the order ``refitted`` must see them in, as a
    wrapper's device is read off its inner tensors."""
    found = []
    if is_wrapper(t):
        for name in inner_names(t):
            inner = getattr(t, name)
            if is_wrapper(inner):
                found.extend(nested_wrappers(inner))
                found.append((t, name, inner))
    return found


def refitted(t: torch.Tensor):
    """A new object of ``t``'s class around ``t``'s inner tensors as they are now (built through
    ``__tensor_unflatten__``) when ``t`` itself is not on the device they are on, else None.

    A wrapper subclass's own device (and its storage's, which torch keeps on that device) is fixed
    when the object is made (``_make_wrapper_subclass(..., device=a.device)``); ``replace_leaf``
    changes only the Python attribute. Leaves moved from the host to a GPU therefore leave the outer
    object on the host, and torch refuses every view of it: ``return_and_correct_aliasing`` sets the
    view's storage (on the GPU, from its leaves) to the argument's (on the host). The class's own
    ``__tensor_unflatten__`` says what the object is around these inner tensors, as torch.compile
    and FSDP2 rebuild it. Also None while the inner tensors are on different devices (some leaves
    not placed yet): the class itself may refuse that (``TwoTensor`` does)."""
    names, context = t.__tensor_flatten__()
    inner = {name: getattr(t, name) for name in names}
    devices = {v.device for v in inner.values() if isinstance(v, torch.Tensor)}
    if len(devices) != 1 or t.device in devices:
        return None
    new = type(t).__tensor_unflatten__(inner, context, t.size(), t.stride())
    return new if new.device != t.device else None  # a class whose device is not its inner tensors'
