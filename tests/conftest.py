"""Shared test setup: the device the tests offload to, and hypothesis settings.

``OFFTENSOR_TEST_DEVICE`` picks the device (default "cpu", the emulated device; the GPU script sets
"cuda"), so the same tests take the GPU code path on a GPU. ``OFFTENSOR_HYPOTHESIS_EXAMPLES`` sets
how many examples each property runs (default 60). ``OFFTENSOR_STRICT=1`` runs the emulated device
strictly (late, out-of-order copies into poisoned buffers; see ``offtensor._ext.StrictCopyEngine``)
and fails a test whose copies lost their host source. torchao's import noise on a CPU torch is kept
out of the tests' output (``offtensor._optional.quiet_torchao_on_cpu_torch``).
"""

from __future__ import annotations

import gc
import os

import pytest
import torch
from hypothesis import HealthCheck, settings

settings.register_profile(
    "offtensor",
    deadline=None,  # paging and the first dispatch of an op vary in time; correctness is what is tested
    max_examples=int(os.environ.get("OFFTENSOR_HYPOTHESIS_EXAMPLES", "60")),
    # ``device`` is a function-scoped fixture, but a constant string, so reusing it across examples is safe.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.load_profile("offtensor")

TEST_DEVICE = os.environ.get("OFFTENSOR_TEST_DEVICE", "cpu")

if TEST_DEVICE == "cpu" and "OMP_NUM_THREADS" not in os.environ:
    # On the emulated device the copy engine's worker thread needs a core too; with torch's
    # default of one compute thread per core, a 2-core machine oversubscribes and single ops
    # run 10-100x slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))


# Before any test file imports transformers, which imports torchao where it is installed.
from offtensor._optional import quiet_torchao_on_cpu_torch  # noqa: E402  (after the thread count above)

quiet_torchao_on_cpu_torch()


@pytest.fixture(autouse=True)
def _grad_mode_left_as_found():
    """A test that leaves autograd's grad mode changed fails itself, instead of the training tests
    that run after it in the same worker ("element 0 of tensors does not require grad")."""
    before = torch.is_grad_enabled()
    yield
    after = torch.is_grad_enabled()
    torch.set_grad_enabled(before)
    assert after == before, f"this test left grad mode {'on' if after else 'off'}"


@pytest.fixture(autouse=True)
def _strict_device_catches_nothing():
    """Under ``OFFTENSOR_STRICT=1`` every test also proves that no copy lost its host source."""
    from offtensor import _ext
    from offtensor.pager import strict_from_env

    if not strict_from_env():
        yield
        return
    before = len(_ext.strict_failures())
    yield
    _ext.StrictCopyEngine.drain()
    new = _ext.strict_failures()[before:]
    assert not new, "\n".join(new)


@pytest.fixture
def one_rank_mesh(tmp_path):
    """A gloo group of this process alone and its cpu mesh: DTensors and FSDP2 without starting ranks."""
    import datetime

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def young_heap():
    """Inside the test, ``gc.collect()`` walks only the objects made since it began: everything alive
    before is frozen (``gc.freeze``). The interrupt walks collect after every point (a traceback's
    frames hold what the point made). What was alive at the test's start stays frozen afterwards,
    as the imports are (``pytest_collection_finish``)."""
    gc.collect()
    gc.freeze()
    yield


@pytest.fixture
def thawed_heap():
    """No object frozen inside the test (a benchmark that freezes the heap and thaws it, as a
    standalone process would), the suite's freeze put back after it."""
    gc.unfreeze()
    try:
        yield
    finally:
        gc.collect()
        gc.freeze()


@pytest.fixture
def device() -> str:
    """The device OffloadedTensors are offloaded to in this run."""
    return TEST_DEVICE



# The slowest files first (seconds of one run on the 2-core machine, two workers: OpInfo ~75, the
# interrupt walks of test_interrupts_more ~75, the native-errors check's builds ~50, the GPU suite's
# dry run ~35, the tiny-architecture sweep ~35, the expert-placement and timeline walks ~30 each).
# With two xdist workers, `--dist loadfile` hands out whole files in queue order, so a long file
# queued late became one worker's tail while the other idled: longest first is the classic fix. A
# stable sort, so the order within and between the other files stays as collected. xdist's own
# reordering (by the number of tests in a file, on by default) is turned off below: it queued the
# one-test files, OpInfo, the native-errors check and the dry run among them, last of all. (No test
# compares wall clocks any more, so what runs beside what does not change a verdict.)
SLOWEST_FIRST = ("test_opinfo.py", "test_interrupts_more.py", "test_native_errors.py", "test_gpu_suite.py",
                 "test_sweep.py", "test_interrupts_regions.py", "test_interrupts_timeline.py", "test_setup.py",
                 "test_moe_trained.py", "test_expert_pool.py", "test_moe_routing.py", "test_compile.py",
                 "test_opinfo_tight.py", "test_interrupts.py", "test_hostile_files.py", "test_interrupts_atomic.py",
                 "test_interrupts_clients.py", "test_autocast.py")


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist 3.6 and later
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_collection_finish(session):
    """Every module the tests import is loaded now: some 370,000 objects Python's cyclic collector
    tracks (torch's, transformers', diffusers'), which every full collection walked again, 0.15 s
    each, while a test's own objects are a few thousand. Frozen (``gc.freeze``, as a serving
    process does after start-up), they stay out of every later collection; what tests make is
    collected as before."""
    gc.collect()
    gc.freeze()
