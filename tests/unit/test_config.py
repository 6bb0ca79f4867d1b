"""RunConfig: defaults, YAML round trip, precedence of flags, and one ConfigError per bad value."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import yaml

from distrain.config import RECORDED_HEADER, RunConfig, flatten
from distrain.config.parsing import Slowdown, parse_stragglers
from distrain.errors import ConfigError, DistrainError
from distrain.fields import SECTIONS


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# ---------------------------------------------------------------- defaults and round trip
def test_defaults_are_valid_and_documented():
    cfg = RunConfig()
    assert (cfg.strategy, cfg.workers, cfg.batch_size, cfg.model, cfg.dataset) == (
        "bsp",
        2,
        32,
        "cnn",
        "digits",
    )
    assert cfg.global_batch_size == 64
    assert not cfg.uses_gpus
    assert RunConfig.resolve(None, {}) == cfg
    # every field carries the help text the CLI and the YAML file show
    for name in RunConfig.field_names():
        assert RunConfig.field_info(name).help.strip(), name


def test_yaml_round_trip(tmp_path):
    cfg = RunConfig(
        workers=3,
        cpus_per_worker=0.5,
        model="mlp",
        dataset="mnist",  # a data set that reads --data-dir
        lr=0.125,
        lr_scaling="sqrt",
        warmup_epochs=1.5,
        optimizer="adam",
        optimizer_args={"betas": [0.8, 0.9], "amsgrad": True},
        weight_decay=0.0,
        lr_decay="cosine",
        lr_min=0.001,
        epochs=3,
        seed=42,
        target_accuracy=0.875,
        address="127.0.0.1:6379",
        # strings that YAML would otherwise read as null, a bool, an int, a mapping or a comment,
        # and one long enough for the dumper to fold it over several lines
        data_dir="null",
        run_dir="runs/a: b #c " + "x y " * 40,
    )
    text = cfg.to_yaml()
    assert text.startswith("#")
    nested = yaml.safe_load(text)  # one mapping per section, in SECTIONS order, each field once
    assert list(nested) == list(SECTIONS)
    assert nested["resources"]["workers"] == 3 and nested["optimizer"]["name"] == "adam"
    assert nested["strategy"]["name"] == "bsp" and nested["strategy"]["bsp"] == {
        "backup_workers": 0,
        "backup_tasks": False,
        "portions": None,
    }
    assert sorted(flatten(nested)) == sorted(cfg.to_dict())
    path = write(tmp_path / "config.yaml", text)
    back = RunConfig.resolve(str(path), {})
    assert back == cfg
    assert back.to_dict() == cfg.to_dict()


def test_defaults_round_trip(tmp_path):
    path = write(tmp_path / "c.yaml", RunConfig().to_yaml())
    assert RunConfig.resolve(str(path), {}) == RunConfig()


def test_flags_override_yaml_and_none_flags_do_not(tmp_path):
    path = write(tmp_path / "c.yaml", "workers: 4\nlr: 0.2\nmodel: mlp\n")
    cfg = RunConfig.resolve(str(path), {"workers": 3, "lr": None, "epochs": 2, "model": None})
    assert cfg.workers == 3  # flag beats file
    assert cfg.lr == 0.2  # file beats default; an absent flag (None) changes nothing
    assert cfg.model == "mlp"
    assert cfg.epochs == 2  # flag beats default
    assert cfg.batch_size == RunConfig().batch_size  # neither: default


def test_empty_yaml_file_means_defaults(tmp_path):
    path = write(tmp_path / "empty.yaml", "# nothing but a comment\n")
    assert RunConfig.resolve(str(path), {}) == RunConfig()


def test_yaml_float_in_exponent_notation(tmp_path):
    # PyYAML (YAML 1.1) reads `1e-3` as the string '1e-3'; it is still a number to a user.
    path = write(tmp_path / "c.yaml", "lr: 1e-3\nweight_decay: 5e-4\n")
    cfg = RunConfig.resolve(str(path), {})
    assert cfg.lr == pytest.approx(1e-3)
    assert cfg.weight_decay == pytest.approx(5e-4)


def test_integral_float_is_accepted_for_int_fields():
    cfg = RunConfig(workers=4.0)
    assert cfg.workers == 4 and isinstance(cfg.workers, int)


# ---------------------------------------------------------------- bad files
def test_unknown_yaml_key(tmp_path):
    path = write(tmp_path / "c.yaml", "wrkers: 3\nlr: 0.1\n")
    with pytest.raises(ConfigError, match="wrkers") as info:
        RunConfig.resolve(str(path), {})
    assert str(path) in str(info.value)
    assert "workers" in str(info.value)  # lists the valid keys


def test_unknown_key_in_mapping():
    with pytest.raises(ConfigError, match="unknown key.*bogus"):
        RunConfig.from_mapping({"bogus": 1})


def test_malformed_yaml(tmp_path):
    path = write(tmp_path / "c.yaml", "workers: 2\nlr: [0.1, 0.2\nmodel: cnn\n")
    with pytest.raises(ConfigError, match=r"malformed YAML.*line \d+"):
        RunConfig.resolve(str(path), {})


@pytest.mark.parametrize(("text", "kind"), [("- 1\n- 2\n", "list"), ("just a string\n", "str"), ("3\n", "int")])
def test_non_mapping_yaml(tmp_path, text, kind):
    path = write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError, match=f"must hold a mapping.*{kind}"):
        RunConfig.resolve(str(path), {})


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="not found") as info:
        RunConfig.resolve(str(missing), {})
    assert "nope.yaml" in str(info.value)
    assert not missing.exists()


def test_config_file_that_is_a_directory_or_binary(tmp_path):
    with pytest.raises(ConfigError, match="is a directory"):
        RunConfig.resolve(str(tmp_path), {})
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"workers: 2\n\xd0\xff\x00\x81\n")
    with pytest.raises(ConfigError, match="not a text .UTF-8 YAML. file"):
        RunConfig.resolve(str(binary), {})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("workers: 8\nlr: 0.1\nworkers: 2\n", r"key 'workers' appears twice in .*c.yaml' \(lines 1 and 3\)"),
        ("lr: 0.1\nseed: {a: 1, a: 2}\n", r"key 'a' appears twice .*\(line 2\)"),
    ],
)
def test_duplicate_yaml_key_is_refused(tmp_path, text, message):
    path = write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError, match=message):
        RunConfig.resolve(str(path), {})


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = write(tmp_path / "c.yaml", "x: &d {a: 1}\ny:\n  <<: *d\n  a: 2\n")
    assert RunConfig.load_yaml(path) == {"x": {"a": 1}, "y": {"a": 2}}


def test_momentum_is_for_the_optimizers_that_read_it(tmp_path):
    """None is the optimizer's own default: 0.9 for sgd (distrain's), applied when it is built."""
    from distrain.trainers.optim_state import make_optimizer

    assert RunConfig().momentum is None
    sgd = make_optimizer("sgd", [torch.nn.Parameter(torch.zeros(1))], 0.1, RunConfig().momentum, None)
    assert sgd.param_groups[0]["momentum"] == 0.9
    assert RunConfig(momentum=0.0).momentum == 0.0
    assert RunConfig(optimizer="adam").momentum is None
    with pytest.raises(ConfigError, match=r"not used by --optimizer adam; drop it \(it applies to: sgd, rmsprop\)"):
        RunConfig(optimizer="adam", momentum=0.5)
    # a file resolved for sgd (momentum: 0.9) repeated with another optimizer drops the file's momentum
    path = write(tmp_path / "c.yaml", RunConfig().to_yaml())
    assert RunConfig.resolve(str(path), {"optimizer": "adagrad"}).momentum is None
    with pytest.raises(ConfigError, match="--momentum is not used"):
        RunConfig.resolve(str(path), {"optimizer": "adagrad", "momentum": 0.5})
    # ... and a file that asks for adam with momentum itself is refused
    path = write(tmp_path / "d.yaml", "optimizer: adam\nmomentum: 0.5\n")
    with pytest.raises(ConfigError, match="--momentum is not used by --optimizer adam"):
        RunConfig.resolve(str(path), {})


def test_config_recorded_before_momentum_became_sgd_only_still_loads(tmp_path):
    """Older versions wrote `momentum: 0.9` (then the default) into every run's config.yaml."""
    text = RunConfig(optimizer="adam").to_yaml().replace("\n  momentum: null\n", "\n  momentum: 0.9\n")
    assert "\n  momentum: 0.9\n" in text
    path = write(tmp_path / "config.yaml", text)
    assert RunConfig.resolve(str(path), {}) == RunConfig(optimizer="adam")
    # only distrain's own records get this allowance: a hand-written file is taken at its word
    path = write(tmp_path / "mine.yaml", "optimizer: adam\nmomentum: 0.9\n")
    with pytest.raises(ConfigError, match="--momentum is not used"):
        RunConfig.resolve(str(path), {})


def test_data_dir_is_refused_for_data_sets_that_read_no_files(tmp_path):
    for dataset in ("digits", "synthetic"):
        with pytest.raises(ConfigError, match=rf"--data-dir is not used by --dataset {dataset}.*cifar10, mnist"):
            RunConfig(dataset=dataset, data_dir=str(tmp_path))
    path = write(tmp_path / "c.yaml", RunConfig(dataset="mnist", data_dir=str(tmp_path)).to_yaml())
    assert RunConfig.resolve(str(path), {"dataset": "digits"}).data_dir == ""  # the file's dir is dropped
    assert RunConfig.resolve(str(path), {"dataset": "cifar10"}).data_dir == str(tmp_path)  # and kept here


def test_config_errors_are_user_errors():
    assert issubclass(ConfigError, DistrainError)


# ---------------------------------------------------------------- bad values
BAD_VALUES = [
    ({"workers": 0}, r"--workers must be >= 1, got 0"),
    ({"workers": -3}, r"--workers must be >= 1"),
    ({"batch_size": 0}, r"--batch-size must be >= 1"),
    ({"batch_size": -1}, r"--batch-size must be >= 1"),
    ({"base_batch_size": 0}, r"--base-batch-size must be >= 1"),
    ({"epochs": 0}, r"--epochs must be >= 1"),
    ({"segment_steps": 0}, r"--segment-steps must be >= 1"),
    ({"max_steps": -1}, r"--max-steps must be >= 0"),
    ({"checkpoint_every": -1}, r"--checkpoint-every must be >= 0"),
    ({"lr": 0.0}, r"--lr must be a positive number"),
    ({"lr": -1.0}, r"--lr must be a positive number"),
    ({"lr": math.nan}, r"--lr must be a positive number, got nan"),
    ({"lr": math.inf}, r"--lr must be a positive number"),
    ({"cpus_per_worker": 0}, r"--cpus-per-worker must be a positive number"),
    ({"collective_timeout_s": 0}, r"--collective-timeout-s must be a positive number"),
    ({"gpus_per_worker": -1}, r"--gpus-per-worker must be >= 0"),
    ({"weight_decay": math.nan}, r"--weight-decay must be >= 0"),
    ({"momentum": -0.1}, r"--momentum must be >= 0"),
    ({"momentum": 1.0}, r"--momentum must be < 1"),
    ({"momentum": 1.5}, r"--momentum must be < 1"),
    ({"warmup_epochs": 9, "epochs": 8}, r"--warmup-epochs \(9.0\) exceeds --epochs \(8\)"),
    ({"warmup_epochs": -1}, r"--warmup-epochs must be >= 0"),
    ({"target_accuracy": 0}, r"--target-accuracy must be in \(0, 1\]"),
    ({"target_accuracy": 1.01}, r"--target-accuracy must be in \(0, 1\]"),
    ({"target_accuracy": -0.5}, r"--target-accuracy"),
    ({"target_accuracy": math.nan}, r"--target-accuracy"),
    ({"lr_scaling": "cubic"}, r"unknown --lr-scaling 'cubic'; choose one of: linear, sqrt, none"),
    ({"optimizer": "lion"}, r"unknown --optimizer 'lion'; choose one of: sgd, adam, adamw, adagrad, rmsprop, "),
    ({"optimizer": "lbfgs"}, r"--optimizer lbfgs is not supported: it needs a closure"),
    ({"optimizer": "adagrad", "momentum": 0.9}, r"--momentum is not used by --optimizer adagrad; drop it"),
    ({"lr_decay": "linear"}, r"unknown --lr-decay 'linear'; choose one of: none, cosine, step"),
    ({"lr_decay": "step"}, r"--lr-decay step needs --lr-decay-epochs"),
    ({"lr_decay": "step", "lr_decay_epochs": 0}, r"--lr-decay-epochs must be a positive number"),
    ({"lr_decay": "step", "lr_decay_epochs": 1, "lr_decay_gamma": 0}, r"--lr-decay-gamma must be in \(0, 1\]"),
    ({"lr_decay_epochs": 1}, r"--lr-decay-epochs applies to --lr-decay step; add that or drop"),
    ({"lr_min": 0.0}, r"--lr-min applies to --lr-decay cosine"),
    ({"lr_decay": "cosine", "lr_min": 0.5}, r"--lr-min must be >= 0 and below the peak rate 0.05"),
    ({"strategy": "nope"}, r"unknown strategy 'nope'; choose one of: .*bsp"),
    ({"model": "vgg"}, r"unknown model 'vgg'; choose one of: cnn, linear, mlp, resnet18"),
    (
        {"dataset": "imagenet"},
        r"unknown dataset 'imagenet'; choose one of: cifar10, digits, mnist, synthetic",
    ),
    ({"seed": -1}, r"--seed must be in \[0, 2\*\*64\), got -1"),
    ({"seed": 2**64}, r"--seed must be in"),
    # wrong types
    ({"workers": "abc"}, r"--workers must be an integer, got 'abc'"),
    ({"workers": 2.5}, r"--workers must be an integer, got 2.5"),
    ({"workers": True}, r"--workers must be an integer, got True"),
    ({"epochs": None}, r"--epochs must be an integer, got None"),
    ({"lr": "fast"}, r"--lr must be a number, got 'fast'"),
    ({"lr": [0.1]}, r"--lr must be a number"),
    ({"momentum": False}, r"--momentum must be a number"),
    ({"strategy": 3}, r"--strategy must be a string, got 3"),
    ({"run_dir": ["a"]}, r"--run-dir must be a string"),
]


@pytest.mark.parametrize(("values", "message"), BAD_VALUES, ids=[repr(v) for v, _ in BAD_VALUES])
def test_bad_value_is_a_config_error(values, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**values)


@pytest.mark.parametrize(("values", "message"), BAD_VALUES[:6], ids=[repr(v) for v, _ in BAD_VALUES[:6]])
def test_bad_value_in_yaml_is_a_config_error(tmp_path, values, message):
    import yaml

    path = write(tmp_path / "c.yaml", yaml.safe_dump(values))
    with pytest.raises(ConfigError, match=message):
        RunConfig.resolve(str(path), {})


def test_bad_yaml_value_is_fixed_by_a_good_flag(tmp_path):
    path = write(tmp_path / "c.yaml", "workers: 0\n")
    assert RunConfig.resolve(str(path), {"workers": 2}).workers == 2


def test_boundary_values_are_accepted():
    cfg = RunConfig(
        workers=1,
        batch_size=1,
        momentum=0.0,
        warmup_epochs=8,
        epochs=8,
        target_accuracy=1.0,
        max_steps=0,
        seed=0,
    )
    assert cfg.warmup_epochs == 8.0 and isinstance(cfg.warmup_epochs, float)
    assert isinstance(RunConfig(lr=1).lr, float)


def test_backup_workers_add_actors_and_samples_but_not_to_the_update_batch():
    cfg = RunConfig(transport="ps", workers=4, backup_workers=1, batch_size=16, straggler=["4:0.1"])
    assert cfg.num_worker_actors == 5 and cfg.samples_per_step == 80
    assert cfg.global_batch_size == 64  # the learning rate is scaled for N·B
    assert cfg.stragglers == {4: Slowdown(seconds=0.1)}  # a backup worker can be the slow one


def test_a_straggler_is_a_fixed_delay_per_step_or_a_factor_on_its_compute():
    slow = parse_stragglers(["0:0.25", "1:x3", "2:X1.5"], workers=3)
    assert slow == {0: Slowdown(seconds=0.25), 1: Slowdown(factor=3.0), 2: Slowdown(factor=1.5)}
    # The delay after a unit that took 0.1 s: fixed, or (F - 1) x its compute, so the unit takes F x as long.
    assert slow[0].extra_s(0.1) == 0.25 and slow[0].extra_s(0.01) == 0.25
    assert abs(slow[1].extra_s(0.1) - 0.2) < 1e-12 and abs(slow[1].extra_s(0.01) - 0.02) < 1e-12
    assert abs(slow[2].extra_s(0.1) - 0.05) < 1e-12
    for bad in ("1:x0.5", "1:x", "1:xfast", "1:-1", "3:x2", "1:xinf"):
        with pytest.raises(ConfigError, match="RANK:xF"):
            parse_stragglers([bad], workers=3)


def test_backup_tasks_default_to_two_portions_per_worker_and_a_new_strategy_drops_them(tmp_path):
    cfg = RunConfig(transport="ps", workers=3, batch_size=16, backup_tasks=True)
    assert cfg.options_of("bsp").portions == 6 and cfg.num_worker_actors == 3 and cfg.samples_per_step == 48
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    again = RunConfig.resolve(str(path), {"strategy": "ssp"})
    assert again.transport == "ps" and again.options_of("ssp") is not None
    with pytest.raises(KeyError, match="'bsp' is not used by this run"):
        again.options_of("bsp")  # neither backup_tasks nor portions came along


# ---------------------------------------------------------------- specs: frozen, resolved, nested
def test_flag_errors_need_neither_torch_nor_ray():
    """`distrain run` with a bad flag answers in well under a second: nothing heavy is imported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from distrain.config import RunConfig\n"
        "from distrain.errors import ConfigError\n"
        "bad = [dict(workers=0), dict(model='foo'), dict(optimizer='lion'), dict(dataset='digits', data_dir='/tmp'),\n"
        "       dict(strategy='ssp', tau=3), dict(task='/nope.py:X'), dict(strategy='bsp', backup_tasks=True),\n"
        "       dict(schedule='bsp:1,nope'), dict(lr_decay='step'), dict(chaos=['boom@1'])]\n"
        "for kw in bad:\n"
        "    try:\n"
        "        RunConfig(**kw)\n"
        "    except ConfigError:\n"
        "        pass\n"
        "    else:\n"
        "        raise SystemExit(f'{kw} was accepted')\n"
        "print(sorted(m for m in ('torch', 'ray', 'numpy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_static_name_lists_match_the_registries_and_torch():
    from distrain.config import OPTIMIZER_NAMES, REFUSED_OPTIMIZER_NAMES
    from distrain.trainers.builtin_names import DATASET_READS_FILES, MODEL_NAMES
    from distrain.trainers.datasets import DATASETS
    from distrain.trainers.models import MODELS
    from distrain.trainers.optim_state import OPTIMIZERS, REFUSED, _torch_optimizers

    assert list(MODEL_NAMES) == MODELS.names()
    assert DATASET_READS_FILES == {n: DATASETS.get(n).reads_files for n in DATASETS.names()}
    assert OPTIMIZER_NAMES == tuple(OPTIMIZERS) and set(REFUSED_OPTIMIZER_NAMES) == set(REFUSED)
    assert _torch_optimizers() <= set(OPTIMIZER_NAMES) | set(REFUSED_OPTIMIZER_NAMES)


def test_a_config_is_frozen_and_replace_builds_a_new_one():
    cfg = RunConfig(strategy="local-sgd", adaptive_tau=True)
    with pytest.raises(AttributeError, match="immutable"):
        cfg.workers = 3
    for section in ("resources", "strategy"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.section(section).workers = 3
    other = cfg.replace(workers=4)
    assert (other.workers, cfg.workers) == (4, 2) and other.options_of("local-sgd") == cfg.options_of("local-sgd")


def test_building_resolves_defaults_into_new_objects_and_records_them():
    given = {"strategy": "local-sgd", "adaptive_tau": True}
    cfg = RunConfig(**given)
    assert given == {"strategy": "local-sgd", "adaptive_tau": True}  # the caller's mapping is untouched
    options = cfg.options_of("local-sgd")
    assert (options.tau, options.tau_interval, options.tau_max) == (8, "10%", 16)
    assert cfg.transport == "collective" and cfg.ps_shards is None
    ssp = RunConfig(strategy="ssp")
    assert (ssp.transport, ssp.ps_shards, ssp.options_of("ssp").staleness) == ("ps", 1, 2)
    assert RunConfig(strategy="bsp", transport="ps", backup_tasks=True, workers=2).options_of("bsp").portions == 4


def test_a_strategy_option_is_not_a_config_attribute_and_the_error_says_where_it_lives():
    """Issue 27: options are read through their strategy's Options only; the flat read names the owner,
    whether the run uses that strategy or not. Section fields stay flat reads."""
    ssp = RunConfig(strategy="ssp")
    with pytest.raises(AttributeError, match=r"'staleness' is an option of --strategy ssp: .*options_of\('ssp'\)"):
        ssp.staleness  # noqa: B018 - the read is the test
    with pytest.raises(AttributeError, match=r"'tau' is an option of --strategy local-sgd: .*options_of"):
        ssp.tau  # noqa: B018
    assert not hasattr(ssp, "backup_workers")
    with pytest.raises(AttributeError, match="RunConfig has no field 'no_such_thing'"):
        ssp.no_such_thing  # noqa: B018
    assert (ssp.workers, ssp.compress, ssp.ps_shards) == (2, None, 1)  # section fields: flat reads


def test_a_schedule_holds_every_phase_s_options_and_yaml_nests_them(tmp_path):
    cfg = RunConfig(schedule="ssp:1,local-sgd", epochs=2, staleness=1, tau=4)
    assert cfg.strategy == "ssp" and cfg.options_of("ssp").staleness == 1 and cfg.options_of("local-sgd").tau == 4
    nested = yaml.safe_load(cfg.to_yaml())["strategy"]
    assert nested["ssp"]["staleness"] == 1 and nested["local-sgd"]["tau"] == 4
    path = write(tmp_path / "c.yaml", cfg.to_yaml())
    assert RunConfig.resolve(str(path), {}) == cfg


def test_a_flat_config_file_of_the_previous_version_still_loads(tmp_path):
    """config.yaml before the sections: every field at the top level, unused strategy fields null."""
    old = {name: value for name, value in RunConfig(strategy="ssp", staleness=1).to_dict().items()}
    old |= {"tau": None, "adaptive_tau": False, "tau_interval": None, "tau_max": None, "backup_workers": 0,
            "backup_tasks": False, "portions": None}  # fmt: skip
    path = write(tmp_path / "old.yaml", RECORDED_HEADER + "\n" + yaml.safe_dump(old))
    assert RunConfig.resolve(str(path), {}) == RunConfig(strategy="ssp", staleness=1)
    # ... and a new flag for another strategy starts from that strategy's defaults, as before
    assert RunConfig.resolve(str(path), {"strategy": "local-sgd"}).options_of("local-sgd").tau == 8
