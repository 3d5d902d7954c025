"""Optional packages: matplotlib draws the PNG plots, tqdm the progress bars. Without them
everything else runs as before (JSON, tables, the load itself); one warning per package and
process says what is skipped."""

from __future__ import annotations

import importlib
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
