"""Config: TOML + CLI overrides, types, unknown keys, --help, docstrings, dump."""

import dataclasses
import os
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from engine.config import SECTIONS, Config, ConfigError, dump, field_docs, help_text, parse_args
from engine.config.validation import validate


def test_defaults_validate():
    validate(Config())


def test_every_field_has_a_docstring():
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no docstring"


def test_field_docstrings_are_at_most_three_lines():
    import ast
    import inspect

    from engine.config import schema

    source = inspect.getsource(schema)
    lines = source.splitlines()
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef):
            for field_node, doc in zip(node.body, node.body[1:]):
                if isinstance(field_node, ast.AnnAssign) and isinstance(doc, ast.Expr):
                    name = f"{node.name}.{field_node.target.id}"
                    assert doc.end_lineno - doc.lineno < 3, f"{name}: docstring over three lines"
                    assert all(len(line) <= 120 for line in lines[doc.lineno - 1:doc.end_lineno]), name


def test_help_lists_every_field():
    text = help_text()
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f"--{section}.{f.name} " in text
    for variable in ("NGPU", "LOG_RANK", "CONFIG_FILE", "PYTHON", "TESSERA_BACKEND", "DRY_RUN", "GPU_MEMORY_GIB"):
        assert f"\n  {variable} " in text, variable


def test_toml_then_cli_overrides(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[training]\nsteps = 7\nseq_len = 64\n[optimizer]\nlr = 1e-3\n[metrics]\nenable_tensorboard = true\n')
    cfg = parse_args(["--config", str(path), "--training.steps", "9", "--optimizer.lr=5e-4", "--metrics.no-enable_tensorboard"])
    assert cfg.training.steps == 9 and cfg.training.seq_len == 64
    assert cfg.optimizer.lr == 5e-4
    assert cfg.metrics.enable_tensorboard is False
    cfg = parse_args(["--debug.deterministic", "--training.steps", "-3"])
    assert cfg.debug.deterministic is True and cfg.training.steps == -3
    cfg = parse_args(["--debug.deterministic", "false"])
    assert cfg.debug.deterministic is False


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.setps", "3"], "did you mean 'training.steps'"),
        (["--trainig.steps", "3"], "did you mean 'training.steps'"),
        (["--training.steps", "abc"], "training.steps: expected an integer"),
        (["--optimizer.lr", "fast"], "optimizer.lr: expected a number"),
        (["--debug.deterministic", "maybe"], "debug.deterministic: expected true or false"),
        (["--training.steps"], "--training.steps: expects a value"),
        (["stray"], "unexpected argument 'stray'"),
        (["--config", "/nonexistent/x.toml"], "--config: file '/nonexistent/x.toml' not found"),
        (["--config", "train_configs"], "--config: 'train_configs' is a folder"),
        (["--config", "a.toml", "--config=b.toml"], "--config: given twice ('a.toml', then 'b.toml')"),
        (["--parallelism.pp_layers_per_stage", "1,,2"], "parallelism.pp_layers_per_stage: an empty item in the list"),
        (["--float8.filter_fqns", "output,"], "float8.filter_fqns: an empty item in the list 'output,'"),
    ],
)
def test_parse_errors(argv, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        parse_args(argv)
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("checkpoint.enable_checkpoint", "true", "Tessera's is 'checkpoint.enable'"),
        ("job.config_file", "x.toml", "Tessera's is '--config' (a command-line option, not a config key)"),
        ("training.dataset", "c4", "Tessera's is 'data.dataset'"),
        ("parallelism.tensor_parallel_degree", "2", "Tessera's is 'parallelism.tp'"),
        ("activation_checkpoint.selective_ac_option", "2", "Tessera's is 'activation_checkpoint.selective_option'"),
    ],
)
def test_torchtitan_names_get_tesseras(tmp_path, key, value, message):
    """torchtitan's name of an option gets Tessera's name, on the command line and in a TOML file alike (not the
    nearest-looking key: checkpoint.enable_checkpoint looked like create_seed_checkpoint, which trains nothing)."""
    expected = f"unknown config key '{key}' (torchtitan's name); {message}"
    for argv in (["--" + key, value], [f"--{key}={value}"]):
        with pytest.raises(ConfigError) as e:
            parse_args(argv)
        assert str(e.value) == expected
    section, _, name = key.partition(".")
    path = tmp_path / "t.toml"
    path.write_text(f'[{section}]\n{name} = "{value}"\n')
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(path)])
    assert str(e.value) == expected


def test_torchtitan_table_names_tessera_keys():
    """Every torchtitan name in the table is not a Tessera key (it would never be looked up), and every Tessera
    name it gives is one (or --config)."""
    from engine.config import TORCHTITAN_NAMES

    keys = {f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
    assert len(TORCHTITAN_NAMES) >= 25
    assert not set(TORCHTITAN_NAMES) & keys
    assert set(TORCHTITAN_NAMES.values()) - keys == {"--config"}


@pytest.mark.parametrize(
    "key, suggestion",
    [
        ("checkpoint.enable_checkpointing", ""),  # shares only the word checkpoint with create_seed_checkpoint
        ("parallelism.pipeline_parallel_split_points", ""),  # torchtitan's, but no Tessera counterpart
        ("job.config", ""),  # not print_config
        ("metrics.log_frequency", " (did you mean 'metrics.log_freq'?)"),
        ("training.local_batchsize", " (did you mean 'training.local_batch_size'?)"),
        ("trainig.seq_len", " (did you mean 'training.seq_len'?)"),
        ("optimizer.warmup_steps", " (did you mean 'lr_scheduler.warmup_steps'?)"),  # another section's
        ("steps", " (did you mean 'training.steps' or 'validation.steps'?)"),
        ("stepz", " (did you mean 'training.steps' or 'validation.steps'?)"),
        ("compile", ": it is a section; give one of its keys, e.g. 'compile.enable'"),  # `--compile` as a flag
    ],
)
def test_unknown_keys_suggest_only_close_keys(key, suggestion):
    with pytest.raises(ConfigError) as e:
        parse_args(["--" + key, "1"])
    assert str(e.value) == f"unknown config key '{key}'{suggestion}"


def test_negated_booleans_take_no_value():
    for argv in (["--checkpoint.no-enable=true"], ["--checkpoint.no-enable", "false"]):
        with pytest.raises(ConfigError) as e:
            parse_args(argv)
        value = argv[0].partition("=")[2] or argv[1]
        assert str(e.value) == (f"--checkpoint.no-enable: takes no value (got '{value}'); use --checkpoint.enable "
                                "false or --checkpoint.no-enable")
    assert parse_args(["--checkpoint.enable", "--checkpoint.no-enable"]).checkpoint.enable is False


def test_toml_keys_outside_sections_and_string_values(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("steps = 5\n[training]\nseq_len = 64\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(path)])
    assert str(e.value) == (f"steps: the key 'steps' in {path} must sit in a section; put it under [training] or "
                            "[validation]")
    path.write_text("seq_len = 64\n")
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(path)])
    assert str(e.value) == f"seq_len: the key 'seq_len' in {path} must sit in a section; put it under [training]"
    for text, message in [
        ('[training]\nsteps = "5"\n', 'training.steps: expected an integer, got the string "5"'),
        ('[training]\nmax_norm = "1.0"\n', 'training.max_norm: expected a number, got the string "1.0"'),
        ('[debug]\ndeterministic = "true"\n', 'debug.deterministic: expected true or false, got the string "true"'),
        ("[job]\ndescription = false\n", "job.description: expected a string, got false"),
        ('[float8]\nfilter_fqns = "output"\n', 'float8.filter_fqns: expected a list, got the string "output"'),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as e:
            parse_args(["--config", str(path)])
        assert str(e.value) == message
    with pytest.raises(ConfigError) as e:  # the command line's values are all strings: shown as given
        parse_args(["--training.steps", "5x"])
    assert str(e.value) == "training.steps: expected an integer, got '5x'"


def test_toml_errors(tmp_path):
    bad_section = tmp_path / "a.toml"
    bad_section.write_text("[trainig]\nsteps = 3\n")
    with pytest.raises(ConfigError, match=r"unknown config section '\[trainig\]'.*did you mean 'training'"):
        parse_args(["--config", str(bad_section)])
    bad_type = tmp_path / "b.toml"
    bad_type.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match="training.steps: expected an integer"):
        parse_args(["--config", str(bad_type)])
    bad_syntax = tmp_path / "c.toml"
    bad_syntax.write_text("[training\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_args(["--config", str(bad_syntax)])
    latin1 = tmp_path / "d.toml"
    latin1.write_bytes('[job]\ndescription = "café"\n'.encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^--config: '.*d\.toml' is not UTF-8 text"):
        parse_args(["--config", str(latin1)])
    huge = tmp_path / "e.toml"
    huge.write_text("[comm]\ninit_timeout_seconds = 99999999999999999999\n")  # TOML's integers are unbounded
    with pytest.raises(ConfigError, match="^comm.init_timeout_seconds: 99999999999999999999 does not fit in a 64-bit"):
        parse_args(["--config", str(huge)])
    bom = tmp_path / "f.toml"  # a byte-order mark, as some Windows editors save: read as if absent
    bom.write_bytes(b"\xef\xbb\xbf[training]\nsteps = 7\n")
    assert parse_args(["--config", str(bom)]).training.steps == 7
    with pytest.raises(ConfigError, match="^--config: expects a TOML file path before --training.steps$"):
        parse_args(["--config", "--training.steps", "5"])


def test_a_pipe_as_config_is_read_by_one_process_only(tmp_path, monkeypatch):
    """--config <(...) is a pipe: one process reads it; the processes of a launch could not each read it."""
    pipe = tmp_path / "config.pipe"
    os.mkfifo(pipe)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^--config: '.*config\.pipe' is not a file \(a pipe"):
        parse_args(["--config", str(pipe)])


def test_integers_take_leading_zeros_and_prefixes():
    assert parse_args(["--debug.seed", "042"]).debug.seed == 42
    assert parse_args(["--debug.seed", "0x10"]).debug.seed == 16
    assert parse_args(["--training.steps", "1_000"]).training.steps == 1000


def test_home_is_expanded_in_path_fields(tmp_path, monkeypatch):
    """A leading ~ (which bash leaves alone in --key=~/x) is expanded once, when the value is read, in the TOML
    file and on the command line, so that the run and its checks see the same folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text('[data]\npath = "~/docs.jsonl"\n[checkpoint]\nfolder = "~/ckpt"\n')
    cfg = parse_args(["--config", "~/c.toml", "--job.dump_folder=~/run", "--profiling.save_traces_folder=~/tr",
                      "--job.description=~ stays in text"])
    assert cfg.job.dump_folder == str(tmp_path / "run") and cfg.profiling.save_traces_folder == str(tmp_path / "tr")
    assert cfg.data.path == str(tmp_path / "docs.jsonl") and cfg.checkpoint.folder == str(tmp_path / "ckpt")
    assert cfg.job.description == "~ stays in text"


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--training.steps", "0"], "training.steps"),
        (["--training.seq_len", "0"], "training.seq_len"),
        (["--training.local_batch_size", "0"], "training.local_batch_size"),
        (["--training.global_batch_size", "12"], "training.global_batch_size"),
        (["--training.max_norm", "0"], "training.max_norm"),
        (["--optimizer.lr", "-1e-3"], "optimizer.lr"),
        (["--optimizer.name", "Sgd"], "optimizer.name"),
        (["--optimizer.beta2", "1.5"], "optimizer.beta2"),
        (["--model.name", "gpt9"], "model.name"),
        (["--model.flavor", "9B"], "model.flavor"),
        (["--model.flavor", "8b"], "model.flavor: '8b' is not one of debugmodel, debugmodel_L2, debugmodel_tied, 1B, "
                                   "3B, 8B, 8B_L8, 8B_L2, 70B, 405B (did you mean '8B'?)"),
        (["--model.attn", "xformers"], "model.attn"),
        (["--model.attn_mask", "block_causal"], "model.attn_mask"),
        (["--validation.enable", "--training.steps", "10"],
         "validation.freq: 100 exceeds training.steps = 10, so validation would never run; set validation.freq to "
         "at most 10, or turn validation.enable off"),
        (["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_option", "99"],
         "activation_checkpoint.selective_option: 99 exceeds the 6 layers of debugmodel, and checkpointing every "
         "99-th block checkpoints the first one only; give an N from 1 to 6"),
        (["--lr_scheduler.decay_type", "exp"], "lr_scheduler.decay_type"),
        (["--metrics.log_freq", "0"], "metrics.log_freq"),
        (["--data.path", "/nonexistent/data.jsonl"], "data.path"),
        (["--data.tokenizer", "/nonexistent/tokenizer.json"], "data.tokenizer"),
        (["--job.dump_folder", ""], "job.dump_folder"),
        (["--debug.seed", "4294967296"], "debug.seed: must be in [0, 2**32 - 1]"),
        (["--debug.seed", "-1"], "debug.seed: must be in [0, 2**32 - 1]"),
        (["--training.seq_len", "4000000000000"], "training.seq_len: at most 16,777,216 tokens (2**24)"),
        (["--comm.train_timeout_seconds", "100000000000000"], "comm.train_timeout_seconds: at most 100,000,000 "
         "seconds"),
        (["--checkpoint.last_save_model_only"], "checkpoint.last_save_model_only: "),  # needs checkpoint.enable
        (["--checkpoint.initial_load_hf"], "checkpoint.initial_load_hf: no folder to load; set "
         "checkpoint.initial_load_path to the Hugging Face folder"),
        (["--checkpoint.initial_load_hf", "--checkpoint.initial_load_path", os.path.dirname(__file__)],
         f"checkpoint.initial_load_hf: '{os.path.dirname(__file__)}' (checkpoint.initial_load_path) has no config.json, "
         "so it is not a Hugging Face folder"),
        (["--checkpoint.create_seed_checkpoint", "--checkpoint.initial_load_path", "."],
         "checkpoint.initial_load_path: a seed checkpoint (checkpoint.create_seed_checkpoint) is the freshly "
         "initialized model"),
        # The values of options the layout does not use (pp = 1, cp = 1, no AC) are checked all the same.
        (["--parallelism.pp_schedule", "1f1b"], "parallelism.pp_schedule: '1f1b' is not one of GPipe, 1F1B, "
         "Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV (did you mean '1F1B'?)"),
        (["--parallelism.pp_schedule_csv", "/nonexistent/s.csv"], "parallelism.pp_schedule_csv"),
        (["--parallelism.pp_virtual_stages", "0"], "parallelism.pp_virtual_stages"),
        (["--parallelism.pp_microbatches", "0"], "parallelism.pp_microbatches"),
        (["--parallelism.pp_layers_per_stage", "2,-1"], "parallelism.pp_layers_per_stage"),
        (["--parallelism.cp_rotate", "ring"], "parallelism.cp_rotate"),
        (["--activation_checkpoint.selective_option", "every2"], "activation_checkpoint.selective_option"),
        (["--metrics.wandb_rewind"], "metrics.wandb_rewind"),
    ],
)
def test_validate_names_the_field(argv, field):
    cfg = parse_args(argv)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith(field), str(e.value)


def test_what_a_short_run_may_keep():
    """A warmup longer than the run keeps ramping (torchtitan accepts it too); validation every training.steps
    steps and a selective_option of every n_layers-th block (the first block only) still do something."""
    validate(parse_args(["--lr_scheduler.warmup_steps", "500", "--training.steps", "10"]))
    validate(parse_args(["--validation.enable", "--validation.freq", "10", "--training.steps", "10"]))
    validate(parse_args(["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_option", "6"]))
    validate(parse_args(["--validation.freq", "500", "--training.steps", "10"]))  # validation off


def test_global_batch_gives_accumulation():
    from engine.config.validation import grad_accumulation_steps

    cfg = parse_args(["--training.local_batch_size", "4", "--training.global_batch_size", "16"])
    validate(cfg)
    assert grad_accumulation_steps(cfg, dp=1) == 4
    assert grad_accumulation_steps(cfg, dp=2) == 2


def test_dump_round_trips(tmp_path):
    cfg = parse_args(["--training.steps", "11", "--data.path", str(tmp_path)])
    path = dump(cfg, str(tmp_path / "run"))
    with open(path, "rb") as f:
        data = tomllib.load(f)
    assert data["training"]["steps"] == 11
    again = parse_args(["--config", path])
    assert again == cfg


def test_dump_of_a_resumed_run_keeps_the_earlier_settings(tmp_path):
    folder = str(tmp_path / "run")
    first, second, third = (parse_args(["--training.steps", str(n)]) for n in (4, 8, 12))
    dump(first, folder)
    dump(first, folder, resumed_step=2)  # the same settings again: nothing to keep
    assert sorted(os.listdir(folder)) == ["config.toml"]
    dump(second, folder, resumed_step=4)
    dump(third, folder, resumed_step=4)  # a second go from step 4, with other settings again
    names = ["config.before-step-5.1.toml", "config.before-step-5.toml", "config.toml"]
    assert sorted(os.listdir(folder)) == names
    assert [parse_args(["--config", os.path.join(folder, n)]) for n in names] == [second, first, third]


def test_shipped_configs_parse():
    import glob

    files = sorted(glob.glob("train_configs/*.toml"))
    assert len(files) >= 4
    for path in files:
        parse_args(["--config", path])


def test_config_reference_doc_is_current():
    """docs/configuration.md's tables are what scripts/config_reference.py generates from the schema."""
    import subprocess

    proc = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout


def test_trace_buf_size_zero_turns_the_flight_recorder_off(tmp_path):
    """comm.trace_buf_size = 0 sets TORCH_FR_BUFFER_SIZE=0 (torch 2.11 and 2.13 read it before the older
    TORCH_NCCL_TRACE_BUFFER_SIZE, whose default 2,000 kept the recorder on); a user's variable wins."""
    from engine.distributed import comm_trace_prefix, set_flight_recorder_env

    env: dict = {}
    set_flight_recorder_env(0, str(tmp_path), env)
    assert env == {"TORCH_FR_BUFFER_SIZE": "0"}
    env = {}
    set_flight_recorder_env(500, str(tmp_path), env)
    assert env == {"TORCH_FR_BUFFER_SIZE": "500", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": comm_trace_prefix(str(tmp_path))}
    for user in ({"TORCH_FR_BUFFER_SIZE": "64"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "64"}):
        env = dict(user)
        set_flight_recorder_env(0, str(tmp_path), env)
        assert env == user


def test_print_config_prints_the_resolved_config_and_a_fresh_run_keeps_the_earlier_one(tmp_path, capsys):
    """job.print_config: rank 0 prints the resolved config, the same TOML it writes to <dump_folder>/config.toml
    (with the CLI overrides); off by default. A second, fresh run in the folder sets the first run's config.toml
    aside (config.1.toml, beside metrics.1.jsonl) instead of overwriting it."""
    from engine import train

    dump = tmp_path / "run"
    small = ["--job.dump_folder", str(dump), "--training.seq_len", "32", "--training.local_batch_size", "2",
             "--lr_scheduler.warmup_steps", "1"]
    assert train.main([*small, "--training.steps", "1", "--job.print_config"]) == 0
    out = capsys.readouterr().out
    first = (dump / "config.toml").read_text()
    assert first in out and "print_config = true" in first and "steps = 1\n" in first
    assert parse_args(["--config", str(dump / "config.toml")]).training.steps == 1
    assert train.main([*small, "--training.steps", "2"]) == 0
    out = capsys.readouterr().out
    assert (dump / "config.toml").read_text() not in out and "[training]" not in out
    assert (dump / "config.1.toml").read_text() == first and (dump / "metrics.1.jsonl").exists()
    assert parse_args(["--config", str(dump / "config.toml")]).training.steps == 2
