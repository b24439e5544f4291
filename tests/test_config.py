"""Config: TOML + CLI overrides, types, unknown keys, --help, docstrings, dump."""

import dataclasses
import sys

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from engine.config import SECTIONS, Config, ConfigError, dump, field_docs, help_text, parse_args, validate


def test_defaults_validate():
    validate(Config())


def test_every_field_has_a_docstring():
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{section}.{f.name} has no docstring"


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
    ],
)
def test_parse_errors(argv, fragment):
    with pytest.raises(ConfigError, match=None) as e:
        parse_args(argv)
    assert fragment in str(e.value)


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
        (["--model.attn", "xformers"], "model.attn"),
        (["--model.attn_mask", "block_causal"], "model.attn_mask"),
        (["--lr_scheduler.warmup_steps", "500", "--training.steps", "10"],
         "lr_scheduler.warmup_steps: 500 exceeds training.steps = 10; lower lr_scheduler.warmup_steps or raise"),
        (["--lr_scheduler.decay_type", "exp"], "lr_scheduler.decay_type"),
        (["--metrics.log_freq", "0"], "metrics.log_freq"),
        (["--data.path", "/nonexistent/data.jsonl"], "data.path"),
        (["--data.tokenizer", "/nonexistent/tokenizer.json"], "data.tokenizer"),
        (["--job.dump_folder", ""], "job.dump_folder"),
        (["--debug.seed", "4294967296"], "debug.seed: must be in [0, 2**32 - 1]"),
        (["--debug.seed", "-1"], "debug.seed: must be in [0, 2**32 - 1]"),
        (["--checkpoint.last_save_model_only"], "checkpoint.last_save_model_only: "),  # needs checkpoint.enable
        # The values of options the layout does not use (pp = 1, cp = 1, no AC) are checked all the same.
        (["--parallelism.pp_schedule", "1f1b"], "parallelism.pp_schedule: '1f1b' is not one of"),
        (["--parallelism.pp_schedule_csv", "/nonexistent/s.csv"], "parallelism.pp_schedule_csv"),
        (["--parallelism.pp_virtual_stages", "0"], "parallelism.pp_virtual_stages"),
        (["--parallelism.pp_microbatches", "0"], "parallelism.pp_microbatches"),
        (["--parallelism.pp_layers_per_stage", "2,-1"], "parallelism.pp_layers_per_stage"),
        (["--parallelism.cp_rotate", "ring"], "parallelism.cp_rotate"),
        (["--activation_checkpoint.selective_option", "every2"], "activation_checkpoint.selective_option"),
    ],
)
def test_validate_names_the_field(argv, field):
    cfg = parse_args(argv)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith(field), str(e.value)


def test_global_batch_gives_accumulation():
    from engine.config import grad_accumulation_steps

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


def test_shipped_configs_parse():
    import glob

    files = sorted(glob.glob("train_configs/*.toml"))
    assert len(files) >= 4
    for path in files:
        parse_args(["--config", path])


def test_readme_config_reference_is_current():
    import subprocess

    proc = subprocess.run([sys.executable, "scripts/config_reference.py", "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
