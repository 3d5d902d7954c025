"""Readers of safetensors files other than the loader: the vLLM-style models' ``iterate_checkpoint``
and the learned look-ahead's ``LookaheadPredictor.load``. Both mapped the file with safetensors'
``safe_open``: a file truncated between the mapping and a tensor's read killed the whole process
with SIGBUS. Those cases run in a child process, so that a crash fails the test instead of ending
pytest. Each reader now checks every header as the loader does and reads the tensors, so a damaged
file is an ``ot.CheckpointError`` naming the file and the bytes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import offtensor as ot
from offtensor.models import vllm_deepseek as vd
from offtensor.moe.predictor import LookaheadPredictor

safetensors_torch = pytest.importorskip("safetensors.torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _in_a_child(script: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], env=env, capture_output=True,
                          text=True, timeout=120)
    if done.returncode < 0:
        pytest.fail(f"the child died of {signal.Signals(-done.returncode).name}: {done.stderr[-2000:]}")
    return done


def _two_tensors(path) -> None:
    # 1 MiB each: the second lies pages past the 4 KiB the file is cut to.
    safetensors_torch.save_file({"weight.0": torch.ones(1 << 18), "weight.1": torch.full((1 << 18,), 2.0)}, path)


_ITERATE_THEN_TRUNCATE = """
    import os, sys
    import offtensor as ot
    from offtensor.models import vllm_deepseek as vd

    path = sys.argv[1]
    tensors = vd.iterate_checkpoint(path)
    next(tensors)
    os.truncate(path, 4096)  # another writer cuts the file once the first tensor is read
    try:
        next(tensors)
    except ot.CheckpointError as e:
        print("refused:", e)
"""


def test_iterate_checkpoint_on_a_file_truncated_while_read_is_a_checkpoint_error_not_sigbus(tmp_path):
    path = str(tmp_path / "model.safetensors")
    _two_tensors(path)
    done = _in_a_child(_ITERATE_THEN_TRUNCATE, path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused:" in done.stdout and "model.safetensors" in done.stdout, done.stdout
    assert "'weight.1'" in done.stdout and "truncated" in done.stdout, done.stdout


_LOAD_THEN_TRUNCATE = """
    import os, sys
    from offtensor.moe import predictor

    path = sys.argv[1]
    cut = []

    def int_then_truncate(value):  # the layer number of the first tensor read: the file is cut there
        if not cut:
            cut.append(os.truncate(path, 4096))
        return int(value)

    predictor.int = int_then_truncate
    try:
        predictor.LookaheadPredictor.load(path)
    except Exception as e:
        print("refused:", type(e).__name__, e)
"""


def test_a_lookahead_file_truncated_while_read_is_an_error_not_sigbus(tmp_path):
    path = str(tmp_path / "lookahead.safetensors")
    _two_tensors(path)
    done = _in_a_child(_LOAD_THEN_TRUNCATE, path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: CheckpointError" in done.stdout and "lookahead.safetensors" in done.stdout, done.stdout


def test_iterate_checkpoint_refuses_a_header_past_the_files_end_naming_the_tensor_and_bytes(tmp_path):
    # safe_open raised its own "incomplete metadata, file not fully covered", naming neither.
    path = str(tmp_path / "model.safetensors")
    _two_tensors(path)
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(ot.CheckpointError, match=r"'weight\.1' in .*model\.safetensors.* past the end of the file"):
        list(vd.iterate_checkpoint(str(tmp_path)))


def test_iterate_checkpoint_keeps_an_index_inside_its_directory_and_skips_the_lookahead(tmp_path):
    # It read whatever the index named (``../``, absolute paths), and a directory's look-ahead file
    # as if it were a shard of the model.
    root = tmp_path / "ckpt"
    root.mkdir()
    _two_tensors(str(tmp_path / "outside.safetensors"))
    with open(root / "model.safetensors.index.json", "w") as f:
        json.dump({"weight_map": {"weight.0": "../outside.safetensors"}}, f)
    with pytest.raises(ot.CheckpointError, match=r"'\.\./outside\.safetensors'.*outside the checkpoint directory"):
        list(vd.iterate_checkpoint(str(root)))
    os.remove(root / "model.safetensors.index.json")
    safetensors_torch.save_file({"a": torch.ones(3)}, str(root / "model.safetensors"))
    _two_tensors(str(root / "lookahead.safetensors"))
    assert [name for name, _ in vd.iterate_checkpoint(str(root))] == ["a"]


def test_iterate_checkpoint_gives_every_dtype_as_load_file_does(tmp_path):
    values = {"f32": torch.randn(3, 4), "bf16": torch.randn(5).bfloat16(), "i64": torch.arange(6),
              "bool": torch.tensor([True, False]), "empty": torch.empty(0, 3), "scalar": torch.tensor(2.5)}
    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file(values, path)
    got = dict(vd.iterate_checkpoint(path))
    expected = safetensors_torch.load_file(path)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape
        assert torch.equal(got[name].view(-1).view(torch.uint8) if tensor.numel() else got[name],
                           tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor), name


def test_a_lookahead_file_of_another_kind_is_an_error_naming_it(tmp_path):
    path = str(tmp_path / "lookahead.safetensors")
    safetensors_torch.save_file({"weight.x": torch.ones(2)}, path)
    with pytest.raises(ValueError, match=r"lookahead\.safetensors: unknown tensor 'weight\.x'"):
        LookaheadPredictor.load(path)
    safetensors_torch.save_file({"weight.0": torch.ones(2)}, path, metadata={"scores": "[1"})
    with pytest.raises(ValueError, match=r"lookahead\.safetensors: its scores metadata is not"):
        LookaheadPredictor.load(path)


def test_a_tensor_larger_than_the_machines_memory_is_refused_before_it_is_allocated(tmp_path, monkeypatch):
    # A sparse file declares a tensor of any size on a small disk; reading it allocated that much
    # (the reads then fault it in until the kernel kills the process, or torch's allocator refuses
    # with a bare RuntimeError naming no file).
    from offtensor import safetensors_files

    path = str(tmp_path / "model.safetensors")
    safetensors_torch.save_file({"small": torch.ones(4), "big": torch.ones(1 << 10)}, path)
    monkeypatch.setattr(safetensors_files, "physical_memory", lambda: 1000, raising=False)
    given = []
    with pytest.raises(ot.CheckpointError, match=r"tensor 'big' of .*model\.safetensors.* is 4096 bytes, more than "
                                                 r"this machine's 1000 bytes of memory"):
        for name, tensor in vd.iterate_checkpoint(path):
            given.append(name)
    assert given == []  # 'big' comes first in the file, and nothing was read for it
