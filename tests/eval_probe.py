"""Evaluation probe, run by tests/test_eval.py under torchrun (or as one process).

``python tests/eval_probe.py OUT.json [--section.key value ...]``: builds the Trainer for the config and
evaluates (no gradients) the first two batches of every data-parallel rank; rank 0 writes the loss.
"""

from __future__ import annotations

import json
import sys

from engine.distributed import destroy_distributed, init_distributed
from engine.train import check
from engine.trainer import Trainer


def main() -> None:
    out, argv = sys.argv[1], sys.argv[2:]
    cfg = check(argv)
    world = init_distributed()
    trainer = Trainer(cfg, world)
    batches = iter(trainer.dataloader)
    loss = float(trainer.evaluate([next(batches) for _ in range(2)]))
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump({"loss": loss}, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
