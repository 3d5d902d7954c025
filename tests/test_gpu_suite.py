"""The one-call GPU suite, run dry on the emulated device: it keeps its deadline, tees every step's
output into $OUT as it runs and leaves a summary JSON even for a step it had to kill.

A short deadline keeps this cheap (about 28 s on a quiet machine): build check and probe finish, the core tests are
cut by the deadline, the rest is skipped, which is exactly the path a slow GPU call would take.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _deadline_s() -> int:
    """The dry run's deadline, sized to this machine as it is now. Before the core tests the suite
    starts Python with torch three times (machine notes, build check, probe), so on a shared machine
    (a pytest-xdist worker beside it, other jobs) a fixed 40 s once reached the probe too late, and
    a fixed 60 s let it time out under a load of 10. 28 s on a quiet machine, where importing torch
    takes 2 s and the build check and the probe take 3 and 5 s."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import torch, offtensor._C"], cwd=ROOT, check=True)
    return max(28, int(12 + 6 * (time.monotonic() - start)))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the suite is a bash script for the Linux GPU machine")
def test_dry_suite_keeps_its_deadline_and_leaves_logs_and_a_summary(tmp_path):
    deadline_s = _deadline_s()
    env = dict(os.environ, OFFTENSOR_SUITE_DRY="1", OFFTENSOR_SUITE_DEADLINE=str(deadline_s), OUT=str(tmp_path),
               PYTHON=sys.executable)
    env.pop("OFFTENSOR_TEST_DEVICE", None)
    start = time.monotonic()
    done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_suite.sh")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=deadline_s + 60)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert elapsed <= deadline_s + 10, f"the suite took {elapsed:.0f} s against a deadline of {deadline_s} s"

    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = {s["step"]: s for s in summary["steps"]}
    assert summary["dry_run"] and summary["device"] == "cpu"
    assert steps["build"]["status"] == "ok" and steps["probe"]["status"] == "ok", summary["steps"]
    assert all(s["status"] in ("ok", "failed", "timeout", "skipped: deadline") for s in summary["steps"])
    assert all(s["limit_s"] <= deadline_s for s in summary["steps"])
    # Every step got a verdict, in the suite's order; whatever did not fit was recorded, not lost.
    order = [name for name in steps if name != "wheels"]  # wheels: only where .whl/ was fetched
    assert order[:5] == ["build", "probe", "core_tests", "bench_paging", "demo_small"]
    if "wheels" in steps:
        assert steps["wheels"]["status"] == "ok"
    assert any(s["status"] in ("timeout", "skipped: deadline") for s in summary["steps"])
    # At most 8 files come back from the device machine: four, whatever the benchmarks write.
    assert {p.name for p in tmp_path.iterdir()} <= {"suite.log", "summary.json", "machine.txt", "results.tgz"}
    probe = summary["figures"]["probe.json"]
    assert probe["native"] is True and probe["pinned_h2d_GB_per_s"] > 0
    log = (tmp_path / "suite.log").read_text()
    assert "probe pinned_h2d_GB_per_s" in log  # teed while the step ran
    assert "===== core_tests" in log
