"""Resume probe, run by tests/test_checkpoint.py under torchrun (or as one process).

``python tests/ckpt_probe.py OUT.json STEPS [--section.key value ...]`` builds the Trainer for the given
config, which resumes from the run's newest checkpoint on whatever layout this launch has; then checks that
every model and optimizer value this rank holds equals the checkpoint's (read whole, in one process), and
draws the next STEPS steps' batches (without training) to record their sample ids. Rank 0 writes what every
rank found to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from engine.checkpoint import read_full
from engine.distributed import destroy_distributed, init_distributed
from engine.train import check
from engine.trainer import Trainer


def main() -> None:
    out, steps, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    cfg = check(argv)
    world = init_distributed()
    trainer = Trainer(cfg, world)
    assert trainer.resume_from is not None, "the probe expects a checkpoint to resume from"
    saved = read_full(trainer.resume_from.folder)
    held = {**trainer.checkpointer.model_state(), **trainer.checkpointer.optimizer_state()[0]}
    mismatched = []
    for key, value in held.items():
        whole = value.full_tensor() if isinstance(value, DTensor) else value
        if not torch.equal(whole.detach().cpu(), saved[key]):
            mismatched.append(key)
    batches = iter(trainer.dataloader)
    ids = [[int(i) for _ in range(trainer.grad_accum) for i in next(batches)["sample_ids"]] for _ in range(steps)]
    mine = {"rank": world.rank, "dp_rank": trainer.dp_rank, "dp_leader": trainer.dims.is_dp_leader(),
            "step": trainer.step, "keys": sorted(held), "mismatched": mismatched, "ids": ids,
            "saved_keys": sorted(saved)}
    everyone = [mine]
    if dist.is_initialized():
        everyone = [None] * world.world_size
        dist.all_gather_object(everyone, mine)
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    destroy_distributed()


if __name__ == "__main__":
    main()
