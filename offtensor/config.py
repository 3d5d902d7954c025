"""OffloadConfig: every setting of an offloaded model in one documented, immutable object.

``wrap_model``, ``load_safetensors``, ``from_pretrained`` and ``ot.plan`` keep their keyword
arguments (the contract in docs/usage.md); each call builds one ``OffloadConfig`` from them and hands that
object on, so placement, the pager, the loader and the step hook all read the same settings
(diffusers' ``GroupOffloadingConfig`` does the same). Environment variables only fill defaults:

| setting | default | environment variable |
| --- | --- | --- |
| ``strict`` | False | ``OFFTENSOR_STRICT=1`` |
| ``progress`` | None (a bar for loads of 256 MB or more) | ``OFFTENSOR_PROGRESS=0`` / ``=1`` |
| ``load_threads`` | the CPU count, clamped to 4..8 | ``OFFTENSOR_LOAD_THREADS=N`` |
| ``routing_warmup`` | 256 routed tokens | ``OFFTENSOR_ROUTING_WARMUP=N`` (0: never decide by measured routing) |
| ``placement_profile`` | ``"h200"`` | ``OFFTENSOR_PLACEMENT_PROFILE=h100`` (a built-in profile's name) |

An argument given explicitly always wins over its environment variable.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Callable, Optional, Sequence, Union

import torch

# A placement policy: offload patterns, {"offload": [...], "keep": [...]}, or name -> "offload" | "keep" | None.
Policy = Union[None, Sequence[str], dict, Callable[[str], Optional[str]]]

_FALSE_WORDS = ("", "0", "false", "no", "off")
_TRUE_WORDS = ("1", "true", "yes", "on")


def strict_from_env() -> bool:
    """``OFFTENSOR_STRICT=1``: the emulated device completes copies late and out of order into
    poisoned buffers (``_ext.StrictCopyEngine``), so a missing wait fails instead of passing by luck."""
    return os.environ.get("OFFTENSOR_STRICT", "").strip().lower() not in ("", "0", "false", "no")


def progress_from_env() -> Optional[bool]:
    """``OFFTENSOR_PROGRESS``: ``0`` silences the load progress bar, ``1`` forces it; unset (None):
    shown for large loads only."""
    word = os.environ.get("OFFTENSOR_PROGRESS", "").strip().lower()
    if word in _TRUE_WORDS:
        return True
    if word and word in _FALSE_WORDS:
        return False
    return None


def load_threads_from_env() -> int:
    """``OFFTENSOR_LOAD_THREADS``, else the CPU count clamped to 4..8: readers mostly wait on page
    faults, so a few more than the cores keep the disk busy."""
    return int(os.environ.get("OFFTENSOR_LOAD_THREADS", "0")) or min(8, max(4, os.cpu_count() or 4))


def int_from_env(name: str, default: int, minimum: int, unit: str) -> int:
    """The whole number in environment variable ``name``, else ``default``; a clear error names
    the variable when it is no number or below ``minimum`` (``unit``: what it counts)."""
    word = os.environ.get(name, "").strip()
    if not word:
        return default
    try:
        value = int(word)
    except ValueError:
        raise ValueError(f"offtensor: {name} must be a number of {unit}, got {word!r}") from None
    if value < minimum:
        raise ValueError(f"offtensor: {name} must be >= {minimum} {unit}, got {value}")
    return value


def routing_warmup_from_env() -> int:
    """``OFFTENSOR_ROUTING_WARMUP``, else 256: routed tokens a wrapped MoE model records before it
    decides its expert placement. Fewer make a uniform router look skewed (32 tokens of top-8 over
    128 experts leave most experts unseen), which would favour paging every stack wrongly."""
    return int_from_env("OFFTENSOR_ROUTING_WARMUP", 256, 0, "routed tokens")


def placement_profile_from_env():
    """``OFFTENSOR_PLACEMENT_PROFILE``, else ``DEFAULT_PLACEMENT_PROFILE``: the GPU profile under
    which the expert placement's replay compares the two placements."""
    return os.environ.get("OFFTENSOR_PLACEMENT_PROFILE", "").strip() or DEFAULT_PLACEMENT_PROFILE


# The replay of the expert placement runs under this profile (a name in ``ot.PROFILES`` or a
# ``ot.Profile``): the measured H200, the GPU the decisions were validated on.
DEFAULT_PLACEMENT_PROFILE = "h200"

# Where a routed expert that is not cached on the device is computed (``OffloadConfig.expert_compute``).
EXPERT_COMPUTE = ("device", "host", "auto")


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """The settings of one offloaded model (see the module docstring for the environment defaults).

    - ``budget_gb``: GiB (2**30 bytes) of device memory this model's weights may hold at once:
      resident weights + paged copies alive + prefetches in flight.
    - ``offload_gb``: vLLM's ``cpu_offload_gb``: offload at least this many GiB, keep the rest
      resident. Give ``budget_gb`` or ``offload_gb`` or neither (then: free device memory minus a
      margin for activations).
    - ``device``: None is ``cuda`` (current device) when available, else ``cpu``, the emulated device.
    - ``prefetch``: copy the next weights ahead of use, and leave room in the budget for that.
    - ``policy``: which weights to offload or keep, by name (``Policy``).
    - ``strict``: the emulated device's strict mode (late, out-of-order copies). Not the
      ``strict=`` of ``load_safetensors``, which is about names in the checkpoint.
    - ``progress``: the load progress bar: True, False, or None for loads of 256 MB or more.
    - ``load_threads``: reader threads of ``load_safetensors``.
    - ``routing``: an MoE model's measured routing (``ot.RoutingStats``, a recorded trace or
      a path to a saved one): ``wrap_model`` decides at wrap time, by replay, whether whole expert
      stacks stay resident or every stack is paged through the expert cache. Without it (and
      without a ``policy``) the wrapped model records its own routing and decides once after
      ``routing_warmup`` routed tokens.
    - ``routing_warmup``: routed tokens recorded before that decision; 0: no decision, the
      default placement stays.
    - ``placement_profile``: the GPU profile of that replay (``ot.PROFILES`` name or Profile).
    - ``expert_compute``: where a routed expert that is not cached on the device is computed:
      ``"device"`` (copied to the device first, the default), ``"host"`` (computed from its host
      master, its tokens' activations sent to the host and the result sent back) or ``"auto"``
      (per MoE layer and step shape, whichever the replay under the profile says is faster).
    - ``expert_compute_choice``: what "auto" chose per MoE layer (set by the wrap-time replay,
      ``sim.host_compute``); None otherwise.
    - ``expert_pool``: routed expert stacks get a device-side expert pool (``moe.pool``) whose
      slots are assigned on the device: decode makes no host decision on the expert path.
    """

    budget_gb: Optional[float] = None
    offload_gb: Optional[float] = None
    device: Union[None, str, torch.device] = None
    prefetch: bool = True
    policy: Policy = None
    strict: bool = dataclasses.field(default_factory=strict_from_env)
    progress: Optional[bool] = dataclasses.field(default_factory=progress_from_env)
    load_threads: int = dataclasses.field(default_factory=load_threads_from_env)
    routing: object = None
    routing_warmup: int = dataclasses.field(default_factory=routing_warmup_from_env)
    placement_profile: object = dataclasses.field(default_factory=placement_profile_from_env)
    expert_compute: str = "device"
    expert_compute_choice: object = None
    expert_pool: bool = False

    def __post_init__(self):
        if self.budget_gb is not None and self.offload_gb is not None:
            raise ValueError("offtensor: give budget_gb or offload_gb, not both")
        for label, value in (("budget_gb", self.budget_gb), ("offload_gb", self.offload_gb)):
            if value is None:
                continue
            if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(f"offtensor: {label} must be a non-negative number of GiB, got {value!r}")
            if not isinstance(value, (int, float)):
                # numpy's and fractions' numbers as a float: np.int64 * 2**30 would wrap past 8 EiB,
                # np.float32 round the bytes in single precision.
                object.__setattr__(self, label, float(value))
        if not isinstance(self.routing_warmup, int) or isinstance(self.routing_warmup, bool) or self.routing_warmup < 0:
            raise ValueError(f"offtensor: routing_warmup must be a number of routed tokens >= 0, got "
                             f"{self.routing_warmup!r}")

        if not isinstance(self.prefetch, bool):
            raise ValueError(f"offtensor: prefetch must be True or False, got {self.prefetch!r}")
        _check_policy(self.policy)
        if not isinstance(self.expert_pool, bool):
            raise ValueError(f"offtensor: expert_pool must be True or False, got {self.expert_pool!r}")
        if self.expert_compute not in EXPERT_COMPUTE:
            raise ValueError(f"offtensor: expert_compute must be one of {', '.join(map(repr, EXPERT_COMPUTE))}, got "
                             f"{self.expert_compute!r}")

    @classmethod
    def from_arguments(cls, **arguments) -> "OffloadConfig":
        """The settings of a public call's keyword arguments: an argument left at None takes its
        default (for ``strict``, ``progress`` and ``load_threads``: the environment's)."""
        if arguments.get("expert_compute", "") is None:
            arguments = {**arguments, "expert_compute": "device"}
        from_env = ("strict", "progress", "load_threads", "routing_warmup", "placement_profile")
        return cls(**{k: v for k, v in arguments.items() if not (k in from_env and v is None)})

    @property
    def budget_bytes(self) -> Optional[int]:
        return None if self.budget_gb is None else int(self.budget_gb * (1 << 30))

    @property
    def offload_bytes(self) -> Optional[int]:
        return None if self.offload_gb is None else int(self.offload_gb * (1 << 30))

    def replace(self, **changes) -> "OffloadConfig":
        return dataclasses.replace(self, **changes)


def _check_policy(policy) -> None:
    """A policy is None, a callable (weight name -> "offload", "keep" or None), glob patterns of
    the weights to offload (a string or a list of them), or {"offload": patterns, "keep": patterns}:
    anything else is refused here, naming what was given, rather than failing inside placement."""
    if policy is None or callable(policy):
        return
    rules = policy.items() if isinstance(policy, dict) else (("patterns", policy),)
    for key, patterns in rules:
        if patterns is None or isinstance(patterns, str):
            continue
        if not isinstance(patterns, (list, tuple, set, frozenset)) or not all(isinstance(p, str) for p in patterns):
            where = "policy" if key == "patterns" else f"policy[{key!r}]"
            raise ValueError(f"offtensor: {where} must be a glob pattern of weight names or a list of them "
                             f"(such as ['model.layers.*.mlp.*']), got {patterns!r}")
