"""Where a warning points: the user's line, not offtensor's.

A warning raised inside offtensor (an assignment placed by the wrapping class, an op paged by
dispatch) is reached through a number of offtensor's and torch's own frames that depends on the
path taken, so a fixed ``stacklevel`` points into one of them on the other paths. ``stacklevel()``
counts them instead (what Python 3.12's ``skip_file_prefixes`` does; 3.11 has none)."""

from __future__ import annotations

import os
import sys

import torch

_SKIPPED = (os.path.dirname(os.path.abspath(__file__)) + os.sep, os.path.dirname(torch.__file__) + os.sep)


def stacklevel() -> int:
    """The ``stacklevel`` for a ``warnings.warn`` made by this function's caller that names the
    first frame outside offtensor and torch (the user's line, or the library's that called torch)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame, level = frame.f_back, level + 1
    return level
