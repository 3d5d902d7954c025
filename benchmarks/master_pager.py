"""The cost of reading ``master.pager``, which every op on an offloaded weight does once or twice:
the weak reference's call plus the orphan test (a master whose pager died moves to the default
pager), against the weak reference's call alone, alternating in one process so that the machine's
load cancels out.

    python benchmarks/master_pager.py [--runs 15] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import offtensor as ot  # noqa: E402
from offtensor.pager import Master  # noqa: E402
from results_io import save_result  # noqa: E402


class WeakOnly(Master):
    """The property as it was before orphans: the weak reference's call alone."""

    __slots__ = ()
    pager = property(lambda self: self._owner[0]())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--number", type=int, default=200_000)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)
    master = ot.offload(torch.randn(4, 4), device="cpu")._master
    weak_only = object.__new__(WeakOnly)
    weak_only._owner = master._owner
    times = {"weakref only": [], "weakref + orphan test": []}
    for _ in range(args.runs):
        for label, m in (("weakref + orphan test", master), ("weakref only", weak_only)):
            best = min(timeit.repeat("m.pager", globals={"m": m}, number=args.number, repeat=3))
            times[label].append(best / args.number * 1e9)
    ns = {label: statistics.median(v) for label, v in times.items()}
    print(f"master.pager: {ns['weakref only']:.1f} ns with the weak reference alone, "
          f"{ns['weakref + orphan test']:.1f} ns with the orphan test (median of {args.runs} alternating runs)")
    save_result(args.out, "master_pager_cpu.json", "master.pager read (ns)", torch.device("cpu"), argv,
                {"runs": args.runs, "number": args.number, "ns_median": ns, "ns_runs": times})


if __name__ == "__main__":
    main()
