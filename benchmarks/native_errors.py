"""Does an error raised inside offtensor's native extension reach Python as an exception?

On the H200 machine (torch 2.11+cu130) every TORCH_CHECK that fired inside offtensor._C killed the
process with SIGSEGV (test_ext's refusals, pin_host of an unaligned tensor, the pooled GEMM's slot
check), while torch's own C++ errors became Python exceptions as usual, and the same checks raise
cleanly on the CPU machine (torch 2.13). This script narrows that down in one short run. Each
scenario runs in a fresh subprocess (a crash ends only that one) and records its exit code, the
error it raised, and where a process crashed the native backtrace printed by a SIGSEGV handler
(an extension built here with torch.utils.cpp_extension.load_inline, loaded first):

- ``ours_*``: a refusal from offtensor._C (pool_grouped_mm_cpu of a slot past the pool, a pure-CPU
  check), before CUDA is initialised, after torch initialised CUDA, and after offtensor pinned memory;
- ``torch_*``: a refusal from torch's own C++ (aten.mm of mismatched shapes) in the same states;
- ``inline_*``: a refusal from a minimal custom op built here the same way (TORCH_LIBRARY, CPU key)
  with no CUDA runtime linked, in the same states: whether any extension's throw crashes or only
  offtensor's;
- ``nocuda_*``: offtensor's refusal from a second build of offtensor._C made here without its CUDA
  part (OFFTENSOR_NO_CUDA=1: no runtime.cu object, no libcudart linked; unoptimised, to build
  quickly), loaded instead of the checkout's: whether linking the CUDA runtime is what breaks the throw;
- ``*_stacktraces``: with TORCH_SHOW_CPP_STACKTRACES=1.

    python benchmarks/native_errors.py [--out DIR] [--timeout 60]

Writes ``native_errors.json`` into ``--out`` and prints one line per scenario.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_REPORTER = r"""
#include <torch/library.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

namespace {
void report(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  const char header[] = "\n=== native backtrace at the signal ===\n";
  write(2, header, sizeof(header) - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}
int64_t install() {
  signal(SIGSEGV, report);
  signal(SIGABRT, report);
  return 1;
}
at::Tensor refuse(const at::Tensor& x) {
  TORCH_CHECK(x.numel() < 0, "native_errors: refused a tensor of ", x.numel(), " elements");
  return x;
}
}  // namespace

TORCH_LIBRARY(native_errors, m) {
  m.def("install() -> int", &install);
  m.def("refuse(Tensor x) -> Tensor");
}
TORCH_LIBRARY_IMPL(native_errors, CPU, m) { m.impl("refuse", &refuse); }
"""

# The reporter's handler first, faulthandler's on top: a crash prints the Python stack, then
# faulthandler re-raises into the reporter, which prints the native frames below the signal.
_PRELUDE = """
import faulthandler, sys
sys.path.insert(0, {root!r})
import torch
from torch.utils.cpp_extension import load_inline
load_inline("native_errors_reporter", cpp_sources=[{source!r}], build_directory={build!r},
            extra_cflags=["-O0"], is_python_module=False, verbose=False)  # built to throw, not to be fast
torch.ops.native_errors.install()
faulthandler.enable()
"""

_STATES = {
    "before_cuda": "",
    "after_torch_cuda": "torch.cuda.init(); torch.ones(1, device='cuda').sum().item()",
    "after_offtensor_pin": "from offtensor import _ext; keep = _ext.alloc_host(1 << 20, pin=True); "
                           "print('pinned by offtensor, torch says is_pinned =', keep.is_pinned())",
}

_RAISERS = {
    "ours": "import offtensor._C; torch.ops.offtensor.pool_grouped_mm_cpu(torch.ones(1, 4), torch.ones(2, 4, 4), "
            "torch.tensor([5]), torch.tensor([1], dtype=torch.int32))",
    "torch": "torch.ops.aten.mm(torch.ones(2, 3), torch.ones(4, 5))",
    "inline": "torch.ops.native_errors.refuse(torch.ones(3))",
    "nocuda": "torch.ops.load_library(NOCUDA); torch.ops.offtensor.pool_grouped_mm_cpu(torch.ones(1, 4), "
              "torch.ones(2, 4, 4), torch.tensor([5]), torch.tensor([1], dtype=torch.int32))",
}


def _build_without_cuda(build: str):
    """Starts building offtensor._C without its CUDA part into ``build``; (process, the .so's directory)."""
    lib = os.path.join(build, "nocuda")
    command = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", lib, "--build-temp",
               os.path.join(build, "nocuda_tmp")]
    # Unoptimised: the build only has to throw as the real one does, and takes under half the time.
    env = {**os.environ, "OFFTENSOR_NO_CUDA": "1", "OFFTENSOR_UNOPTIMISED_BUILD": "1"}
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), lib


def _find_so(lib: str):
    for folder, _, files in os.walk(lib):
        for name in files:
            if name.startswith("_C") and name.endswith(".so"):
                return os.path.join(folder, name)
    return None


def _scenario(build: str, state: str, raiser: str, nocuda_so=None) -> str:
    return textwrap.dedent(_PRELUDE.format(root=ROOT, source=_REPORTER, build=build)) + textwrap.dedent(f"""
NOCUDA = {nocuda_so!r}
{_STATES[state]}
try:
    {_RAISERS[raiser]}
except Exception as error:
    print("RAISED", type(error).__name__, str(error).splitlines()[0][:300])
else:
    print("NO ERROR")
""")


def run(out: str, timeout: float) -> dict:
    """Runs every scenario and writes ``native_errors.json`` into ``out`` (also when a build failed)."""
    results = _run(timeout)
    with open(os.path.join(out, "native_errors.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


def _run(timeout: float) -> dict:
    import torch

    build = tempfile.mkdtemp(prefix="native_errors_")
    start = time.perf_counter()
    nocuda_build, nocuda_lib = _build_without_cuda(build)
    # Built once here; each scenario then only loads it (load_inline finds it up to date).
    compile_result = subprocess.run([sys.executable, "-c", textwrap.dedent(_PRELUDE.format(
        root=ROOT, source=_REPORTER, build=build))], capture_output=True, text=True, timeout=600)
    results = {"build_s": round(time.perf_counter() - start, 1), "build_rc": compile_result.returncode,
               "cuda": torch.cuda.is_available(), "torch": torch.__version__, "scenarios": {}}
    if compile_result.returncode != 0:
        results["build_error"] = compile_result.stderr[-4000:]
        nocuda_build.kill()
        return results
    nocuda_log = nocuda_build.communicate(timeout=600)[0]
    nocuda_so = _find_so(nocuda_lib) if nocuda_build.returncode == 0 else None
    results["nocuda_build_s"] = round(time.perf_counter() - start, 1)
    if nocuda_so is None:
        results["nocuda_build_error"] = nocuda_log[-4000:]
    if torch.cuda.is_available():
        plans = [("ours", state, {}) for state in _STATES]
        plans += [("ours", "after_offtensor_pin", {"TORCH_SHOW_CPP_STACKTRACES": "1"}),
                  ("torch", "after_offtensor_pin", {})]
        plans += [(raiser, state, {}) for raiser in ("inline", "nocuda")
                  for state in ("before_cuda", "after_offtensor_pin")]
    else:
        plans = [(raiser, "before_cuda", {}) for raiser in _RAISERS]
    plans = [plan for plan in plans if plan[0] != "nocuda" or nocuda_so is not None]

    def one(plan):
        raiser, state, env = plan
        began = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-c", _scenario(build, state, raiser, nocuda_so)],
                                  capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
            rc, stdout, stderr = done.returncode, done.stdout, done.stderr
        except subprocess.TimeoutExpired as expired:
            rc, stdout, stderr = "timeout", expired.stdout or "", expired.stderr or ""
            stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
        outcome = next((line for line in stdout.splitlines() if line.startswith(("RAISED", "NO ERROR"))), None)
        entry = {"rc": rc, "outcome": outcome or "crashed", "seconds": round(time.perf_counter() - began, 1),
                 "stdout": stdout[-1500:]}
        if outcome is None:
            entry["stderr"] = stderr[-6000:]
        return f"{raiser}_{state}" + ("_stacktraces" if env else ""), entry

    # Side by side: each scenario is mostly a torch import, and the GPU machine has cores to spare.
    with concurrent.futures.ThreadPoolExecutor(max(1, min(8, (os.cpu_count() or 2) // 2))) as pool:
        for name, entry in pool.map(one, plans):
            results["scenarios"][name] = entry
            print(f"{name:40s} rc={entry['rc']!s:8s} {entry['outcome'][:100]}", flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    run(args.out, args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
