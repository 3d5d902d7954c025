"""Timelines: what a step does on the copy stream and the compute stream, and how long it takes on a GPU.

A ``Timeline`` (timeline.py) is a list of records in issue order. A record is a copy (host->device,
on the copy stream, or on the compute stream for a copy the op waits for in line) or an op (a kernel
on the compute stream), with its bytes, its FLOPs (``torch.utils.flop_counter``'s formulas), the
step (forward) it was issued in and ``waits``: the ids of the records it cannot start before (the
copy an op reads; the op whose block a copy reuses). ``replay(profile)`` schedules the records on
two in-order streams under a ``Profile`` (profiles.py: H2D bandwidth, dense TFLOP/s per dtype, HBM
bandwidth, a per-op overhead), which is what a GPU does with two CUDA streams and events.

Three ways to get a timeline:

- ``with ot.timeline(model) as tl: model(x)`` (recording.py; the mode in recorder.py) records a real run (emulated device or
  GPU): a ``TorchDispatchMode`` sees every op, including ops on plain resident tensors, and the
  pager tells the recorder about every copy, every use of a paged copy, every release and every
  eviction;
- ``ot.plan(model, budget_gb=..., example_inputs=...)`` (plan.py) runs the same placement, pager and
  prefetcher on the meta device: nothing is allocated or computed, the decisions are the GPU's;
- ``Timeline()`` and ``add_copy`` / ``add_op`` write a schedule by hand (tests/test_calibration.py).

Measured MoE routing (``RoutingStats``) lives in ``offtensor.moe``; twins.py holds the meta twin of a model that
has values, which the expert-placement replay (plan.py: ``faster_expert_placement``) plans.
"""
