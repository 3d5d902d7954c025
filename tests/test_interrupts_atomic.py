"""Ctrl-C and fork lose nothing in a wrap or a load.

- An interrupt (``KeyboardInterrupt``) at any bytecode of ``wrap_model`` or ``load_safetensors``
  leaves the model exactly as it was (the same tensor objects, classes and values, not wrapped),
  frees the host memory the attempt allocated, and the next wrap or load works. Interrupts are
  raised by ``sys.settrace`` at the n-th opcode executed in offtensor's frames, n sampled (seeded).
- A second interrupt inside the roll-back is survived; an interrupted reader never closes a
  descriptor twice; a threaded load interrupted by signals stops its workers before it returns,
  and raises the KeyboardInterrupt even where the stdlib's Condition.wait turns it into another error.
- ``fork()`` while another thread runs forwards: the child's forward finishes with the parent's
  output (``offtensor.forking``); while another thread holds the lock of ``from_pretrained``'s
  build hooks: the child's own ``from_pretrained`` loads.
"""

from __future__ import annotations

import gc
import inspect
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
from offtensor import _ext
from offtensor.loading import read as _read
from offtensor.model import copies as _copies
from offtensor.model import moves as _moves

from test_reliability import GiB, _assert_unchanged, _inputs, _meta_model, _nbytes, _reference, _snapshot

OFFTENSOR_DIR = os.path.dirname(ot.__file__) + os.sep


class _InterruptAt:
    """A ``sys.settrace`` tracer raising ``KeyboardInterrupt`` at the ``n``-th opcode executed in
    frames whose code passes ``where`` (offtensor's files by default); n < 0 only counts."""

    def __init__(self, n, where=None):
        self.n, self.count = n, 0
        self.where = where or (lambda code: code.co_filename.startswith(OFFTENSOR_DIR))

    def __call__(self, frame, event, arg):
        if self.where(frame.f_code):
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            return self.local
        return None

    def local(self, frame, event, arg):
        if event == "opcode":
            self.count += 1
            if self.count == self.n:
                raise KeyboardInterrupt(f"injected at opcode {self.n}")
        return self.local


def _traced(tracer, run):
    """Run ``run()`` under ``tracer``; whether it was interrupted."""
    sys.settrace(tracer)
    try:
        run()
        return False
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(None)


def _opcodes(run, where=None) -> int:
    counter = _InterruptAt(-1, where)
    _traced(counter, run)
    return counter.count


def _wrap(model):
    budget = int(_nbytes(model) * 0.4)
    return ot.wrap_model(model, budget_gb=budget / GiB, device="cpu", policy={"offload": ["layers.*"]})


def _check_interrupted(model, before, live_before, forward=None, want=None) -> None:
    """Either the interrupt came after the wrap or load completed (then it is whole: outputs
    agree), or the model is exactly as it was and holds no host memory from the attempt."""
    if _copies.is_wrapped(model):
        if forward is not None:
            with torch.no_grad():
                assert torch.equal(forward(model), want)
        return
    _assert_unchanged(model, before)
    # At most what was live before: a model of an earlier attempt may be collected meanwhile.
    assert _ext.live_host_bytes() <= live_before, "the interrupted placement kept host memory"


def test_an_interrupt_at_any_bytecode_of_a_wrap_leaves_the_model_as_it_was():
    """200 sampled opcodes of a wrap. On main an interrupt between a swap and its note in the
    undo record left a weight an OffloadedTensor on a model not wrapped (16 of 3000)."""
    x = _inputs("cpu", 1)[0]
    total = _opcodes(lambda: _wrap(_reference()))
    for n in sorted(random.Random(0).sample(range(1, total + 1), 200)):
        model = _reference()
        with torch.no_grad():
            want = model(x)
        live_before, before = _ext.live_host_bytes(), _snapshot(model)
        _traced(_InterruptAt(n), lambda: _wrap(model))
        _check_interrupted(model, before, live_before, lambda m: m(x), want)
        if not _copies.is_wrapped(model):
            _wrap(model)  # not "already wrapped", and whole
            with torch.no_grad():
                assert torch.equal(model(x), want), n
        del model
    gc.collect()


def test_a_second_interrupt_inside_the_roll_back_is_survived(monkeypatch):
    """An interrupt late in a wrap, then a second one at each of the roll-back's first opcodes:
    the roll-back finishes (a step interrupted is undone again) and the model is as it was."""
    total = _opcodes(lambda: _wrap(_reference()))
    original = _moves.Undo.roll_back
    second = {"n": 0}

    # Counted in the undo steps the roll-back calls, not in the roll-back's own loop, which is
    # what catches them.
    in_steps = lambda code: code is not original.__code__ and code.co_filename.startswith(OFFTENSOR_DIR)  # noqa: E731

    def interrupted_roll_back(self):
        sys.settrace(_InterruptAt(second["n"], in_steps))
        try:
            original(self)
        finally:
            sys.settrace(None)

    monkeypatch.setattr(_moves.Undo, "roll_back", interrupted_roll_back)
    # An interrupt that lands in a finalizer run by the roll-back (a master dying) is ignored by
    # Python; pytest's hook for such exceptions would keep their tracebacks (and the masters) alive.
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    x = _inputs("cpu", 1)[0]
    for m in range(1, 300, 4):
        second["n"] = m
        model = _reference()
        with torch.no_grad():
            want = model(x)
        live_before, before = _ext.live_host_bytes(), _snapshot(model)
        assert _traced(_InterruptAt(int(total * 0.75)), lambda: _wrap(model))
        _check_interrupted(model, before, live_before)
        with torch.no_grad():
            assert torch.equal(model(x), want)


@pytest.fixture
def checkpoint(tmp_path):
    from safetensors.torch import save_file

    reference = _reference()
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    return reference, path


def _loader(path, budget, threads):
    def load(model):
        return ot.load_safetensors(model, path, budget_gb=budget / GiB, device="cpu",
                                   policy={"offload": ["layers.*"]}, threads=threads, progress=False)
    return load


def _in_grad_mode_switch(code) -> bool:
    """torch.no_grad's own enter and exit (and set_grad_enabled's), where grad goes off and on."""
    return code.co_filename.endswith(os.path.join("autograd", "grad_mode.py"))


@pytest.mark.parametrize("what", ["wrap", "load"])
def test_an_interrupt_inside_no_grad_of_a_wrap_or_load_leaves_grad_mode_as_it_was(checkpoint, what):
    """An interrupt at sampled opcodes of torch.no_grad's enter and exit inside a wrap or a load:
    before, one that landed after grad went off but before the ``with`` took hold left grad off
    for the rest of the thread (a later training step: "does not require grad")."""
    reference, path = checkpoint
    if what == "wrap":
        run, make = _wrap, _reference
    else:
        run, make = _loader(path, int(_nbytes(reference) * 0.4), 1), _meta_model
    model = make()  # built outside the trace: torch's own init runs no_grad too
    total = _opcodes(lambda: run(model), _in_grad_mode_switch)
    assert total > 0
    for n in sorted(random.Random(3).sample(range(1, total + 1), min(total, 150))):
        model = make()
        _traced(_InterruptAt(n, _in_grad_mode_switch), lambda: run(model))
        assert torch.is_grad_enabled(), f"grad mode left off by an interrupt at opcode {n} of {total}"


def _finishes(run, timeout=20.0) -> bool:
    """Whether ``run()`` returns within ``timeout`` (in a thread, so that a hang fails the test)."""
    done = []
    thread = threading.Thread(target=lambda: done.append(run()), daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(done)


@pytest.mark.parametrize("threads", [1, 4])
def test_an_interrupt_at_any_bytecode_of_a_load_leaves_the_model_as_it_was(checkpoint, threads):
    """120 sampled opcodes of the main thread's load: the meta model is untouched and not wrapped,
    the host memory read so far is freed, no worker is left running and the next load finishes."""
    reference, path = checkpoint
    load = _loader(path, int(_nbytes(reference) * 0.4), threads)
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = reference(x)
    total = _opcodes(lambda: load(_meta_model()))
    for n in sorted(random.Random(threads).sample(range(1, total + 1), 120)):
        model = _meta_model()
        live_before, before = _ext.live_host_bytes(), _snapshot(model)
        _traced(_InterruptAt(n), lambda: load(model))
        assert not [t for t in threading.enumerate() if t.name.startswith("offtensor-load")]
        _check_interrupted(model, before, live_before, lambda m: m(x), want)
        del model
    model = _meta_model()
    assert _finishes(lambda: load(model))
    with torch.no_grad():
        assert torch.equal(model(x), want)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_an_interrupted_reader_never_closes_a_descriptor_twice(checkpoint):
    """An interrupt at every opcode of the reader's ``discard``, whose failure path runs it again:
    never ``OSError: Bad file descriptor`` (on main: an interrupt between ``os.close`` and clearing
    the table closed the descriptor twice), at most one descriptor leaked, and the next load works."""
    reference, path = checkpoint
    load = _loader(path, int(_nbytes(reference) * 0.4), 1)
    in_discard = lambda code: code is _read.Reader.discard.__code__  # noqa: E731
    total = _opcodes(lambda: load(_meta_model()), in_discard)
    assert total > 0
    for n in range(1, total + 1):
        fds = _open_fds()
        model = _meta_model()
        try:
            _traced(_InterruptAt(n, in_discard), lambda: load(model))
        except OSError as error:  # the double close
            pytest.fail(f"interrupt at opcode {n} of discard: {error!r}")
        assert _open_fds() - fds <= 1
    model = _meta_model()
    load(model)
    assert _copies.is_wrapped(model)


class _Wide(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


@pytest.fixture
def wide(tmp_path):
    """A seeded ``_Wide``, its checkpoint, and a threaded load of it into a model on
    meta: (reference, load(model) -> None, a new model on meta)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = _Wide().eval()
    path = tmp_path / "wide.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))

    def meta():
        with torch.device("meta"):
            return _Wide()

    def load(model):
        ot.load_safetensors(model, path, budget_gb=1e6 / GiB, device="cpu", policy={"offload": ["layers.*"]},
                            threads=4, progress=False)

    return reference, load, meta


def test_a_threaded_load_interrupted_by_signals_stops_its_workers_before_it_returns(wide, monkeypatch):
    """A storm of SIGALRM -> KeyboardInterrupt while the pool reads: once the load raises, no
    worker still reads (on main a second interrupt during the pool's shutdown returned with workers
    reading from descriptors the load then closed), and the next load finishes with right values."""
    reference, load, meta = wide

    armed = [False]  # only while load() runs: a signal still pending after the loop's cancel is dropped

    def interrupt(signum, frame):
        if armed[0] and frame is not None and frame.f_code.co_filename != __file__:  # inside the load
            raise KeyboardInterrupt("SIGALRM")

    # An interrupt that lands in a finalizer is ignored by Python; pytest would report it.
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    start = time.perf_counter()
    load(meta())
    seconds = time.perf_counter() - start
    previous = signal.signal(signal.SIGALRM, interrupt)
    rng = random.Random(0)
    try:
        for _ in range(20):
            model = meta()
            try:
                armed[0] = True
                signal.setitimer(signal.ITIMER_REAL, rng.uniform(0, seconds), max(seconds / 20, 1e-3))
                load(model)
            except KeyboardInterrupt:
                pass
            finally:
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
            assert not [t for t in threading.enumerate() if t.name.startswith("offtensor-load") and t.is_alive()]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    model = meta()
    assert _finishes(lambda: load(model))
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


class _InterruptInConditionWait:
    """A tracer raising ``KeyboardInterrupt`` in the ``n``-th ``threading.Condition.wait`` of the
    calling thread, on the line after it releases its lock and before its ``try``: the window where
    CPython turns a Ctrl-C into "release unlocked lock" in the caller's ``with``; n < 0 only counts."""

    def __init__(self, n):
        self.n, self.count = n, 0
        lines, first = inspect.getsourcelines(threading.Condition.wait)
        released = next(i for i, line in enumerate(lines) if "= self._release_save()" in line)
        self.line = first + released + 1

    def __call__(self, frame, event, arg):
        return self.local if frame.f_code is threading.Condition.wait.__code__ else None

    def local(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.line:
            self.count += 1
            if self.count == self.n:
                raise KeyboardInterrupt(f"injected in Condition.wait {self.n}")
        return self.local


def test_an_interrupt_where_a_condition_wait_has_released_its_lock_stops_a_threaded_load_as_a_ctrl_c(wide):
    """A thread's start, a future's wait and a queue's get wait on a Condition; a Ctrl-C between its
    release and its ``try`` surfaces from the stdlib as "release unlocked lock". The load raises the
    KeyboardInterrupt itself, with no worker left reading, and the next load finishes right."""
    reference, load_into, meta = wide

    def load():
        model = meta()
        load_into(model)
        return model

    interrupted = 0
    for n in range(1, 100):  # the n-th wait until a load has fewer (how many varies with the threads)
        tracer = _InterruptInConditionWait(n)
        sys.settrace(tracer)
        try:
            load()
            break
        except KeyboardInterrupt as error:
            assert str(error) == f"injected in Condition.wait {n}"
            interrupted += 1
        finally:
            sys.settrace(None)
        assert not [t for t in threading.enumerate() if t.name.startswith("offtensor-load") and t.is_alive()]
    assert tracer.count < n and interrupted >= 4  # at least each worker's start was cut
    model = load()
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def _in_progress_bar(code) -> bool:
    """Code the main thread runs to create or close a load's progress bar: tqdm's, and the bar's own."""
    import tqdm

    return (code.co_filename.startswith(os.path.dirname(tqdm.__file__) + os.sep)
            or code.co_qualname.endswith(("Progress.__init__", "Progress.close")) or code.co_name == "_off_this_thread")


def test_a_default_load_interrupted_in_its_progress_bar_leaves_the_next_load_free_to_finish(tmp_path, monkeypatch):
    """A load with the default arguments (the pool of readers, a progress bar: its threshold is
    lowered here) interrupted at sampled opcodes the main thread runs in the bar's creation or close:
    after each, a load in another thread finishes. On main the interrupt could land between the two
    acquires of tqdm's class-wide lock, or inside it, leaving it held by the main thread: the next
    load's reader blocked on it for good, updating its bar."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    reference = _Wide().eval()
    path = tmp_path / "wide.safetensors"
    save_file({k: v.contiguous() for k, v in reference.state_dict().items()}, str(path))
    monkeypatch.setattr(_read, "PROGRESS_MIN_BYTES", 0)
    # A bar an interrupt left unclosed is closed by tqdm's finalizer, which the tracer may interrupt
    # too; Python ignores that, pytest would report it.
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)

    def meta():
        with torch.device("meta"):
            return _Wide()

    def load(model):
        return ot.load_safetensors(model, path, budget_gb=1e6 / GiB, device="cpu", policy={"offload": ["layers.*"]})

    counter = _InterruptAt(-1, _in_progress_bar)
    sys.settrace(counter)
    try:
        load(meta())
    finally:
        sys.settrace(None)
    assert counter.count > 0
    for n in range(1, counter.count + 1, max(1, counter.count // 60)):
        sys.settrace(_InterruptAt(n, _in_progress_bar))
        try:
            load(meta())
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        assert _finishes(lambda: load(meta()), timeout=5.0), f"a load after an interrupt at opcode {n} hung"
    model = meta()
    assert _finishes(lambda: load(model))
    x = torch.randn(2, 256)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


def _child_forward(model, x, want) -> int:
    """In the forked child: one forward within 10 s, its exit status (0: the parent's output)."""
    signal.alarm(10)
    try:
        with torch.no_grad():
            return 0 if torch.equal(model(x), want) else 1
    except BaseException:
        return 2


def _wait_child(pid, timeout=20.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_runs_forwards_gives_the_child_a_working_model():
    """8 forks while a thread runs forwards of a wrapped model: each child's forward finishes with
    the parent's output. On main the child hung on the pager's lock, held by the parent's thread
    (8 of 10 forks)."""
    reference = _reference()
    model = _reference()
    _wrap(model)
    x = _inputs("cpu", 1)[0]
    with torch.no_grad():
        want = reference(x)
    stop = threading.Event()

    def forwards():
        with torch.no_grad():
            while not stop.is_set():
                model(x)

    thread = threading.Thread(target=forwards, daemon=True)
    thread.start()
    statuses = []
    try:
        for _ in range(8):
            time.sleep(0.01)
            pid = os.fork()
            if pid == 0:
                os._exit(_child_forward(model, x, want))
            statuses.append(_wait_child(pid))
    finally:
        stop.set()
        thread.join()
    assert statuses == [0] * 8
    with torch.no_grad():
        assert torch.equal(model(x), want)  # the parent is unaffected


class _Forwards(torch.utils.data.Dataset):
    """Each item a forward of the wrapped model, run in a DataLoader worker."""

    def __init__(self, model, inputs):
        self.model, self.inputs = model, inputs

    def __len__(self):
        return len(self.inputs)

    def __getitem__(self, i):
        with torch.no_grad():
            return self.model(self.inputs[i])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_dataloader_workers_forked_from_a_wrapped_model_run_its_forward():
    """A torch DataLoader with two workers started by fork, each item a forward of the wrapped model
    (its pager, copy engine and cached copies forked with it, the prefetcher on): every item equals
    the unwrapped model's, and the parent's model runs after."""
    import multiprocessing

    reference, model = _reference(), _reference()
    _wrap(model)
    inputs = _inputs("cpu", 6)
    with torch.no_grad():
        model(inputs[0])  # a warm cache to fork
        want = [reference(x) for x in inputs]
    loader = torch.utils.data.DataLoader(_Forwards(model, inputs), batch_size=None, num_workers=2,
                                         multiprocessing_context=multiprocessing.get_context("fork"), timeout=60)
    got = list(loader)
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    with torch.no_grad():
        assert torch.equal(model(inputs[1]), want[1])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_fork_while_another_thread_enters_a_from_pretrained_build_lets_the_child_load(tmp_path, monkeypatch):
    """A fork while another thread is inside ``from_pretrained``'s entry into its meta build (it holds
    the process-wide lock of that block's hooks, ``loading/scoped.py``): the child's own
    ``from_pretrained`` loads the checkpoint and gives the parent's logits within 10 s, and the
    parent's thread finishes its load. On main the child waited on that lock forever."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from offtensor.loading import scoped

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    load = lambda: ot.from_pretrained(tmp_path, budget_gb=4096 / GiB, device="cpu", progress=False)  # noqa: E731
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        want = load()(ids).logits
    inside, go_on, loaded = threading.Event(), threading.Event(), []
    register = dict(scoped._REGISTER)

    def paused(kind):
        def hook_registered(hook):
            if threading.current_thread() is thread:  # the parent's thread, holding the block's lock
                inside.set()
                go_on.wait(20)
            return register[kind](hook)
        return hook_registered

    for kind in register:
        monkeypatch.setitem(scoped._REGISTER, kind, paused(kind))
    thread = threading.Thread(target=lambda: loaded.append(load()), daemon=True)
    thread.start()
    try:
        assert inside.wait(20)
        pid = os.fork()
        if pid == 0:
            signal.alarm(10)
            try:
                with torch.no_grad():
                    os._exit(0 if torch.equal(load()(ids).logits, want) else 1)
            except BaseException:
                os._exit(2)
        status = _wait_child(pid, timeout=20)
    finally:
        go_on.set()
        thread.join(30)
    assert status == 0
    with torch.no_grad():
        assert loaded and torch.equal(loaded[0](ids).logits, want)
