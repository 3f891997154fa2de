"""Summarize ``pytest --timelog=PATH`` files (tests/conftest.py): per-file and slowest tests.

    python tests/timelog_report.py PATH [PATH ...] [--top N]

Wall: setup + call + teardown of each test as pytest ran it (module fixtures count in the
first test that uses them).  CPU: the test process's own CPU plus that of the child
processes it waited for (torchrun ranks, receivers), so CPU / wall shows how many cores a
test keeps busy.  Span: first test start to last test end, per file given.
"""
import argparse
import collections
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    rows = []
    for path in a.paths:
        part = [json.loads(line) for line in open(path)]
        span = max(r["end"] for r in part) - min(r["end"] - r["wall"] for r in part)
        wall, cpu = sum(r["wall"] for r in part), sum(r["cpu"] for r in part)
        failed = sum(1 for r in part if any(b.endswith("failed") for b in r["bad"]))
        print(f"{path}: {len(part)} tests, span {span:.0f} s, sum of walls {wall:.0f} s, CPU {cpu:.0f} s, "
              f"{failed} failed")
        rows += part
    by_file = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for r in rows:
        f = by_file[r["id"].split("::")[0]]
        f[0] += 1
        f[1] += r["wall"]
        f[2] += r["cpu"]
    total = sum(v[1] for v in by_file.values()) or 1
    print(f"\n{'wall s':>8} {'cpu s':>8} {'share':>6} {'tests':>5}  file")
    for name, (n, w, c) in sorted(by_file.items(), key=lambda kv: -kv[1][1])[: a.top]:
        print(f"{w:8.0f} {c:8.0f} {100 * w / total:5.1f}% {n:5d}  {name}")
    print(f"\n{'wall s':>8} {'cpu s':>8}  test (slowest {a.top})")
    for r in sorted(rows, key=lambda r: -r["wall"])[: a.top]:
        print(f"{r['wall']:8.1f} {r['cpu']:8.1f}  {r['id']}{'  ' + ','.join(r['bad']) if r['bad'] else ''}")


if __name__ == "__main__":
    main()
