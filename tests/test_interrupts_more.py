"""Ctrl-C and fork on the paths the other interrupt tests do not walk.

- ``fork()`` in strict mode (``OFFTENSOR_STRICT=1``, the strict copy engine's worker renewed in the
  child), and while another thread adopts an orphaned weight: the child's forward finishes, right.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time

import pytest
import torch

import offtensor as ot
from offtensor.pager import Pager

from test_interrupts_atomic import _wait_child
from test_reliability import GiB, _inputs, _nbytes, _reference

needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _wrap(model):
    budget = int(_nbytes(model) * 0.4)
    return ot.wrap_model(model, budget_gb=budget / GiB, device="cpu", policy={"offload": ["layers.*"]})


def _in_child(run) -> int:
    """Fork; the child runs ``run()`` (True: right) with 10 s to do it. Its exit status: 0 right,
    1 wrong, 2 raised, -1 hung."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(10)
        try:
            os._exit(0 if run() else 1)
        except BaseException:
            os._exit(2)
    return _wait_child(pid)


@needs_fork
def test_a_forked_child_of_a_strict_model_runs_its_forward(monkeypatch):
    """On main the strict copy engine's worker got a condition over a new lock in the child while
    its sections kept taking the old one: the child's first copy raised "cannot notify on
    un-acquired lock"."""
    monkeypatch.setenv("OFFTENSOR_STRICT", "1")
    model, reference = _reference(), _reference()
    _wrap(model)
    assert ot.stats(model).page_ins == 0 and model.layers[0].weight._master.pager.strict
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = reference(x)
        assert torch.equal(model(x), want)  # the strict worker runs in the parent

        def forward():
            return torch.equal(model(x), want)

        assert _in_child(forward) == 0
        assert torch.equal(model(x), want)


@needs_fork
def test_a_fork_while_a_thread_adopts_an_orphaned_weight_leaves_the_child_free_to_use_one():
    """A state-dict value outlives its model: its first use charges it to the default pager, under
    ``Master._adopting``. A thread doing so waits there for the default pager's lock (held by
    another op); forked then, the child on main found ``_adopting`` held for good and hung."""
    model = _reference()
    _wrap(model)
    state = model.state_dict()
    w0, w1 = state["layers.0.weight"], state["layers.1.weight"]
    want = w1.detach().clone() * 2
    del model, state
    gc.collect()
    default = Pager.default(torch.device("cpu"))
    adopting = threading.Thread(target=lambda: w0 + 1, daemon=True)
    with default.lock:  # an op of another thread on the default pager
        adopting.start()
        time.sleep(0.2)  # the thread now holds _adopting, waiting for the lock
        status = _in_child(lambda: torch.equal(w1 * 2, want))
    adopting.join(10)
    assert status == 0
    assert torch.equal(w1 * 2, want)
