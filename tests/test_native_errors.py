"""benchmarks/native_errors.py, the GPU suite's check that an error raised inside offtensor._C
reaches Python as an exception, runs here too: on this machine every refusal it provokes (from
offtensor._C, from a build of it without its CUDA part, from torch, from a minimal extension built
the same way) must come back as a RuntimeError naming what was refused."""

from __future__ import annotations

import json
import os
import sys

import pytest

from offtensor import _ext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not _ext.NATIVE, reason="offtensor._C is not built")
def test_every_native_refusal_reaches_python_as_an_exception(tmp_path):
    pytest.importorskip("ninja")  # load_inline builds the reporter extension with it
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        import native_errors
    finally:
        sys.path.pop(0)
    native_errors.run(str(tmp_path), timeout=240)
    results = json.loads((tmp_path / "native_errors.json").read_text())
    assert results["build_rc"] == 0, results.get("build_error")
    # The build without the CUDA part is the one a machine without nvcc makes: it must compile.
    assert "nocuda_build_error" not in results, results["nocuda_build_error"]
    scenarios = results["scenarios"]
    assert {"ours_before_cuda", "torch_before_cuda", "inline_before_cuda", "nocuda_before_cuda"} <= set(scenarios)
    for name, entry in scenarios.items():
        assert entry["rc"] == 0 and entry["outcome"].startswith("RAISED RuntimeError"), (name, entry)
    assert "slot 5 of 2" in scenarios["ours_before_cuda"]["outcome"]
    assert "refused a tensor of 3 elements" in scenarios["inline_before_cuda"]["outcome"]
