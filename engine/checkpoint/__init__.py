"""Checkpoints on torch.distributed.checkpoint (DCP): save, resume on any mesh, survive any crash.

- ``files``: the layout of a checkpoint folder, commit markers, checks without loading, a safe reader.
- ``resume``: where a run starts (``plan_resume`` returns a ResumePlan) and the checks of its checkpoint.
- ``checkpointer``: the Checkpointer, which saves (sync or async) and loads a run's explicit state.

Layout of one checkpoint, ``<checkpoint.folder>/step-000100/``:

- ``.metadata`` and ``__<rank>_<n>.distcp``: DCP's files. They hold the model (``model.<fqn>``) and the
  optimizer state (``optim.<fqn>.<exp_avg|exp_avg_sq|step>``) as sharded tensors, named by the full model's
  parameter names whatever the layout (FSDP/TP shards are DTensors, pipeline stages keep the whole model's
  names), so DCP reshards them on load to any mesh. Nothing else goes into DCP: no pickled Python object.
- ``train_state.json``: step, lr schedule, model name and flavor, the layout it was saved on, and the settings of the
  run that saved it that decide what a resumed run computes (model, data, training, optimizer, ...).
- ``dataloader/dp-00003.json``: the data position of each data-parallel rank (every logical data shard's
  position; engine/data/loader.py), so a run resumes on another dp degree without repeating or skipping.
- ``rng/rank-00005.json``: each rank's random generators (restored when the layout is the same).
- ``COMMITTED.json``: written last, by rank 0, once every rank has written everything; it lists every file
  with its size. A folder without it is incomplete: never loaded, never counted by keep_latest_k.
"""
