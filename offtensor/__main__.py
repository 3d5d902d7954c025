"""``python -m offtensor <command>``; the one command is ``demo`` (see offtensor/demo.py)."""

import sys

USAGE = "usage: python -m offtensor demo [--device cpu|cuda] [--tokens N] [--budget-fraction F] [--size small|medium|large]"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from .demo import main as demo

        return demo(rest)
    print(f"offtensor: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
