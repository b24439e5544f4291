"""Where a CUDA run's reserved memory came from, read from one of its allocator snapshots
(`--profiling.enable_memory_snapshot`; engine/profiling.py writes them).

    python3 bench/snapshot_summary.py RUN/memory_snapshot/iteration_5/rank0_memory_snapshot.pickle [--top 8]

Prints two things:
- the allocator's state when the snapshot was taken: memory reserved, held by live blocks, and free inside
  the reserved segments (what the caching allocator keeps but no tensor uses), with the largest free blocks;
- the reserved memory's growth in the recorded history: each `segment_alloc` (a cudaMalloc'd segment) and
  `segment_map` (pages mapped into an expandable segment), grouped by the code that asked for it, biggest
  first. The code is named by the innermost frames of the allocation that caused the growth (the `alloc` that
  follows it in the history), leaving out torch's own frames except Inductor's (its generated kernels and its
  autotuner, which benchmarks on clones of the tensors a kernel writes).

The history holds the newest events only (engine/profiling.py: MEMORY_SNAPSHOT_ENTRIES); the summary says how
many it holds and the time they span.
"""
from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

GIB = 1024 ** 3
GROWTH = ("segment_alloc", "segment_map")
SHRINK = ("segment_free", "segment_unmap")


def _name(frame: dict) -> str:
    filename = frame.get("filename", "?")
    short = "inductor output code" if "/torchinductor_" in filename else "/".join(filename.split("/")[-2:])
    return f"{short}:{frame.get('line', '?')} {frame.get('name', '?')}"


def _where(frames: list[dict], depth: int = 3) -> str:
    """The innermost ``depth`` frames worth naming: torch's own are left out, except Inductor's."""
    kept = [f for f in frames if f.get("filename") not in (None, "??", "<string>")
            and ("/torch/" not in f["filename"] or "/_inductor/" in f["filename"])]
    return " <- ".join(_name(f) for f in kept[:depth]) if kept else "(no Python frame recorded)"


def summarize(snapshot: dict, top: int = 8) -> list[str]:
    """The summary's lines (see the module docstring)."""
    lines = []
    segments = snapshot.get("segments", [])
    reserved = sum(s["total_size"] for s in segments)
    allocated = sum(s["allocated_size"] for s in segments)
    free_blocks = sorted((b["size"] for s in segments for b in s["blocks"] if b["state"] == "inactive"), reverse=True)
    lines.append(f"at the snapshot: reserved {reserved / GIB:.2f} GiB, in live blocks {allocated / GIB:.2f} GiB, free "
                 f"inside reserved segments {(reserved - allocated) / GIB:.2f} GiB in {len(free_blocks)} blocks; "
                 f"the largest: " + ", ".join(f"{b / GIB:.2f}" for b in free_blocks[:5]) + " GiB")

    for device, trace in enumerate(snapshot.get("device_traces", [])):
        if not trace:
            continue
        grown: dict[str, int] = defaultdict(int)
        events: dict[str, int] = defaultdict(int)
        shrunk = 0
        pending: list[int] = []  # growth events waiting for the allocation that caused them
        for entry in trace:
            action = entry["action"]
            if action in GROWTH:
                pending.append(entry["size"])
            elif action in SHRINK:
                shrunk += entry["size"]
            elif action == "alloc" and pending:
                key = _where(entry.get("frames", []))
                grown[key] += sum(pending)
                events[key] += len(pending)
                pending.clear()
        if pending:
            grown["(no allocation recorded after it)"] += sum(pending)
        total = sum(grown.values())
        first = trace[0].get("time_us")
        last = trace[-1].get("time_us")
        span = f" over {(last - first) / 1e6:.1f} s of history" if first is not None and last is not None else ""
        lines.append(f"device {device}: reserved memory grew {total / GIB:.2f} GiB and shrank {shrunk / GIB:.2f} GiB "
                     f"in {len(trace)} recorded events{span}; growth by the code that asked for it:")
        for key, size in sorted(grown.items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"  {size / GIB:7.2f} GiB in {events[key]:4d} events  {key}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("snapshot", help="a rank<R>_memory_snapshot.pickle")
    p.add_argument("--top", type=int, default=8, help="groups of growth to print (default 8)")
    args = p.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        snapshot = pickle.load(f)
    print("\n".join(summarize(snapshot, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
