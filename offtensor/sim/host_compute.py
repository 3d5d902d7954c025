"""The choice of ``expert_compute="auto"``: per MoE layer and step shape, whether a routed expert
that is not cached on the device is copied there and computed (the device) or computed from its
host master (the host), decided by replaying the layer's step both ways under a profile that has
the host's figures (``Profile.host_tflops`` / ``host_gbps``, measured on this machine when the
profile lacks them).

One layer's step at ``tokens`` tokens routes ``tokens * top_k`` rows to ``min(experts, rows)``
distinct experts (uniform routing: what skew would save is not assumed), ``cached_share`` of them on
the device. The device side copies the others (copy stream) and computes every expert on the
compute stream; the host side computes the cached ones on the device first, then the others on the
host lane, each result copied back for the layer's combine. The faster replay wins; the choice is
recorded per layer as ``((rows of one expert, on the host), ...)``, which the op reads for the
expert at hand (``ops.host_experts.host_chosen``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from .profiles import Profile, get_profile, measure_host
from .timeline import Timeline

# Step shapes replayed: tokens per step, from a one-token decode to a long prefill.
STEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
DECODE_TOKENS, PREFILL_TOKENS = 1, 512


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """One MoE layer's routed experts: every stack of its experts module together."""

    group: str  # the experts module's name ("model.layers.1.mlp.experts")
    num_experts: int
    expert_bytes: int  # one expert's bytes, every stack of the layer
    flops_per_row: int  # one routed row through one expert, every stack
    activation_bytes_per_row: int  # a row's inputs and outputs of every stack (to the host and back)
    dtype: str


def layer_shapes(stacks) -> list:
    """``LayerShape``s of ``stacks``: (name, shape, dtype) of every routed expert stack."""
    by_group: dict = {}
    for name, shape, dtype in stacks:
        group = name.rpartition(".")[0]
        per_expert = 1
        for n in shape[1:]:
            per_expert *= n
        itemsize = dtype.itemsize
        entry = by_group.setdefault(group, [shape[0], 0, 0, 0, str(dtype).removeprefix("torch.")])
        entry[1] += per_expert * itemsize
        entry[2] += 2 * per_expert
        entry[3] += (shape[-1] + shape[-2]) * itemsize
    return [LayerShape(g, *v) for g, v in by_group.items()]


def with_host_figures(profile) -> Profile:
    """``profile`` with the host's figures, measured here when it has none."""
    profile = get_profile(profile)
    if profile.host_tflops and profile.host_gbps:
        return profile
    return profile.with_host(**measure_host())


def layer_timeline(shape: LayerShape, tokens: int, top_k: int, cached_share: float, host: bool) -> Timeline:
    """One layer's step at ``tokens`` tokens, its uncached experts computed on the host or the device."""
    rows = tokens * top_k
    distinct = max(1, min(shape.num_experts, rows))
    per_expert = rows / distinct
    cached = min(distinct, int(round(cached_share * distinct)))
    flops = shape.flops_per_row * per_expert
    act = int(shape.activation_bytes_per_row * per_expert)
    tl = Timeline()
    for _ in range(cached):
        tl.add_op(flops, shape.expert_bytes + act, shape.dtype, name="cached expert")
    if not host:
        for _ in range(distinct - cached):
            copy = tl.add_copy(shape.expert_bytes, name="page")
            tl.add_op(flops, shape.expert_bytes + act, shape.dtype, waits=[copy], name="paged expert")
        return tl
    backs = []
    for _ in range(distinct - cached):
        op = tl.add_op(flops, shape.expert_bytes, shape.dtype, name="host expert", stream="host")
        backs.append(tl.add_copy(act, waits=[op], name="host result"))
    tl.add_op(0, act * len(backs), shape.dtype, waits=backs, name="combine")
    return tl


@dataclasses.dataclass(frozen=True)
class ShapeChoice:
    """The replay of one layer at one step shape."""

    tokens: int
    rows_per_expert: float
    host_ms: float
    device_ms: float

    @property
    def on_host(self) -> bool:
        return self.host_ms < self.device_ms

    @property
    def step_ms(self) -> float:
        return min(self.host_ms, self.device_ms)


def choose_layer(shape: LayerShape, profile: Profile, top_k: int, cached_share: float,
                 tokens=STEP_TOKENS) -> list:
    """``ShapeChoice`` of ``shape``'s layer at every step shape in ``tokens``."""
    out = []
    for t in tokens:
        host = layer_timeline(shape, t, top_k, cached_share, True).replay(profile, sync=None).step_ms
        device = layer_timeline(shape, t, top_k, cached_share, False).replay(profile, sync=None).step_ms
        rows = t * top_k / max(1, min(shape.num_experts, t * top_k))
        out.append(ShapeChoice(t, rows, host, device))
    return out


def choice_table(choices: list) -> tuple:
    """The op's table of one layer: ((most rows of one expert, on the host), ...) in increasing rows."""
    table = []
    for c in choices:
        if table and table[-1][0] >= c.rows_per_expert:
            continue  # a shape with no more rows per expert than one before it (experts not all routed yet)
        table.append((c.rows_per_expert, c.on_host))
    return tuple(table)


def choose_expert_compute(stacks, profile, top_k: Optional[int], cached_share: float) -> dict:
    """"auto"'s choice for every MoE layer of ``stacks`` ((name, shape, dtype) of each routed expert
    stack): experts module -> the op's table (``choice_table``)."""
    profile = with_host_figures(profile)
    k = top_k or 1
    cache: dict = {}
    out = {}
    for shape in layer_shapes(stacks):
        same = dataclasses.replace(shape, group="")
        if same not in cache:  # layers of one shape replay alike
            cache[same] = choice_table(choose_layer(shape, profile, k, cached_share))
        out[shape.group] = cache[same]
    return out


def compute_rows(stacks, profile, top_k: Optional[int], cached_share: float,
                 decode: int = DECODE_TOKENS, prefill: int = PREFILL_TOKENS) -> list:
    """Per MoE layer, for ``ot.plan``'s table: (experts module, [(step name, tokens, choice, step ms,
    host ms, device ms)] for a decode step and a prefill)."""
    profile = with_host_figures(profile)
    rows = []
    for shape in layer_shapes(stacks):
        shapes = choose_layer(shape, profile, top_k or 1, cached_share, (decode, prefill))
        rows.append((shape.group, [(name, c.tokens, "host" if c.on_host else "device", c.step_ms, c.host_ms, c.device_ms)
                                   for name, c in zip(("decode", "prefill"), shapes)]))
    return rows


def cached_share(placed, stack_groups) -> float:
    """The share of the routed experts' bytes that the budget holds beside the resident weights."""
    expert_bytes = sum(g.nbytes for g in stack_groups)
    if not expert_bytes:
        return 1.0
    resident = sum(g.nbytes for g in placed.resident if not any(g is s for s in stack_groups))
    room = max(0, placed.budget_bytes - resident)
    return max(0.0, min(1.0, room / expert_bytes))
