"""Where the suite's time goes: `python scripts/test_times.py [REPORT ...] [--top N]` sums the seconds of JUnit
reports (`make test`'s artifacts/junit.xml, `make test-slow`'s artifacts/junit-slow.xml) per test module, slowest first, with each module's share
of the whole. The report's times are per test on its worker, fixtures' setup included (a module's server start
counts in its first test), so with two workers the sum is about twice the wall time."""
from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict


def module_seconds(path: str) -> dict[str, tuple[float, int]]:
    """{module file: (seconds, tests)} from a JUnit XML report."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").split("@")[0].replace(".", "/") + ".py"
        sums[module][0] += float(case.get("time") or 0)
        sums[module][1] += 1
    return {module: (seconds, int(count)) for module, (seconds, count) in sums.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="*", default=["artifacts/junit.xml"])
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    merged: dict[str, tuple[float, int]] = {}
    for report in args.reports:
        for module, (seconds, count) in module_seconds(report).items():
            before = merged.get(module, (0.0, 0))
            merged[module] = (before[0] + seconds, before[1] + count)
    modules = sorted(merged.items(), key=lambda item: -item[1][0])
    total = sum(seconds for seconds, _ in dict(modules).values())
    print(f"{'seconds':>8} {'share':>6} {'tests':>5}  module   (all: {total:.0f} s over {len(modules)} modules)")
    for module, (seconds, count) in modules[:args.top]:
        print(f"{seconds:8.1f} {seconds / total:6.1%} {count:5d}  {module}")


if __name__ == "__main__":
    main()
