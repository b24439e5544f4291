"""Where a two-worker test run's time went, from the timeline its workers wrote (tests/workers.py):

    TESSERA_TEST_TIMELINE=/tmp/timeline.jsonl python -m pytest -q -n 2 --dist loadfile
    python scripts/test_timeline.py /tmp/timeline.jsonl

Prints the run's span split by what ran (one test held the machine alone; two tests shared it; one test ran while
the other worker was idle or waiting), the time workers waited for the machine, and the tests that held it alone
longest.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline", help="the JSON-lines file of TESSERA_TEST_TIMELINE")
    parser.add_argument("--top", type=int, default=15, help="how many of the longest alone-holders to list")
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
        print(f"  {t['ended'] - t['got_alone']:7.1f} s  {t['test']}")


if __name__ == "__main__":
    main()
