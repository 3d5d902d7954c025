"""Set-up on any fresh machine: every test and demo package pinned exactly, installed only
when missing or too old; optional packages (matplotlib, tqdm) degrade to a warning and a skipped
PNG or progress bar, never a failure. Run again, scripts/setup.sh builds nothing; scripts/test.sh
runs the files it is given, all of tests/ without any."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

import offtensor as ot
from offtensor import _optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("deps", os.path.join(ROOT, "scripts", "deps.py"))
deps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(deps)


def test_every_package_in_the_lock_is_pinned_exactly_and_each_floor_is_below_its_pin():
    pins = deps.read_lock()
    names = [name.lower() for name, *_ in pins]
    assert len(names) == len(set(names)), "a package is pinned twice"
    direct = {name: (pin, floor) for name, pin, floor, _ in pins if floor is not None}
    assert {"transformers", "accelerate", "safetensors", "numpy", "hypothesis", "pytest", "expecttest",
            "tqdm", "matplotlib"} <= set(direct)
    assert "torch" not in names  # kept when present, torch==2.13.0 otherwise (scripts/setup.sh)
    for name, (pin, floor) in direct.items():
        assert deps.version_key(floor) <= deps.version_key(pin), name


def test_a_lock_line_that_is_not_an_exact_pin_is_refused(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("transformers>=5.17  # direct, floor 5.17\n")
    with pytest.raises(SystemExit, match=r"lock.txt:1: not an exact pin"):
        deps.read_lock(str(lock))


def test_only_packages_missing_or_older_than_their_floor_are_installed(monkeypatch):
    pins = [("transformers", "5.24.0", "5.17", False), ("numpy", "2.4.6", "1.26", False),
            ("tqdm", "4.70.1", "4.60", True), ("regex", "2026.11.19", None, False)]
    installed = {"transformers": "5.17.0", "numpy": "1.25.2", "regex": None}
    monkeypatch.setattr(deps, "installed", lambda name: installed.get(name))
    # 5.17 is accepted as it is (the GPU machine's), numpy 1.25 is too old, tqdm is missing, and a
    # dependency-only pin (regex) is never installed on its own.
    assert deps.missing(pins) == ["numpy==2.4.6", "tqdm==4.70.1"]
    assert deps.missing(pins, "required") == ["numpy==2.4.6"]
    assert deps.missing(pins, "optional") == ["tqdm==4.70.1"]
    assert deps.version_key("2.13.0+cpu") == (2, 13, 0) and deps.version_key("5.24.0rc1") == (5, 24, 0)


def test_this_environment_holds_every_required_package_at_or_above_its_floor():
    assert deps.missing(deps.read_lock(), "required") == []


@pytest.fixture
def without(monkeypatch):
    """Makes ``import name`` fail for the given top-level packages, as on a machine without them."""
    def hide(*packages):
        for name in list(sys.modules):
            if name.partition(".")[0] in packages:
                monkeypatch.delitem(sys.modules, name)
        for package in packages:
            monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
        monkeypatch.setattr(_optional, "_warned", set())
    return hide


def test_without_matplotlib_a_plot_is_skipped_with_one_warning_and_the_trace_still_saved(without, tmp_path):
    without("matplotlib")
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    tl = ot.plan(model, budget_gb=300_000 / (1 << 30), example_inputs=(torch.empty(2, 256, device="meta"),), steps=2)
    with pytest.warns(UserWarning, match="matplotlib is not installed, so PNG plots are skipped"):
        assert tl.plot(str(tmp_path / "plan.png")) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        assert tl.plot(str(tmp_path / "again.png")) is None
    assert not list(tmp_path.glob("*.png"))
    assert os.path.getsize(tl.save(str(tmp_path / "trace.json"))) > 0
    assert tl.replay("h200").step_ms > 0


def test_plan_command_without_matplotlib_prints_its_table(tmp_path):
    code = ("import sys, runpy; sys.modules['matplotlib'] = None; "
            "sys.argv = ['offtensor', 'plan', '--layers', '4', '--hidden', '256', '--ffn', '512', '--steps', '2', "
            f"'--png', {str(tmp_path / 'plan.png')!r}, '--trace', {str(tmp_path / 'plan.json')!r}]; "
            "runpy.run_module('offtensor', run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert "| decode |" in run.stdout and "skipped: no matplotlib" in run.stdout
    assert "matplotlib is not installed" in run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan-decode.json", "plan-prefill.json"]


def test_without_tqdm_a_load_warns_once_and_still_loads(without, tmp_path, device):
    from safetensors.torch import save_file

    without("tqdm")
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    save_file(reference.state_dict(), str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    with pytest.warns(UserWarning, match="tqdm is not installed, so progress bars are skipped"):
        ot.load_safetensors(model, str(tmp_path / "model.safetensors"), budget_gb=20_000 / (1 << 30), device=device,
                            progress=True)
    x = torch.randn(3, 64, device=device)
    reference.to(device)  # compared on the same device: a GPU's kernels need not round as the host's do
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))


# ---------------------------------------------------------------------------- the scripts, in a scratch checkout


def _scratch_checkout(tmp_path, *files):
    """A checkout in tmp_path holding ``files`` copied from this one, so a script runs against it
    and never against this checkout or the .venv it shares."""
    import shutil

    root = tmp_path / "checkout"
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(os.path.join(ROOT, name), root / name)
    return root


def test_setup_run_twice_builds_offtensor_only_the_first_time(tmp_path):
    # A .venv of its own that sees this one's packages (as setup.sh's own .venv sees python3's), so
    # the check "is this checkout's offtensor the one installed?" runs for real; without the native
    # build (OFFTENSOR_NO_NATIVE=1), "building" is only the install of the checkout's path.
    import site

    root = _scratch_checkout(tmp_path, "scripts/setup.sh", "scripts/deps.py", "requirements-test.txt")
    (root / "offtensor").mkdir()
    (root / "offtensor" / "__init__.py").write_text("")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / ".venv")], check=True, timeout=120)
    venv_site = subprocess.run([str(root / ".venv/bin/python"), "-c", "import site; print(site.getsitepackages()[0])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(venv_site, "offtensor-python3-site.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    env = {**os.environ, "OFFTENSOR_NO_NATIVE": "1", "PIP_NO_INDEX": "1"}
    env.pop("PYTHONPATH", None)  # another checkout on it would be the offtensor found
    runs = [subprocess.run(["bash", str(root / "scripts/setup.sh")], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stdout + run.stderr
    assert "setup: building offtensor" in runs[0].stdout
    assert "building" not in runs[1].stdout, runs[1].stdout
    assert open(os.path.join(venv_site, "offtensor-checkout.pth")).read().strip() == str(root)


@pytest.fixture
def pytest_args(tmp_path):
    """Runs scripts/test.sh in a scratch checkout whose set-up does nothing and whose tests/ has two
    files; returns the test names that ran."""
    root = _scratch_checkout(tmp_path, "scripts/test.sh", "pyproject.toml")
    (root / "scripts" / "setup.sh").write_text("exit 0\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    python = root / ".venv" / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (root / "tests").mkdir()
    for name in ("a", "b"):
        (root / "tests" / f"test_{name}.py").write_text(f"def test_{name}():\n    pass\n")

    def ran(*args):
        run = subprocess.run(["bash", "scripts/test.sh", "-rA", "-p", "no:cacheprovider", *args], cwd=root,
                             capture_output=True, text=True, timeout=120, env={**os.environ, "OFFTENSOR_TEST_WORKERS": "0"})
        assert run.returncode == 0, run.stdout + run.stderr
        return sorted(name for name in ("test_a", "test_b") if f"::{name}" in run.stdout)
    return ran


def test_the_test_command_runs_only_the_files_it_is_given(pytest_args):
    assert pytest_args() == ["test_a", "test_b"]  # no arguments: all of tests/, as .ci/run asks
    assert pytest_args("tests/test_a.py") == ["test_a"]
    assert pytest_args("tests/test_b.py::test_b", "-x") == ["test_b"]
    assert pytest_args("-k", "test_b") == ["test_b"]  # options alone: still tests/
    assert pytest_args("tests") == ["test_a", "test_b"]


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is optional")
def test_torchao_imported_by_transformers_logs_nothing_into_the_tests_or_the_plan_commands_output(tmp_path):
    # transformers imports torchao because it is installed: in each test file that builds a
    # transformers model (a fresh process with the tests' conftest), and in plan --config.
    code = ("import sys; sys.path.insert(0, 'tests'); import conftest, transformers.modeling_utils; "
            "assert 'torchao' in sys.modules")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 32,
              "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, "-m", "offtensor", "plan", "--config", str(tmp_path), "--steps", "1",
                          "--prefill-tokens", "4", "--png", str(tmp_path / "plan.png")],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    for noise in ("Failed to load", "Detected no triton", "is an Enum subclass"):
        assert noise not in run.stderr, run.stderr
