"""Optional packages: matplotlib draws the PNG plots, tqdm the progress bars. Without them
everything else runs as before (JSON, tables, the load itself); one warning per package and
process says what is skipped. torchao (quantised weights), where it is installed, is imported by
transformers; what its import logs on a CPU torch is kept out of the plan command's and the tests'
output (``quiet_torchao_on_cpu_torch``)."""

from __future__ import annotations

import importlib
import logging
import warnings

_warned = set()  # top-level package names already warned about in this process


def optional_import(module: str, skipped: str):
    """``module`` imported, or None with a one-time warning that ``skipped`` are skipped."""
    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.partition(".")[0]
        if package not in _warned:
            _warned.add(package)
            warnings.warn(f"offtensor: {package} is not installed, so {skipped} are skipped "
                          f"(pip install {package} to get them)", stacklevel=3)
        return None


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None (warned once) without matplotlib."""
    if optional_import("matplotlib", "PNG plots") is None:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class _TorchaoOnCpuTorch(logging.Filter):
    """torchao comes from PyPI only as a CUDA build (the newest, 0.18.0, as every older one), and
    transformers imports it whenever it is installed. On a CPU torch its import logs three things
    that say nothing about the caller's model: its CUDA kernels (``_C_*.so``, linked against
    libc10_cuda) do not load, there is no triton, and torch deprecates the ``register_constant`` of
    its enums. Only those records are dropped, the first two only without CUDA: on a GPU a kernel
    that fails to load is news."""

    def filter(self, record: logging.LogRecord) -> bool:
        import torch

        message = str(record.msg)
        if record.name == "torch.utils._pytree":
            enum = record.args[0] if isinstance(record.args, tuple) and record.args else None
            return not ("is an Enum subclass" in message and getattr(enum, "__module__", "").startswith("torchao"))
        if torch.version.cuda is not None:
            return True
        cuda_kernel = message.startswith("Failed to load ") and "/torchao/_C" in message
        return not (cuda_kernel or "Detected no triton" in message)


def quiet_torchao_on_cpu_torch() -> None:
    """Drops torchao's import noise on a CPU torch (``_TorchaoOnCpuTorch``) from this process's logs.
    For the processes offtensor runs itself (``python -m offtensor plan``, the tests); importing
    offtensor leaves other packages' logging alone."""
    for name in ("torchao", "torchao.kernel.intmm", "torch.utils._pytree"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _TorchaoOnCpuTorch) for f in logger.filters):
            logger.addFilter(_TorchaoOnCpuTorch())
