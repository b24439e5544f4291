"""The README's main job: `./run_train.sh` with its default config trains the debug model offline.

This is acceptance item 1 of the foundation: at least 100 steps, the loss falls by at least 30% from its
first logged value, and metrics.jsonl and the PNG plots are written. Only the dump folder is redirected
(into the test's temporary folder); everything else is the default config. Timing is not asserted here
(the run's wall time is printed by the run itself and measured in the closing notes).
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_default_run_trains_debug_model(tmp_path):
    dump = tmp_path / "debug_model"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("WORLD_SIZE", None)
    env.pop("NGPU", None)
    proc = subprocess.run(
        ["./run_train.sh", "--job.dump_folder", str(dump)], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    with open(dump / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    steps = [r["step"] for r in rows]
    assert steps[0] == 1 and steps[-1] >= 100, steps
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last <= 0.7 * first, f"loss {first:.3f} -> {last:.3f} fell by less than 30%"
    assert (dump / "loss.png").stat().st_size > 0
    assert (dump / "throughput.png").stat().st_size > 0
    assert (dump / "config.toml").exists()
