"""The native extension's contract: exact-size host memory, the copy engine, and the pure-PyTorch
fallback when the extension is missing."""

import gc
import json
import os
import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from offtensor import _ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20

native_only = pytest.mark.skipif(not _ext.NATIVE, reason="offtensor._C is not built")
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


class gc_disabled:
    """Frees by reference counting alone, so a test sees the moment the last reference dies."""

    def __enter__(self):
        self.was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()

    def __exit__(self, *exc):
        if self.was_enabled:
            gc.enable()


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )


# ------------------------------------------------------------------------------------------------
# Ops


@native_only
def test_alloc_host_op_passes_opcheck():
    # alloc_host is a factory: with no tensor input, test_autograd_registration has nothing to check
    # and passes vacuously; the other utils compare the fake kernel and schema with the real op.
    for nbytes in (0, 1, 4096, 3 * 4096 + 17):
        torch.library.opcheck(torch.ops.offtensor.alloc_host.default, (nbytes, False))


@native_only
def test_copy_async_op_passes_opcheck():
    # Not test_aot_dispatch_dynamic: functionalization would run the copy into a clone of dst and
    # copy the clone back at once, before the worker has finished. The op is for eager use only.
    ticket_base = 1 << 40  # far above the tickets CopyEngine hands out in this process
    for i, (dtype, shape) in enumerate([(torch.float32, (7, 5)), (torch.bfloat16, (0,)), (torch.uint8, (4096,))]):
        src = torch.arange(torch.Size(shape).numel()).to(dtype).reshape(shape)
        dst = torch.zeros(shape, dtype=dtype)
        torch.library.opcheck(torch.ops.offtensor.copy_async.default, (dst, src, ticket_base + i, 0),
                              test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
        torch.ops.offtensor.copy_wait(ticket_base + i)


@native_only
def test_alloc_host_is_fake_under_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    before = _ext.live_host_bytes()
    with FakeTensorMode():
        fake = torch.ops.offtensor.alloc_host(123 * MiB, True)
    assert isinstance(fake, FakeTensor) and fake.shape == (123 * MiB,) and fake.dtype == torch.uint8
    assert _ext.live_host_bytes() == before


def test_cuda_device_count_never_raises():
    count = _ext.cuda_device_count()
    assert isinstance(count, int) and count >= 0
    if not torch.cuda.is_available():
        assert count == 0


# ------------------------------------------------------------------------------------------------
# Host memory


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 3 * MiB + 5, 17 * MiB + 1])
def test_alloc_host_is_exact_size_page_aligned_uint8(nbytes):
    t = _ext.alloc_host(nbytes, pin=True)
    assert t.shape == (nbytes,) and t.dtype == torch.uint8 and t.device.type == "cpu"
    assert t.untyped_storage().nbytes() == nbytes
    if _ext.NATIVE:
        assert t.data_ptr() % 4096 == 0
    t.fill_(3)  # every byte is writable
    assert int(t[-1]) == 3


def test_alloc_host_of_zero_bytes_is_an_empty_tensor():
    before = _ext.live_host_bytes()
    t = _ext.alloc_host(0, pin=True)
    assert t.shape == (0,) and t.dtype == torch.uint8 and t.nbytes == 0
    assert _ext.live_host_bytes() == before


def test_alloc_host_rejects_negative_sizes():
    with pytest.raises((ValueError, RuntimeError), match="-5"):
        _ext.alloc_host(-5, pin=False)


def test_live_host_bytes_falls_back_exactly_once_the_last_view_dies():
    nbytes = 5 * MiB + 123
    with gc_disabled():
        before = _ext.live_host_bytes()
        base = _ext.alloc_host(nbytes, pin=False)
        assert _ext.live_host_bytes() == before + nbytes
        view = base[MiB:2 * MiB].view(torch.int32)
        del base
        assert _ext.live_host_bytes() == before + nbytes, "a view must keep its allocation alive"
        view.fill_(1)
        del view
        assert _ext.live_host_bytes() == before


@native_only
def test_alloc_host_grows_rss_by_the_requested_size_not_a_power_of_two():
    nbytes = 600 * MiB
    with gc_disabled():
        before = rss_bytes()
        t = _ext.alloc_host(nbytes, pin=False)
        grown = rss_bytes() - before
        # Pages are touched when allocated; a power-of-two allocator would have taken 1 GiB.
        assert abs(grown - nbytes) < 0.03 * nbytes, f"RSS grew by {grown} bytes for a {nbytes}-byte allocation"
        del t
        assert rss_bytes() - before < 0.03 * nbytes, "the memory must go back to the OS"


@cuda_only
def test_pinned_allocations_are_pinned_on_a_gpu_machine():
    t = _ext.alloc_host(3 * MiB + 1, pin=True)
    assert t.is_pinned()
    assert not _ext.alloc_host(4096, pin=False).is_pinned()


@native_only
def test_host_device_address_of_memory_no_gpu_can_read_is_refused_naming_the_tensor_and_its_bytes():
    """Unpinned memory (or no GPU, or no CUDA in the build): a clear error, not an address."""
    with pytest.raises(RuntimeError, match=r"host_device_address of a \[3, 5\] float tensor \(60 bytes\)"):
        torch.ops.offtensor.host_device_address(torch.zeros(3, 5))


@cuda_only
def test_a_cuda_view_at_the_host_device_address_of_pinned_memory_reads_its_values():
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from uva import uva_view

    weight, keep = torch.randn(64, 33), []
    view = uva_view(weight, torch.device("cuda"), keep)
    assert view.is_cuda and keep[0].is_pinned() and torch.equal((view * 1).cpu(), weight)


# ------------------------------------------------------------------------------------------------
# Copy engine


def random_pair(rng: random.Random, device="cpu"):
    dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.bool])
    numel = rng.choice([0, 1, rng.randrange(2, 5000), rng.randrange(5000, 300_000)])
    src = torch.randint(0, 2 if dtype == torch.bool else 100, (numel,)).to(dtype)
    return torch.empty(numel, dtype=dtype, device=device), src


def test_copy_engine_copies_many_concurrent_submissions_exactly():
    rng = random.Random(0)
    engine = _ext.CopyEngine()
    pairs = [random_pair(rng) for _ in range(300)]
    tickets = [engine.submit(dst, src) for dst, src in pairs]
    assert tickets == sorted(tickets) and len(set(tickets)) == len(tickets)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    for i in order:
        engine.wait(tickets[i])
        assert engine.query(tickets[i])
        assert torch.equal(pairs[i][0], pairs[i][1])


def test_copy_engine_tickets_are_unique_across_threads_and_engines():
    results, errors = {}, []

    def submit_many(worker: int):
        try:
            rng, engine = random.Random(worker), _ext.CopyEngine()
            mine = []
            for _ in range(50):
                dst, src = random_pair(rng)
                mine.append((engine.submit(dst, src), dst, src))
            assert [t for t, _, _ in mine] == sorted(t for t, _, _ in mine)
            for ticket, dst, src in mine:
                _ext.CopyEngine().wait(ticket)  # any engine can wait on any ticket
                assert torch.equal(dst, src)
            results[worker] = [t for t, _, _ in mine]
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=submit_many, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    every_ticket = [t for tickets in results.values() for t in tickets]
    assert len(set(every_ticket)) == 200


def test_copy_engine_copies_between_dtypes_and_shapes_by_bytes():
    engine = _ext.CopyEngine()
    src = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    dst = torch.empty(96, dtype=torch.uint8)
    engine.wait(engine.submit(dst, src))
    assert torch.equal(dst.view(torch.float32).reshape(2, 3, 4), src)


def test_copy_engine_rejects_tickets_it_never_issued():
    engine = _ext.CopyEngine()
    ticket = engine.submit(torch.empty(3), torch.ones(3))
    for bad in (0, -1, ticket + 1000):
        with pytest.raises(ValueError, match="never returned"):
            engine.query(bad)
        with pytest.raises(ValueError, match="never returned"):
            engine.wait(bad)
    engine.wait(ticket)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: (torch.empty(4, 4).t(), torch.empty(4, 4)), "contiguous"),
        (lambda: (torch.empty(4), torch.empty(5)), "16 bytes but src holds 20 bytes"),
        (lambda: (lambda b: (b[2:6], b[0:4]))(torch.zeros(8)), "overlap"),
    ],
)
def test_copy_engine_rejects_bad_copies_with_a_clear_message(make, message):
    dst, src = make()
    with pytest.raises((RuntimeError, ValueError), match=message):
        _ext.CopyEngine().submit(dst, src)


@native_only
def test_python_keeps_running_while_a_large_copy_is_in_flight():
    nbytes = 400 * MiB
    src = torch.arange(nbytes // 4, dtype=torch.int32)
    dst = _ext.alloc_host(nbytes, pin=False).view(torch.int32)  # pages already touched
    engine = _ext.CopyEngine()

    ticket = engine.submit(dst, src)
    # A synchronous submit would have finished the copy before returning.
    assert not engine.query(ticket), "a 400 MB copy cannot be finished when submit returns"

    # wait() must release the GIL: another Python thread makes progress meanwhile.
    ticks, stop = [0], threading.Event()

    def count():
        while not stop.is_set():
            ticks[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        engine.wait(ticket)
    finally:
        stop.set()
        counter.join()
    assert engine.query(ticket)
    assert ticks[0] > 0
    assert torch.equal(dst, src)


@native_only
def test_copy_engine_keeps_tensors_alive_until_the_copy_is_done_then_releases_them():
    nbytes = 64 * MiB
    engine = _ext.CopyEngine()
    with gc_disabled():
        before = _ext.live_host_bytes()
        src = _ext.alloc_host(nbytes, pin=False).fill_(9)
        dst = _ext.alloc_host(nbytes, pin=False)
        dst_view = dst[:]
        ticket = engine.submit(dst, src)
        del src, dst  # the engine's references keep both allocations valid
        engine.wait(ticket)
        assert int(dst_view[-1]) == 9
        del dst_view
        assert _ext.live_host_bytes() == before, "after wait the engine must hold no tensor"


def test_stream_wait_on_the_emulated_device_waits_for_the_copy():
    engine = _ext.CopyEngine()
    src = torch.arange(1 << 22, dtype=torch.int64)
    dst = torch.empty_like(src)
    ticket = engine.submit(dst, src)
    engine.stream_wait(ticket, 0)
    assert engine.query(ticket) and torch.equal(dst, src)


@native_only
def test_copy_engine_works_in_a_forked_child():
    engine = _ext.CopyEngine()
    engine.wait(engine.submit(torch.empty(10), torch.ones(10)))  # the parent's worker is running
    pid = os.fork()
    if pid == 0:  # child: must not wait on the parent's worker thread, which does not exist here
        try:
            dst, src = torch.empty(1000), torch.randn(1000)
            engine.wait(engine.submit(dst, src))
            os._exit(0 if torch.equal(dst, src) else 1)
        finally:
            os._exit(2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung waiting for a copy")


def test_interpreter_exits_promptly_with_copies_in_flight():
    result = run_python("""
        import torch
        from offtensor import _ext
        src = torch.ones(64 << 20, dtype=torch.uint8)
        dsts = [torch.empty_like(src) for _ in range(4)]
        engine = _ext.CopyEngine()
        tickets = [engine.submit(dst, src) for dst in dsts]
        print("submitted", flush=True)
    """)
    assert result.returncode == 0, result.stderr
    assert "submitted" in result.stdout


@cuda_only
def test_copy_engine_copies_host_to_gpu_and_orders_the_compute_stream():
    engine = _ext.CopyEngine()
    rng = random.Random(1)
    device = torch.device("cuda", torch.cuda.current_device())
    pairs = []
    for _ in range(50):
        _, src = random_pair(rng)
        host = _ext.alloc_host(src.nbytes, pin=True)
        host.copy_(src.reshape(-1).view(torch.uint8))
        dst = torch.empty(src.shape, dtype=src.dtype, device=device)
        pairs.append((engine.submit(dst, host), dst, src))
    for ticket, dst, src in pairs:
        engine.stream_wait(ticket, torch.cuda.current_stream(device).cuda_stream)
        assert torch.equal(dst.cpu(), src)  # runs on the compute stream, after the copy
        engine.wait(ticket)
        assert engine.query(ticket)


# ------------------------------------------------------------------------------------------------
# Without the extension


def test_import_without_native_warns_once_and_falls_back_to_torch():
    result = run_python("""
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import offtensor
            from offtensor import _ext
            import offtensor._ext
            import torch
            before = _ext.live_host_bytes()
            t = _ext.alloc_host(12345, pin=False)
            view = t[10:20]
            grown = _ext.live_host_bytes() - before
            del t, view
            engine = _ext.CopyEngine()
            src, dst = torch.randn(100), torch.empty(100)
            ticket = engine.submit(dst, src)
            done = engine.query(ticket)
            engine.wait(ticket)
        print(json.dumps({
            "native": _ext.NATIVE,
            "warnings": [str(w.message) for w in caught if "native extension" in str(w.message)],
            "grown": grown, "after": _ext.live_host_bytes() - before,
            "done": done, "equal": torch.equal(dst, src),
        }))
    """, OFFTENSOR_NO_NATIVE="1")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["native"] is False
    assert len(report["warnings"]) == 1, report["warnings"]
    message = report["warnings"][0]
    assert "OFFTENSOR_NO_NATIVE" in message and "pip install --no-build-isolation -e ." in message
    assert "slower pure-PyTorch" in message
    assert report["grown"] == 12345 and report["after"] == 0
    assert report["done"] and report["equal"]
