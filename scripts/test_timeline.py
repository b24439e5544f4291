"""Where a two-worker test run's time went, from the timeline its workers wrote (tests/workers.py):

    TESSERA_TEST_TIMELINE=/tmp/timeline.jsonl python -m pytest -q -n 2 --dist loadfile
    python scripts/test_timeline.py /tmp/timeline.jsonl

Prints the run's span split by what ran (one test held the machine alone; two tests shared it; one test ran while
the other worker was idle or waiting), the time workers waited for the machine, and the tests that held it alone
longest, with the cores they kept busy. Then the CPU time the tests' processes took (the worker's and every process
it started), by file and by test: on a machine whose cores are all busy, a run is only made shorter by a test that
takes less CPU time.
"""

from __future__ import annotations

import argparse
import collections
import json
import os


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", help="the JSON-lines file of TESSERA_TEST_TIMELINE")
    parser.add_argument("--top", type=int, default=15, help="how many tests (and files) each list shows")
    parser.add_argument("--cores", type=int, default=os.cpu_count(), help="the cores of the machine that ran it")
    args = parser.parse_args()
    with open(args.timeline) as f:
        tests = [json.loads(line) for line in f if line.strip()]
    if not tests:
        raise SystemExit(f"error: {args.timeline} holds no test")

    # Intervals: a test runs shared from "got" (to "asked_alone" if it asked), alone from "got_alone" to "ended".
    events = []
    for t in tests:
        shared_end = t.get("asked_alone", t["ended"])
        events += [(t["got"], "shared", +1), (shared_end, "shared", -1)]
        if "got_alone" in t:
            events += [(t["got_alone"], "alone", +1), (t["ended"], "alone", -1)]
    events.sort()
    start, end = events[0][0], max(t["ended"] for t in tests)
    spans = {"alone": 0.0, "two shared": 0.0, "one shared": 0.0, "none": 0.0}
    running = {"shared": 0, "alone": 0}
    last = start
    for when, kind, delta in events:
        key = ("alone" if running["alone"] else "two shared" if running["shared"] >= 2
               else "one shared" if running["shared"] == 1 else "none")
        spans[key] += when - last
        running[kind] += delta
        last = when
    waited = sum(t["got"] - t["asked"] for t in tests)
    waited_alone = sum(t["got_alone"] - t["asked_alone"] for t in tests if "got_alone" in t)
    print(f"{len(tests)} tests over {end - start:.1f} s")
    for key, seconds in spans.items():
        print(f"  {key:11s} {seconds:8.1f} s")
    print(f"waited to start: {waited:.1f} s; waited to hold the machine alone: {waited_alone:.1f} s")
    alone = sorted((t for t in tests if "got_alone" in t), key=lambda t: t["got_alone"] - t["ended"])
    print(f"held alone longest ({len(alone)} tests held it alone):")
    for t in alone[:args.top]:
        held = t["ended"] - t["got_alone"]
        cores = f"  {t['busy_alone'] / held:4.2f} cores busy" if "busy_alone" in t and held > 0 else ""
        print(f"  {held:7.1f} s{cores}  {t['test']}")
    measured = [t for t in alone if "busy_alone" in t]
    if measured:
        held = sum(t["ended"] - t["got_alone"] for t in measured)
        idle = sum(args.cores * (t["ended"] - t["got_alone"]) - t["busy_alone"] for t in measured)
        print(f"while a test held the machine alone ({held:.1f} s): {idle:.1f} core-s of {args.cores} cores idle")
    if not all("cpu" in t for t in tests):
        return
    by_file = collections.Counter()
    for t in tests:
        by_file[t["test"].split("::")[0]] += t["cpu"]
    print(f"CPU time of the tests' processes: {sum(by_file.values()):.1f} core-s; by file:")
    for name, cpu in by_file.most_common(args.top):
        print(f"  {cpu:8.1f} core-s  {name}")
    print("by test:")
    for t in sorted(tests, key=lambda t: -t["cpu"])[:args.top]:
        print(f"  {t['cpu']:8.1f} core-s  {t['ended'] - t['got']:7.1f} s  {t['test']}")


if __name__ == "__main__":
    main()
