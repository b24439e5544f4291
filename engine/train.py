"""Entry point: ``python -m engine.train [--config FILE] [--section.key value ...]`` (run_train.sh wraps it).

Every user error (config, data, tokenizer, layout) is found before any model memory is allocated or any
file is written, and ends the process with one ``error:`` line on stderr and exit status 2. User errors are
ValueErrors (ConfigError among them) whose message names the field; during set-up they are reported that way,
while errors inside the training loop keep their traceback, except a diverged run (nan or inf loss or gradient
norm, engine.step_guards.TrainingDiverged): one ``error:`` line and exit status 3, and data found unreadable
mid-run (engine.data.datasets.DataError, on the rank that reads it) or a full disk (StorageFull: a checkpoint or
the run folder could not be written; the incomplete step folder is removed): one ``error:`` line and exit status 2.
The other ranks, whose next collective then fails, report that rank's line and its status. Under several processes
the launcher (engine/launch.py) prints the line, else rank 0 does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
import tempfile

from engine.config import ConfigError, help_text, parse_args

# The other imports sit in the functions that need them: --help answers before torch is loaded.


def check(argv: list[str] | None = None, machine=None, world_size: int | None = None):
    """Parse and validate the configuration for this world (``world_size`` ranks, by default WORLD_SIZE's) and
    ``machine`` (an engine.config.validation.Machine: by default this one's); returns the config and its resolved
    Plan; raises ConfigError."""
    cfg = parse_args(argv)  # first: a mistyped flag or value is refused before torch is loaded
    from engine.config.validation import Machine, validate
    from engine.data.datasets import check_data_config
    from engine.distributed import backend_from_env, world_size_from_env

    machine = machine or Machine.this()
    plan = validate(cfg, world_size or world_size_from_env(), machine)
    backend_from_env(machine.cuda)
    check_output_folders(cfg)
    check_data_config(cfg)
    return cfg, plan


def check_run(argv: list[str], rank: int, world_size: int | None = None):
    """``check``, and on rank 0 the run folder not in use by a live run on this machine: everything a run is
    refused for before it starts. Returns the config and its Plan; raises ValueError."""
    cfg, plan = check(argv, world_size=world_size)
    if rank == 0:
        from engine.run_owner import check_free

        for folder, field in owned_folders(cfg):
            check_free(folder, field)
    return cfg, plan


def owned_folders(cfg) -> list[tuple[str, str]]:
    """(folder, the field naming it) of each folder a run writes and owns (engine.run_owner): job.dump_folder,
    and checkpoint.folder when checkpoints are on and it lies outside the run folder (an absolute path), so that two
    runs in two run folders never save into one checkpoint folder."""
    from engine.config import checkpoint_root

    folders = [(cfg.job.dump_folder, "job.dump_folder")]
    root, dump = os.path.realpath(checkpoint_root(cfg)), os.path.realpath(cfg.job.dump_folder)
    if cfg.checkpoint.enable and os.path.commonpath([root, dump]) != dump:
        folders.append((checkpoint_root(cfg), "checkpoint.folder"))
    return folders


def check_before_launch(argv: list[str], world_size: int) -> int:
    """The launcher's check before it starts ``world_size`` training processes (engine.launch, for run_train.sh),
    as rank 0 checks it. A user error prints its one ``error:`` line; returns the exit status (0: launch)."""
    try:
        check_run(argv, 0, world_size)
    except ValueError as e:
        return user_error(e, 2, show=True)
    return 0


def check_output_folders(cfg) -> None:
    """Every folder the run will write must be writable: the dump folder, the checkpoint folder (checkpoints, or the
    seed checkpoint) and the profiler's folders when on (relative ones are inside the dump folder)."""
    check_writable_folder(cfg.job.dump_folder, "job.dump_folder")
    if cfg.checkpoint.enable or cfg.checkpoint.create_seed_checkpoint:
        from engine.config import checkpoint_root

        check_writable_folder(checkpoint_root(cfg), "checkpoint.folder")
    pr = cfg.profiling
    for on, key in ((pr.enable_profiling, "save_traces_folder"),
                    (pr.enable_memory_snapshot, "save_memory_snapshot_folder")):
        if on:  # os.path.join keeps an absolute folder as it is
            check_writable_folder(os.path.join(cfg.job.dump_folder, getattr(pr, key)), f"profiling.{key}")


def check_writable_folder(folder: str, field: str) -> None:
    """``folder`` (the value of ``field``) must be a folder this process can write, or one it can create."""
    path = os.path.abspath(folder)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError(f"{field}: '{folder}' exists and is not a folder; give a folder path")
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if os.path.islink(existing) and not os.path.exists(existing):  # os.makedirs would fail on it mid-run
        raise ConfigError(f"{field}: '{existing}' is a symbolic link to '{os.readlink(existing)}', which does not "
                          "exist; create that folder, or give another")
    if not os.path.isdir(existing):
        raise ConfigError(f"{field}: cannot create '{folder}': '{existing}' is a file")
    try:  # permission bits do not tell (root, read-only mounts, /proc): make a folder there and remove it
        os.rmdir(tempfile.mkdtemp(prefix=".tessera-write-check-", dir=existing))
    except OSError as e:
        where = "" if existing == path else f" (in '{existing}')"
        raise ConfigError(f"{field}: cannot write '{folder}'{where}: {e.strerror}; give a folder you can "
                          "write to") from None


def finished_already(cfg, world, resume) -> bool:
    """Whether the run to resume has reached training.steps already (``resume.finished_at``, plan_resume's
    answer): then say so, write the last_save_hf folder if it is missing, and build nothing (no model, no checkpoint
    load; the run's config.toml and metrics stay as they are)."""
    from engine.checkpoint.checkpointer import export_last_hf
    from engine.data.tokenizer import tokenizer_path

    c = cfg.checkpoint
    step = resume.finished_at
    if step is None:
        return False
    if world.logs:
        print(f"resumed at step {step}: training.steps = {cfg.training.steps} is reached, nothing to train "
              "(raise training.steps to train on)", flush=True)
    if c.last_save_hf and step == cfg.training.steps:
        export_last_hf(cfg, step, tokenizer_path(cfg)[0], world.rank, world.world_size)
    elif c.last_save_hf and world.logs:
        print(f"checkpoint.last_save_hf: no Hugging Face folder written: it is made of the step training.steps = "
              f"{cfg.training.steps} ends at, and the newest checkpoint is of step {step} (python -m "
              "tools.convert_hf to-hf converts any step folder)", flush=True)
    return True


def user_error(e: BaseException, status: int, show: bool) -> int:
    """Report a user error: its ``error:`` line on stderr when ``show``, and, under torchrun, the line in this
    process's error file (torchrun's format, with Tessera's entry in extraInfo). Under Tessera's launcher
    (engine/launch.py, which sets LAUNCHER_ENV) no rank prints: the launcher reads the ranks' files, prints the one
    line itself (torchrun's --tee would put "[rank0]:" before a rank's own) and exits with ``status``. Returns
    ``status``."""
    from engine.lifetime import LAUNCHER_ENV

    if show and os.environ.get(LAUNCHER_ENV) != "1":
        print(f"error: {e}", file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json
        import time

        info = {"timestamp": str(int(time.time())), "tessera": {"status": status}}
        with open(path, "w") as f:
            json.dump({"message": {"message": str(e), "extraInfo": info}}, f)
    return status


def own_run_folders(cfg, world, at_exit: contextlib.ExitStack) -> None:
    """Rank 0 takes the run's folders (owned_folders) for this run (engine.run_owner), or every rank raises the
    OwnerError naming the live run that has one. ``at_exit`` ends each ownership taken."""
    from engine.distributed import agree_on_user_errors
    from engine.run_owner import RunOwner

    with agree_on_user_errors():
        if world.rank == 0:
            log = (lambda line: print(line, flush=True)) if world.logs else (lambda line: None)
            for folder, field in owned_folders(cfg):
                owner = RunOwner(folder, cfg.job.owner_timeout_seconds, on_lost=folder_lost, log=log, field=field)
                owner.acquire()
                at_exit.callback(owner.release)


def folder_lost(message: str) -> None:
    """Another run has taken this run's folder over (its heartbeat thread found out): stop now, with one line."""
    user_error(ValueError(message), 2, show=True)
    os._exit(2)


def crashed_quietly(e: BaseException, world_size: int) -> bool:
    """Under Tessera's launcher with several ranks, a failure's traceback goes into this process's error file
    instead of the console: most often a collective failed because a peer died, and the launcher names that rank
    in one line; otherwise it prints torchrun's report, with every failed rank's traceback from these files."""
    from engine.lifetime import LAUNCHER_ENV

    if world_size < 2 or os.environ.get(LAUNCHER_ENV) != "1" or not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return False
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    ErrorHandler().record_exception(e)
    return True


def main(argv: list[str] | None = None) -> int:
    from engine.lifetime import exit_with_parent, interrupted, watch_interrupt

    exit_with_parent()  # under a launcher: not one moment longer than it
    watch_interrupt()
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    with contextlib.ExitStack() as at_exit:  # the run folder's ownership ends last
        try:
            return run(argv, at_exit)
        except BaseException as e:
            if interrupted(e) and not isinstance(e, SystemExit):  # Ctrl-C during set-up (or the last teardown)
                if int(os.environ.get("RANK", "0")) == 0:
                    print("interrupted (SIGINT)", file=sys.stderr, flush=True)
                return 130
            if not isinstance(e, Exception):
                raise
            if crashed_quietly(e, int(os.environ.get("WORLD_SIZE", "1"))):
                return 1
            raise


def run(argv: list[str], at_exit: contextlib.ExitStack) -> int:
    """Check, set up and train; returns the exit status. ``at_exit`` ends the run folder's ownership."""
    rank = int(os.environ.get("RANK", "0"))
    cfg = None
    try:
        cfg, plan = check_run(argv, rank)
        if os.environ.get("TESSERA_CHECK_ONLY") == "1":
            return 0
        if cfg.checkpoint.enable:  # a SIGTERM from here on saves at a step boundary, or ends set-up with status 0
            from engine.distributed import defer_sigterm, forget_sigterm

            forget_sigterm()  # (one received by an earlier run in this process, as the tests run several)
            defer_sigterm()
        from engine.checkpoint.resume import plan_resume
        from engine.distributed import destroy_distributed, init_distributed
        from engine.faults import install_from_env
        from engine.trainer import Trainer

        install_from_env()  # tests' fault injection (TESSERA_FAULT_AT), when set

        world = init_distributed(cfg)
        try:
            own_run_folders(cfg, world, at_exit)
            plan = dataclasses.replace(plan, resume=plan_resume(cfg))
            if finished_already(cfg, world, plan.resume):
                destroy_distributed()
                return 0
            trainer = Trainer(cfg, world, plan)  # raises ValueError for user errors, before writing anything
        except BaseException:
            destroy_distributed()
            raise
    except ValueError as e:  # user errors (ConfigError is one) name their field
        return user_error(e, 2, show=rank == 0)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = e.filename or (cfg.job.dump_folder if cfg is not None else "the run folder")
        return user_error(ValueError(f"job.dump_folder: no space left on the device of {where}; free space there, or "
                                     "set job.dump_folder on another disk"), 2, show=rank == 0)
    from engine.checkpoint.files import StorageFull
    from engine.data.datasets import DataError
    from engine.distributed import peer_user_error
    from engine.lifetime import interrupted
    from engine.step_guards import TrainingDiverged

    crashed = False
    try:
        try:
            trainer.train()
        except BaseException as e:  # whatever Ctrl-C interrupted (a save's error, a collective's) is the interrupt
            if interrupted(e) and not isinstance(e, SystemExit):
                raise KeyboardInterrupt from e
            raise
    except KeyboardInterrupt:  # Ctrl-C (torchrun passes SIGINT on to every rank): stop now, one line
        crashed = True  # a peer may be stopped inside a collective: no process-group teardown
        if rank == 0:
            again = ("the same command resumes from the last committed checkpoint" if cfg.checkpoint.enable
                     else "nothing is saved without checkpoint.enable")
            print(f"interrupted (SIGINT) after step {trainer.step}; {again}", file=sys.stderr, flush=True)
        return 130
    except TrainingDiverged as e:  # every rank sees it
        return user_error(e, 3, show=rank == 0)
    except (DataError, StorageFull) as e:  # on the rank(s) that met it (announced to the others)
        return user_error(e, 2, show=True)
    except Exception:  # a collective failed: maybe its peer left on a user error (above); then report that
        peer = peer_user_error()
        if peer is None:  # a crash, or a peer died: destroying the process group could wait on the dead peer
            crashed = True
            raise
        trainer.checkpointer.close_alone()  # an async save the peer finished writing commits
        return user_error(ValueError(f"[rank {peer['rank']}] {peer['message']}"), peer["status"], show=rank == 0)
    finally:
        if not crashed:
            destroy_distributed()
    return 0


if __name__ == "__main__":
    import gc

    from engine.lifetime import exit_now

    # What set-up builds (torch and the engine's modules, the model) lives for the whole run: Python's automatic full
    # collections while it loads find nothing to free and slow every start (docs/testing.md). The training loop
    # collects on its own schedule (engine.step_guards.scheduled_gc).
    gc.disable()
    exit_now(main())  # without the interpreter's slow teardown of torch
