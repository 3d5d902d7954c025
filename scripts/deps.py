"""Which of the tests' and the demo's packages this Python lacks, read from requirements-test.txt.

    python scripts/deps.py missing     # the pins of direct packages missing or older than their floor
    python scripts/deps.py missing required|optional   # only those the tests need, or only the rest
    python scripts/deps.py direct      # every direct package's pin, one a line
    python scripts/deps.py report      # name, pin, floor and what is installed, one a line

Standard library only, and nothing is imported: installed versions come from package metadata, so
this runs in a second even where importing transformers takes several. Used by scripts/setup.sh.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys

LOCK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "requirements-test.txt")
_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\s*(?:#\s*(.*))?$")
_FLOOR = re.compile(r"\bdirect, floor (\S+)")
_OPTIONAL = re.compile(r"\(optional\b")


def version_key(version: str) -> tuple:
    """The release numbers of a version (``"2.13.0+cpu"`` -> ``(2, 13, 0)``), enough to compare
    with a floor; a version with none sorts first."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def read_lock(path: str = LOCK) -> list:
    """[(name, pin, floor or None, optional)] for every pinned line; a floor marks a direct
    package, "(optional" one that offtensor runs without (what it is for is skipped)."""
    pins = []
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            match = _LINE.match(line)
            if match is None:
                raise SystemExit(f"{path}:{number}: not an exact pin (name==version): {line!r}")
            name, pin, comment = match.groups()
            floor = _FLOOR.search(comment or "")
            pins.append((name, pin, floor.group(1) if floor else None, bool(_OPTIONAL.search(comment or ""))))
    return pins


def installed(name: str):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(pins, which: str = "all") -> list:
    """``name==pin`` of each direct package that is not installed or is older than its floor;
    ``which``: "all", "required" or "optional"."""
    return [f"{name}=={pin}" for name, pin, floor, optional in pins
            if floor is not None and which in ("all", "optional" if optional else "required")
            and (installed(name) is None or version_key(installed(name)) < version_key(floor))]


def main(argv) -> int:
    pins = read_lock()
    command = argv[1] if len(argv) > 1 else "report"
    if command == "missing":
        print(" ".join(missing(pins, argv[2] if len(argv) > 2 else "all")))
    elif command == "direct":
        print("\n".join(f"{name}=={pin}" for name, pin, floor, _ in pins if floor is not None))
    elif command == "report":
        for name, pin, floor, optional in pins:
            if floor is not None:
                print(f"{name:14} pin {pin:12} floor {floor:8} installed {installed(name) or '-':12}"
                      f"{' optional' if optional else ''}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
