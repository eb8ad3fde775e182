"""Configuration: YAML plus flags, and every bad value rejected in one line naming the key."""

import sys

import pytest

from conftest import run
from hvdkit import config
from hvdkit.config import ConfigError, TrainConfig


def test_yaml_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("batch-size: 64\nbase_lr: 1\nepochs: 3\nlr_decay_epochs: [1, 2]\namp: true\n")
    cfg = config.parse(["--config", str(path), "--epochs", "5", "--no-amp", "--fp16-allreduce"])
    assert (cfg.batch_size, cfg.base_lr, cfg.epochs, cfg.lr_decay_epochs) == (64, 1.0, 5, [1, 2])
    assert cfg.amp is False and cfg.fp16_allreduce is True
    assert isinstance(cfg.base_lr, float)
    assert config.parse([]) == TrainConfig()


def test_horovod_example_flag_names():
    cfg = config.parse(["--batch-size", "8", "--epochs", "2", "--base-lr", "0.1", "--warmup-epochs", "0",
                        "--batches-per-allreduce", "4", "--fp16-allreduce", "--use-adasum", "--max-steps", "9",
                        "--clip-grad-norm", "2.5", "--seed", "7", "--model", "mlp", "--dataset", "synthetic"])
    assert (cfg.batches_per_allreduce, cfg.use_adasum, cfg.max_steps, cfg.clip_grad_norm) == (4, True, 9, 2.5)


@pytest.mark.parametrize("yaml_text, message", [
    ("batch_size: 32\nbatch_sise: 3\n", "config: unknown key 'batch_sise'"),
    ("batch_size: many\n", "config: batch_size must be int (got str 'many')"),
    ("batch_size: 0\n", "config: batch_size must be > 0 (got 0)"),
    ("epochs: -1\n", "config: epochs must be > 0 (got -1)"),
    ("base_lr: 0\n", "config: base_lr must be > 0 (got 0.0)"),
    ("amp: 1\n", "config: amp must be bool (got int 1)"),
    ("epochs: 2.5\n", "config: epochs must be int (got float 2.5)"),
    ("lr_schedule: linear\n", "config: lr_schedule must be one of cosine, step, none (got 'linear')"),
    ("lr_decay_epochs: [1, x]\n", "config: lr_decay_epochs must be a list of int"),
    ("max_steps: 0\n", "config: max_steps must be > 0 (got 0)"),
    ("clip_grad_norm: -1\n", "config: clip_grad_norm must be > 0 (got -1.0)"),
    ("use_adasum: true\ngradient_predivide_factor: 2\n", "gradient_predivide_factor must be 1.0 with use_adasum"),
    ("batch_size: [32\n", "malformed YAML"),
    ("- 1\n- 2\n", "must hold a mapping of keys, not list"),
])
def test_bad_yaml_values_name_the_key(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as info:
        config.parse(["--config", str(path)])
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_unwritable_directories_are_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="config: checkpoint_dir .* is not a directory"):
        config.parse(["--checkpoint-dir", str(blocker / "ckpt")])
    with pytest.raises(ConfigError, match="config: log_dir .* is not a directory"):
        config.parse(["--log-dir", str(blocker / "logs")])
    with pytest.raises(ConfigError, match="config: cannot read"):
        config.parse(["--config", str(tmp_path / "missing.yaml")])


@pytest.mark.parametrize("args, line", [
    (["--batch-size", "abc"], "hvdkit train: error: argument --batch-size: invalid int value: 'abc'"),
    (["--epochs", "0"], "hvdkit train: config: epochs must be > 0 (got 0)"),
    (["--model", "resnet9000"], "hvdkit train: unknown model 'resnet9000'; choose one of: mlp, cnn, resnet18"),
    (["--dataset", "imagenet"], "hvdkit train: data: unknown dataset 'imagenet'; choose one of: digits"),
    (["--dataset", "mnist"], "hvdkit train: data: --data-dir is required for mnist"),
    (["--bogus"], "hvdkit: error: unrecognized arguments: --bogus"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, args, line):
    proc = run([sys.executable, "-m", "hvdkit", "train", "--log-dir", str(tmp_path / "logs"), *args])
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(line), proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "logs").exists(), "nothing is written for a rejected run"


def test_a_config_refused_says_so_before_torch_loads(tmp_path):
    """A mistyped run's line comes before `import torch` (two CPU-seconds a rank): on every rank of
    a launched job, rank 0 says it."""
    program = ("import sys; from hvdkit.cli import main; code = main(sys.argv[1:]); "
               "print('torch' in sys.modules, code)")
    proc = run([sys.executable, "-c", program, "train", "--log-dir", str(tmp_path / "logs"), "--micro-batches", "2"])
    assert proc.stdout.split() == ["False", "2"], proc.stdout + proc.stderr
    assert proc.stderr.startswith("hvdkit train: config: micro_batches and pp_cuts are the pipeline's: give pp > 1 "), \
        proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "logs").exists()


def test_yaml_then_environment_then_flags(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("epochs: 3\nlog_dir: from-yaml\nbatch_size: 8\n")
    environ = {"HVDKIT_LOG_DIR": str(tmp_path / "from-env"), "HVDKIT_EPOCHS": "4", "HVDKIT_JOB_DIR": "/not/a/key"}
    parser = __import__("argparse").ArgumentParser()
    config.add_arguments(parser)
    cfg = config.from_args(parser.parse_args(["--config", str(path), "--epochs", "5"]), environ)
    assert (cfg.epochs, cfg.log_dir, cfg.batch_size) == (5, str(tmp_path / "from-env"), 8)


def test_a_bad_environment_value_names_the_variable():
    with pytest.raises(ConfigError, match=r"^config: HVDKIT_EPOCHS='many': epochs must be int"):
        config.from_environ({"HVDKIT_EPOCHS": "many"})
    with pytest.raises(ConfigError, match=r"^config: HVDKIT_LR_DECAY_EPOCHS='\[1,': not valid YAML"):
        config.from_environ({"HVDKIT_LR_DECAY_EPOCHS": "[1,"})


def test_lr_is_an_alias_of_base_lr():
    assert config.parse(["--lr", "0.5"]).base_lr == 0.5


def test_help_is_grouped_and_shows_defaults():
    proc = run([sys.executable, "-m", "hvdkit", "train", "--help"])
    assert proc.returncode == 0, proc.stderr
    for title in config.GROUPS:
        assert f"\n{title}:\n" in proc.stdout
    flat = " ".join(proc.stdout.split())
    assert "--batch-size BATCH_SIZE samples per rank per backward pass (default: 32)" in flat
    assert "--base-lr BASE_LR, --lr BASE_LR" in flat and "(default: 0.025)" in flat
    assert "(default: 30 60 80)" in flat and "--amp, --no-amp" in flat
    assert sorted(n for names in config.GROUPS.values() for n in names) == sorted(config.FIELDS)


def test_new_config_keys_are_checked():
    cfg = config.parse(["--optimizer", "adamw", "--lr-scaling", "sqrt", "--compile", "--seq-len", "16"])
    assert (cfg.optimizer, cfg.lr_scaling, cfg.compile, cfg.seq_len) == ("adamw", "sqrt", True, 16)
    for argv, message in ((["--optimizer", "lamb"], "optimizer must be one of sgd, adamw, adam (got 'lamb')"),
                          (["--lr-scaling", "log"], "lr_scaling must be one of linear, sqrt, none"),
                          (["--base-lr", "nan"], "base_lr must be a finite number (got nan)"),
                          (["--clip-grad-norm", "inf"], "clip_grad_norm must be a finite number (got inf)")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            config.parse(argv)


def test_environment_variables_set_keys_for_own_loops():
    values = config.from_environ({"HVDKIT_CHECKPOINT_DIR": "ckpt", "HVDKIT_CHECKPOINT_STEPS": "7",
                                  "HVDKIT_AMP": "true", "HVDKIT_CACHE_DIR": "/x", "HVDKIT_MODEL": "123"})
    assert values == {"checkpoint_dir": "ckpt", "checkpoint_steps": 7, "amp": True, "model": "123"}
    with pytest.raises(ConfigError, match="checkpoint_steps must be int"):
        config.from_mapping(config.from_environ({"HVDKIT_CHECKPOINT_STEPS": "many"}))
