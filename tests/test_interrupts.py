"""Interrupts while a wrapped model pages: a KeyboardInterrupt at any bytecode of the paging path,
and a seeded storm of them from a timer, leave the pager exactly consistent.

Consistent means: no cached copy counted in use, the paged bytes equal to the cached copies', the
arena's live ranges exactly the cached copies' and its free ranges the rest (no range lost, none
both free and in use), the pager's lock free for another thread, and the next forward equal to the
unwrapped model's.
"""

from __future__ import annotations

import copy
import opcode
import os
import random
import signal
import sys
import threading
import time

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor.model.copies import state_of

HERE = os.path.dirname(os.path.abspath(ot.__file__))
# The paging path: every function of the pager package and the op's record (ops/paging.py).
PAGING_FILES = {os.path.join(HERE, "ops", "paging.py")} | {
    os.path.join(HERE, "pager", name) for name in os.listdir(os.path.join(HERE, "pager")) if name.endswith(".py")
}


def _pager(model):
    return state_of(model).pager


def _lock_is_free(pager) -> bool:
    got = []

    def take():
        if pager.lock.acquire(timeout=5):
            pager.lock.release()
            got.append(True)

    thread = threading.Thread(target=take)
    thread.start()
    thread.join(10)
    return got == [True]


def assert_consistent(pager) -> None:
    cached = list(pager.cache.entries.values())
    assert [entry.key for entry in cached if entry.users] == []
    assert pager.budget.paged_bytes == sum(entry.nbytes for entry in cached)
    by_master = {}
    for entry in cached:
        by_master.setdefault(entry.key[0], []).append(entry)
    assert {m: sorted(map(id, es)) for m, es in pager.cache.by_master.items()} == \
        {m: sorted(map(id, es)) for m, es in by_master.items()}
    pool = pager.pool
    if pool is not None:
        live = [entry.slot for entry in cached if entry.slot is not None]
        assert len({id(s) for s in live}) == len(live), "a slot counted twice"
        assert pool.overflow_bytes == sum(slot.nbytes for slot in live if slot.start is None)
        if pool.arena is not None:
            assert_arena_consistent(pool.arena, [slot for slot in live if slot.start is not None])
    assert pager.lock._recursion_count() == 0 and _lock_is_free(pager)


def assert_arena_consistent(arena, live) -> None:
    """The arena's live ranges are ``live``'s slots, and they and the free ranges tile the arena:
    nothing in use counted free, nothing lost, the index by size in step."""
    assert sorted(arena.live) == sorted(slot.start for slot in live)
    assert all(arena.live[slot.start] is slot for slot in live)
    assert arena.live_bytes == sum(slot.size for slot in live)
    edge = 0
    for start, end, slot in arena.blocks():
        assert start == edge, f"a gap or an overlap at {start} (expected {edge})"
        edge = end
    assert edge == arena.capacity
    free = {start: end for start, (end, _) in arena._free.items()}
    assert {(start, end - start) for start, end in free.items()} == \
        {(start, size) for size, starts in arena._by_size.items() for start in starts}
    assert arena._sizes == sorted(arena._by_size)


# Where CPython raises a signal handler's exception in a frame (it checks for pending signals there):
# on entering a function, after a call returns, at a loop's back edge. Synchronous exceptions (a hook's,
# an observer's, a dispatch mode's) also surface after a call, so these points are every point where an
# exception can strike. ``with lock:`` is atomic for them: its exit has no such point before the
# release, as CPython intends.
_AFTER = {opcode.opmap[name] for name in ("CALL", "CALL_FUNCTION_EX", "JUMP_BACKWARD", "JUMP_BACKWARD_NO_INTERRUPT")
          if name in opcode.opmap}


def _interrupt_at(n: int, fn, files=PAGING_FILES) -> bool:
    """Run ``fn`` raising KeyboardInterrupt at the ``n``-th point of the paging path (``files``)
    where an exception can strike; whether it was interrupted (False: ``fn`` passed fewer points)."""
    count = [0]
    previous = {}  # frame -> the opcode it executed last

    def local(frame, event, arg):
        if event == "opcode":
            last = previous.get(frame)
            previous[frame] = frame.f_code.co_code[frame.f_lasti]
            if last is None or last in _AFTER:
                count[0] += 1
                if count[0] == n:
                    raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_filename in files:
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return local
        return None

    sys.settrace(tracer)
    try:
        fn()
        return False
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)
        previous.clear()


def _dense(seed: int = 0):
    torch.manual_seed(seed)
    reference = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64)).eval()
    model = copy.deepcopy(reference)
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    # Room for about two of the three layers: each forward evicts, pages in and prefetches.
    ot.wrap_model(model, budget_gb=0.7 * weights / (1 << 30), device="cpu")
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(seed + 1))
    return model, reference, (x,)


def _moe(monkeypatch, seed: int = 0):
    from offtensor.models import DeepSeekConfig, DeepSeekForCausalLM
    from offtensor.moe import speculation

    monkeypatch.setattr(speculation, "SPECULATE_COPY", True)  # routing guesses copy their experts ahead
    config = DeepSeekConfig(
        vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, q_lora_rank=0, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=64, intermediate_size=128, first_k_dense_replace=1,
    )
    reference = DeepSeekForCausalLM.empty(config).init_weights(seed=seed).eval()
    model = copy.deepcopy(reference)
    weights = sum(p.numel() * p.element_size() for p in reference.parameters())
    ot.wrap_model(model, budget_gb=0.5 * weights / (1 << 30), device="cpu")
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(seed + 1))
    return model, reference, (ids,)


def _logits(out):
    return out if isinstance(out, torch.Tensor) else out.logits if hasattr(out, "logits") else out[0]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")
@torch.no_grad()
def test_interrupt_at_any_bytecode_of_paging_leaves_the_pager_consistent():
    model, reference, args = _dense()
    expected = reference(*args)
    pager = _pager(model)
    assert torch.equal(model(*args), expected)  # warm: the prefetch schedule is recorded
    n, interrupted = 0, True
    while interrupted:
        n += 1
        interrupted = _interrupt_at(n, lambda: model(*args))
        assert_consistent(pager)
        assert torch.equal(model(*args), expected), f"after an interrupt at bytecode {n}"
    assert n > 100  # the whole paging path of a forward was walked, point by point


# The MoE path besides: the expert policy (eviction, guesses, their hooks) and the grouped GEMM's op.
MOE_FILES = PAGING_FILES | {os.path.join(HERE, "ops", "grouped.py")} | {
    os.path.join(HERE, "moe", name) for name in os.listdir(os.path.join(HERE, "moe")) if name.endswith(".py")
}


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")
@torch.no_grad()
def test_interrupt_at_bytecodes_of_an_moe_forward_leaves_the_pager_and_its_expert_policy_working(monkeypatch):
    """Every 29th point of an MoE forward's paging and expert policy (some 7,000 points: router
    hooks, guesses copied ahead, victim searches), walked to the end."""
    model, reference, args = _moe(monkeypatch)
    expected = _logits(reference(*args))
    pager = _pager(model)
    assert torch.equal(_logits(model(*args)), expected)  # warm: the routers' order and stacks are learned
    n, walked = 1, 0
    while _interrupt_at(n, lambda: model(*args), MOE_FILES):
        assert_consistent(pager)
        assert torch.equal(_logits(model(*args)), expected), f"after an interrupt at point {n}"
        n, walked = n + 29, walked + 1
    assert walked > 100
    assert ot.stats(model).experts  # the expert cache still keeps its books


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the points are 3.11's bytecodes")
@torch.no_grad()
def test_interrupt_inside_page_leaves_no_entry_in_use():
    # A cold cache: every page is a miss that evicts, copies and waits.
    model, reference, args = _dense(seed=3)
    expected = reference(*args)
    pager = _pager(model)
    for n in range(1, 400, 7):
        pager.clear()
        if not _interrupt_at(n, lambda: model(*args)):
            break
        assert_consistent(pager)
    assert torch.equal(model(*args), expected)
    assert_consistent(pager)


def _storm(model, args, seconds: float, seed: int) -> int:
    """Forwards of ``model`` under KeyboardInterrupts from a timer at random intervals, for
    ``seconds``; returns how many interrupted a forward."""
    rng = random.Random(seed)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    interrupts = 0
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            try:
                # One shot, armed inside the try: on a loaded machine it can fire at the very next
                # bytecode, which outside the try would end the test instead of one forward.
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0.0002, 0.004))
                # An interrupt raised inside a gc callback is unraisable: printed and lost (hypothesis
                # installs one once any property test has run in this process). Forwards that see
                # none for a second disarm the timer, still inside the try, and the storm goes on.
                lost = time.monotonic() + 1.0
                while time.monotonic() < lost:
                    model(*args)
                signal.setitimer(signal.ITIMER_REAL, 0)
            except KeyboardInterrupt:
                interrupts += 1
            except RuntimeError as error:
                # Strict mode's copy engine waits on a threading.Condition, whose wait CPython does
                # not make interrupt-safe: an interrupt between its release and its try surfaces from
                # the `with` as this error instead. The pager must stay consistent all the same.
                if "un-acquired lock" not in str(error):
                    raise
                interrupts += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return interrupts


def _forward_from_another_thread(model, args):
    out = []
    thread = threading.Thread(target=lambda: out.append(model(*args)))
    thread.start()
    thread.join(30)
    assert out, "a forward from another thread did not finish"
    return out[0]


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
@pytest.mark.parametrize("kind", ["dense", "moe"])
@torch.no_grad()
def test_interrupt_storm_leaves_outputs_threads_and_stats_intact(kind, monkeypatch):
    model, reference, args = _dense() if kind == "dense" else _moe(monkeypatch)
    expected = _logits(reference(*args))
    assert torch.equal(_logits(model(*args)), expected)
    interrupts = _storm(model, args, seconds=2.0, seed=7)
    assert interrupts > 50
    pager = _pager(model)
    assert_consistent(pager)
    assert torch.equal(_logits(model(*args)), expected)
    assert torch.equal(_logits(_forward_from_another_thread(model, args)), expected)
    stats = ot.stats(model)
    assert stats.peak_device_bytes <= stats.budget_bytes
    assert_consistent(pager)
