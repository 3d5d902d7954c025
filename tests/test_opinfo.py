"""PyTorch's OpInfo database run on OffloadedTensors and compared with the same ops on plain tensors.

Every dense strided non-empty tensor of a sample (its input, args and kwargs, tensors inside lists
included) is replaced by an OffloadedTensor on the test device; the op's variants must then give
what they give on plain tensors:

- ``fn``: return values equal; no offloaded input changed unless the reference changed it too; a
  result that aliases an offloaded input is an OffloadedTensor (a view stays offloaded).
- ``out``: the out= tensors are offloaded too; they are returned, and hold the reference's values.
- ``inplace``: return values equal, the in-place op returns its input object, and the mutated
  offloaded input read back equals the mutated plain input.
- ``grad`` (float32, differentiable ops): tensors that require grad stay plain, the others are
  offloaded (frozen weights); gradients of the plain inputs, by ``torch.autograd.grad`` of the
  outputs against fixed random cotangents, are equal. Two splits per sample: the sample's input
  plain and its other tensors offloaded, and the reverse.

Each sample is offloaded in one of three styles (``Offloader``): each tensor as its own master;
as a strided view at an offset into a larger, zero-padded master of a pager with a budget (cached
device copies); or, for a floating tensor, as a lazy cast of a master holding it in a wider dtype. Mutated tensors are read back both from the host master and through the pager,
and the padding must stay untouched.

Samples whose reference raises or is not a function of its inputs (run twice under one seed) are
skipped. Random ops run under one seed for the reference and for the offloaded run, so they are
compared too. The sample plumbing, the comparison and the four variants are in
tests/opinfo_variants.py; the sweep over the database and its verdict are here.

By default the first ``OFFTENSOR_OPINFO_SAMPLES`` (8) samples per op and dtype run, alternating
the three styles, which keeps this test about a minute on two cores;
``OFFTENSOR_OPINFO_FULL=1`` runs every sample in every style (about 8 minutes). ``OFFTENSOR_OPINFO_REPORT=1`` (or a path ending in
.json) writes a JSON summary to ``benchmarks/results/opinfo_sweep.json``;
``OFFTENSOR_OPINFO_OPS=add,mm`` restricts the sweep to ops whose name starts with one of the
prefixes (for debugging).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import pathlib
import time
import traceback
import unittest.mock
import warnings

import pytest
import torch

from opinfo_variants import Skip, _full_name, _seed, _test_device, run_fn, run_grad, run_inplace, run_out

pytestmark = pytest.mark.opinfo

REQUIRED_AGREEMENT = 0.997
SAMPLES_PER_OP = int(os.environ.get("OFFTENSOR_OPINFO_SAMPLES", "8"))
FULL = os.environ.get("OFFTENSOR_OPINFO_FULL", "") not in ("", "0")
REPORT_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "opinfo_sweep.json"

# float32 everywhere, plus an integer and a half-precision dtype where the op supports them.
DTYPES = (torch.float32, torch.int64, torch.bfloat16)
# How sample tensors are offloaded (see Offloader): as their own masters, and as strided views
# into a larger master.
STYLES = ("whole", "view", "cast")

# Ops whose result is not a function of their inputs even under a fixed seed: they return
# uninitialised memory, so any comparison is meaningless.
SKIP_OPS = {
    "empty": "returns uninitialised memory",
    "empty_like": "returns uninitialised memory",
    "empty_strided": "returns uninitialised memory",
    "empty_permuted": "returns uninitialised memory",
    "new_empty": "returns uninitialised memory",
    "new_empty_strided": "returns uninitialised memory",
    "resize_": "the elements it adds are uninitialised memory",
    "resize_as_": "the elements it adds are uninitialised memory",
}

# Failures that are expected, with the technical reason. Keys are an op's full name (name plus
# ".variant_test_name") or (full name, variant). A sample of such an op that fails is left out of
# the denominator; one that passes still counts as agreement.
_MATRIX_RANK_OUT = (
    "PyTorch bug: linalg_matrix_rank_out (aten/src/ATen/native/LinearAlgebra.cpp, matrix_rank_impl) "
    "takes an isTensorSubclassLike branch for a subclass input that rebinds its `Tensor& result` to a "
    "fresh at::sum(...) instead of writing into out=, so out= keeps its old values for every tensor "
    "subclass input (no op reaches __torch_dispatch__ with the out tensor)"
)
KNOWN_EXCEPTIONS: dict = {
    ("linalg.matrix_rank", "out"): _MATRIX_RANK_OUT,
    ("linalg.matrix_rank.hermitian", "out"): _MATRIX_RANK_OUT,
}


# ---------------------------------------------------------------------------- the sweep


def _samples(op, device, dtype, requires_grad=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _seed()
        samples = op.sample_inputs(device, dtype, requires_grad=requires_grad, set_seed=False)
        limit = None if FULL else SAMPLES_PER_OP
        return list(itertools.islice(samples, limit))


@contextlib.contextmanager
def _quick_sample_inputs():
    """OpInfo.sample_inputs looks for the running unittest method with inspect.stack(), which
    reads the source of every frame: under pytest that is most of this test's time. There is no
    unittest method here, so answer "none" directly while the sweep runs."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    with contextlib.ExitStack() as stack:
        for module in (common_utils, core):
            if hasattr(module, "extract_test_fn"):
                stack.enter_context(unittest.mock.patch.object(module, "extract_test_fn", lambda: None))
        yield


def _styles(sample_index: int):
    # The full sweep offloads every sample both ways; the default one alternates, to halve its time.
    return STYLES if FULL else (STYLES[sample_index % len(STYLES)],)


def _op_db():
    # common_utils freezes torch.backends flags at import; give the rest of the session its
    # normal behaviour back.
    previous = getattr(torch.backends, "__allow_nonbracketed_mutation_flag", True)
    try:
        from torch.testing._internal import common_methods_invocations as databases
    finally:
        setattr(torch.backends, "__allow_nonbracketed_mutation_flag", previous)
    # op_db plus the _foreach_* ops (ForeachFuncInfo), which op_db leaves to separate lists.
    foreach = [name for name in dir(databases) if name.startswith("foreach_") and name.endswith("_op_db")]
    return list(databases.op_db) + [op for name in sorted(foreach) for op in getattr(databases, name)]


def _exception_for(name: str, variant: str):
    if (name, variant) in KNOWN_EXCEPTIONS:
        return KNOWN_EXCEPTIONS[(name, variant)]
    return KNOWN_EXCEPTIONS.get(name)


def _short(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) < 600 else text[:600] + "..."


def run_sweep(device: str = "cpu", ops=None) -> dict:
    """Run the sweep over ``ops`` (default: every OpInfo); returns the summary (also what the
    JSON report holds)."""
    ops = list(ops) if ops is not None else _op_db()
    with _quick_sample_inputs():
        return _run_sweep(device, ops)


def _run_sweep(device: str, ops) -> dict:
    started = time.perf_counter()
    prefixes = [p for p in os.environ.get("OFFTENSOR_OPINFO_OPS", "").split(",") if p]
    totals = {"passed": 0, "failed": 0, "known_failed": 0, "skipped": 0}
    by_variant: dict = {}
    failures: dict = {}
    skips: dict = {}
    ops_seen = set()
    distinct = set()
    timings = {}
    for op in ops:
        name = _full_name(op)
        if prefixes and not any(name.startswith(p) for p in prefixes):
            continue
        if name in SKIP_OPS:
            skips.setdefault(name, {})[SKIP_OPS[name]] = 1
            continue
        op_started = time.perf_counter()
        supported = op.supported_dtypes(torch.device(device).type)
        dtypes = [d for d in DTYPES if d in supported]
        if torch.bfloat16 not in dtypes and torch.float16 in supported:
            dtypes.append(torch.float16)
        for dtype in dtypes:
            runs = []  # (variant, style, sample index, sample, runner)
            try:
                for i, sample in enumerate(_samples(op, device, dtype)):
                    for style in _styles(i):
                        runs.append(("fn", style, i, sample, run_fn))
                        if op.supports_out:
                            runs.append(("out", style, i, sample, run_out))
                        if op.inplace_variant is not None:
                            runs.append(("inplace", style, i, sample, run_inplace))
                if op.supports_autograd and dtype == torch.float32:
                    for i, sample in enumerate(_samples(op, device, dtype, requires_grad=True)):
                        for style, frozen_input in itertools.product(_styles(i), (False, True)):
                            runner = functools.partial(run_grad, input_is_frozen=frozen_input)
                            runs.append(("grad", style, f"g{i}", sample, runner))
            except Exception as e:
                skips.setdefault(name, {})[f"sample generation raises {type(e).__name__}"] = 1
            for variant, style, index, sample, runner in runs:
                stats = by_variant.setdefault(f"{variant}[{style}]", dict.fromkeys(totals, 0))
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    try:
                        runner(op, sample, device, style)
                        outcome = "passed"
                    except Skip as e:
                        reason = str(e)
                        skips.setdefault(name, {}).setdefault(reason, 0)
                        skips[name][reason] += 1
                        outcome = "skipped"
                    except Exception as e:
                        known = _exception_for(name, variant)
                        outcome = "known_failed" if known else "failed"
                        frames = traceback.extract_tb(e.__traceback__)
                        failures.setdefault(f"{name}/{variant}", []).append(
                            {
                                "dtype": str(dtype).replace("torch.", ""),
                                "style": style,
                                "sample": index,
                                "sample_repr": repr(sample)[:300],
                                "error": _short(e),
                                "raised_at": f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "",
                                "known_exception": known,
                            }
                        )
                if outcome != "skipped":
                    ops_seen.add(name)
                    distinct.add((name, str(dtype), index))
                totals[outcome] += 1
                stats[outcome] += 1
        timings[name] = time.perf_counter() - op_started
    counted = totals["passed"] + totals["failed"]
    used_exceptions = {key.split("/")[0] for key, fs in failures.items() if any(f["known_exception"] for f in fs)}
    summary = {
        "device": device,
        "full": FULL,
        "samples_per_op_dtype_variant": None if FULL else SAMPLES_PER_OP,
        "dtypes": [str(d).replace("torch.", "") for d in DTYPES] + ["float16 (where bfloat16 is unsupported)"],
        "torch": torch.__version__,
        "ops_run": len(ops_seen),
        "distinct_samples": len(distinct),
        "sample_runs": counted + totals["known_failed"],
        "totals": totals,
        "by_variant": by_variant,
        "agreement": totals["passed"] / counted if counted else 1.0,
        "required_agreement": REQUIRED_AGREEMENT,
        "known_exceptions": {str(k): v for k, v in KNOWN_EXCEPTIONS.items()},
        "known_exceptions_not_hit": sorted(
            str(k) for k in KNOWN_EXCEPTIONS if (k[0] if isinstance(k, tuple) else k) not in used_exceptions
        ),
        "failures": failures,
        "skips": skips,
        "seconds": round(time.perf_counter() - started, 1),
        "slowest_ops": dict(sorted(timings.items(), key=lambda kv: -kv[1])[:10]),
    }
    return summary


def _print_summary(summary: dict) -> None:
    t = summary["totals"]
    print(
        f"\nOpInfo sweep on {summary['device']}: {summary['ops_run']} ops, {summary['distinct_samples']} samples, {summary['sample_runs']} runs "
        f"({', '.join(f'{k} {v}' for k, v in t.items())}), agreement {summary['agreement']:.4%} "
        f"in {summary['seconds']} s"
    )
    for variant, stats in sorted(summary["by_variant"].items()):
        print(f"  {variant}: {stats}")
    for key, fs in sorted(summary["failures"].items()):
        tag = " (known)" if fs[0]["known_exception"] else ""
        print(f"  FAIL{tag} {key} x{len(fs)}: {fs[0]['dtype']}: {fs[0]['error'].splitlines()[0][:200]}")


def _write_report(summary: dict) -> None:
    target = os.environ.get("OFFTENSOR_OPINFO_REPORT", "")
    if not target:
        return
    path = pathlib.Path(target) if target.endswith(".json") else REPORT_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1, sort_keys=False) + "\n")


@pytest.mark.filterwarnings("ignore")
def test_opinfo_ops_agree_with_plain_tensors(request):
    device = _test_device(request)
    # The sweep reseeds before every op; leave the session's random state as it found it.
    with torch.random.fork_rng(devices=[] if torch.device(device).type == "cpu" else None):
        summary = run_sweep(device)
    _print_summary(summary)
    _write_report(summary)
    if not os.environ.get("OFFTENSOR_OPINFO_OPS"):
        assert summary["sample_runs"] > 5000, "the sweep ran suspiciously few samples"
    unexpected = {k: fs[0]["error"][:300] for k, fs in summary["failures"].items() if not fs[0]["known_exception"]}
    assert summary["agreement"] >= REQUIRED_AGREEMENT, (
        f"OpInfo agreement {summary['agreement']:.4%} is below {REQUIRED_AGREEMENT:.1%}; failures: {unexpected}"
    )


if __name__ == "__main__":
    result = run_sweep(_test_device())
    _print_summary(result)
    _write_report(result)
