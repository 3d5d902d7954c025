"""The architecture sweep (tests/test_sweep.py) under the pinned transformers and under another one,
and what changed between them: architectures the other release adds or drops, and cases whose
result changed (a new failure above all). Run by scripts/newest.sh; outside CI.

    python scripts/sweep_compare.py OTHER_SITE_DIR [--json out.json]

OTHER_SITE_DIR holds the other transformers (pip install --target); it goes first on the child's
sys.path. Exit status 1 when a case fails under either version.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_CHILD = r"""
import json, sys, warnings
sys.path.insert(0, "tests")
import transformers
import test_sweep as sweep
from transformers.models.auto import modeling_auto
results = {f"{f}/{n}": sweep.run_architecture(f, n) for f, n in sweep.CASES}
known = {n for _, names in sweep.FAMILIES.values() for n in names}
offered = set()
for mapping, _ in sweep.FAMILIES.values():
    offered |= set(getattr(modeling_auto, mapping))
print(json.dumps({"version": transformers.__version__, "results": results,
                  "untried": sorted(offered - known), "offered": sorted(offered)}))
"""


def run_sweep(site=None) -> dict:
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.abspath(site), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the sweep did not run{' with ' + site if site else ''}:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def verdict(result) -> str:
    return "pass" if result is None else result.split(":", 1)[0]


def compare(pinned: dict, other: dict) -> list:
    """Lines saying what differs between the two sweeps."""
    a, b = pinned["version"], other["version"]
    lines = [f"transformers {a} (pinned) against {b}"]
    for label, sweep in (("pinned", pinned), ("other", other)):
        counts = {}
        for result in sweep["results"].values():
            counts[verdict(result)] = counts.get(verdict(result), 0) + 1
        lines.append(f"  {sweep['version']} ({label}): " + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("pass", "fail", "skip")))
    added = sorted(set(other["offered"]) - set(pinned["offered"]))
    dropped = sorted(set(pinned["offered"]) - set(other["offered"]))
    lines.append(f"  architectures new in {b}: {', '.join(added) or 'none'}")
    lines.append(f"  architectures gone in {b}: {', '.join(dropped) or 'none'}")
    untried = sorted(set(other["untried"]))
    lines.append(f"  offered by {b} but not in the sweep's lists ({len(untried)}): {', '.join(untried) or 'none'}")
    for case in sorted(set(pinned["results"]) | set(other["results"])):
        ra, rb = pinned["results"].get(case), other["results"].get(case)
        if verdict(ra) != verdict(rb):
            lines.append(f"  {case}: {verdict(ra)} -> {verdict(rb)}: {rb or ra}")
    for label, sweep in (("pinned", pinned), ("other", other)):
        for case, result in sorted(sweep["results"].items()):
            if verdict(result) == "fail":
                lines.append(f"  FAILS under {sweep['version']} ({label}): {case}: {result}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("site", help="directory holding the other transformers (first on the path)")
    parser.add_argument("--json", help="write both sweeps' results here")
    args = parser.parse_args(argv)
    pinned, other = run_sweep(), run_sweep(args.site)
    print("\n".join(compare(pinned, other)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"pinned": pinned, "other": other}, f, indent=1)
    failed = any(verdict(r) == "fail" for s in (pinned, other) for r in s["results"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
