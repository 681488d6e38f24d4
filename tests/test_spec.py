"""Pure tests of cluster spec loading, validation, merging and dumping (no TensorFlow)."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest

from psworker.errors import PsworkerError, SpecError
from psworker.spec import (Address, ClusterSpec, TrainConfig, dump_spec, has_auto_ports, load_spec,
                           merge_train, parse_address, parse_spec, with_addresses)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "cluster_specs").glob("*.yaml"))
BAD = ROOT / "tests" / "bad_specs"

# file in tests/bad_specs -> (field path, fragment of the message). One row per error case.
BAD_CASES = {
    "yaml_syntax.yaml": ("", "invalid YAML at line 3"),
    "duplicate_key.yaml": ("", "duplicate key 'ps' (first at line 2)"),
    "empty.yaml": ("", "the spec is empty"),
    "top_level_list.yaml": ("", "top level must be a mapping"),
    "unknown_top_key.yaml": ("trian", "unknown key 'trian'; did you mean 'train'?"),
    "unknown_cluster_key.yaml": ("cluster.workers", "did you mean 'worker'?"),
    "unknown_train_key.yaml": ("train.max_step", "did you mean 'max_steps'?"),
    "missing_cluster.yaml": ("cluster", "missing"),
    "missing_ps.yaml": ("cluster.ps", "missing"),
    "empty_worker.yaml": ("cluster.worker", "empty"),
    "worker_not_list.yaml": ("cluster.worker", "expected a list of 'host:port' strings, got str"),
    "no_port.yaml": ("cluster.ps[0]", "'localhost' has no port"),
    "not_a_string.yaml": ("cluster.ps[0]", "expected a 'host:port' string, got int 2222"),
    "space_after_colon.yaml": ("cluster.ps[0]", "write it as 'localhost:2222'"),
    "port_out_of_range.yaml": ("cluster.worker[1]", "port 70000 is out of range 1-65535"),
    "port_not_numeric.yaml": ("cluster.ps[0]", "port 'http' is not a number"),
    "duplicate_address.yaml": ("cluster.worker[1]", "duplicate address localhost:2222 (also at cluster.ps[0])"),
    "host_shell_meta.yaml": ("cluster.ps[0]", "contains ';'"),
    "host_whitespace.yaml": ("cluster.ps[0]", "host 'my host' contains ' '"),
    "ipv6_unbracketed.yaml": ("cluster.ps[0]", "IPv6 addresses must be in brackets"),
    "bool_max_steps.yaml": ("train.max_steps", "expected an integer, got bool true"),
    "float_max_steps.yaml": ("train.max_steps", "expected an integer, got float 10.5"),
    "zero_batch_size.yaml": ("train.batch_size", "must be >= 1, got 0"),
    "zero_num_devices.yaml": ("train.num_devices", "must be >= 1, got 0"),
    "negative_learning_rate.yaml": ("train.learning_rate", "must be > 0, got -0.1"),
    "string_learning_rate.yaml": ("train.learning_rate", "expected a number, got str 'fast'"),
    "bad_mode.yaml": ("train.mode", "'synch' is not one of async, sync; did you mean 'sync'?"),
    "bad_replication.yaml": ("train.replication", "'mirrored' is not one of between-graph, in-graph"),
    "bad_model.yaml": ("train.model", "'resnet50' is not one of mlp, cifar10, linear"),
    "both_checkpoint_settings.yaml": ("train.save_checkpoint_secs", "not both"),
    "replicas_too_many.yaml": ("train.replicas_to_aggregate", "3 is not between 1 and the number of workers (2)"),
    "train_not_mapping.yaml": ("train", "expected a mapping of trainer settings, got str 'fast'"),
}


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_spec_validates(path):
    spec = load_spec(path, allow_counts=True)   # scheduled.yaml gives task counts
    assert spec.ps and spec.worker if isinstance(spec, ClusterSpec) else spec.count("ps") and spec.count("worker")
    assert spec.source == str(path)


def test_shipped_specs_are_the_expected_ones():
    names = {p.name for p in SHIPPED}
    assert {"local.yaml", "local-sync.yaml", "two-ps.yaml", "multihost-example.yaml", "cifar10.yaml"} <= names
    local = load_spec(ROOT / "cluster_specs" / "local.yaml")
    assert has_auto_ports(local) and len(local.ps) == 1 and len(local.worker) == 2
    assert load_spec(ROOT / "cluster_specs" / "local-sync.yaml").train.mode == "sync"
    cifar = load_spec(ROOT / "cluster_specs" / "cifar10.yaml").train
    assert (cifar.model, cifar.max_steps, cifar.batch_size, cifar.data_dir) == ("cifar10", 1000, 128, "data/cifar10")
    assert not has_auto_ports(load_spec(ROOT / "cluster_specs" / "two-ps.yaml"))
    criteo = load_spec(ROOT / "cluster_specs" / "criteo-2x2.yaml")   # docs/criteo.md runs it
    assert has_auto_ports(criteo) and (len(criteo.ps), len(criteo.worker)) == (2, 2)
    assert (criteo.train.model, criteo.train.max_steps, criteo.train.batch_size) == ("criteo", 300, 64)


def test_every_bad_spec_has_an_expected_message():
    assert {p.name for p in BAD.glob("*.yaml")} == set(BAD_CASES)


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_bad_spec_fails_with_its_message(name):
    field_path, fragment = BAD_CASES[name]
    with pytest.raises(SpecError) as info:
        load_spec(BAD / name)
    err = info.value
    assert err.exit_code == 2
    assert err.source == str(BAD / name)
    assert err.field_path == field_path
    assert fragment in err.message
    assert str(err).startswith(f"{BAD / name}: ")


def test_spec_error_renders_source_field_and_message():
    err = SpecError("x.yaml", "cluster.worker[1]", "port 70000 is out of range 1-65535")
    assert str(err) == "x.yaml: cluster.worker[1]: port 70000 is out of range 1-65535"
    assert str(SpecError("x.yaml", "", "the spec is empty")) == "x.yaml: the spec is empty"
    assert isinstance(err, PsworkerError)


def test_missing_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


@pytest.mark.parametrize("text, expected", [
    ("localhost:2222", Address("localhost", 2222)),
    ("ps0.example.internal:1", Address("ps0.example.internal", 1)),
    ("10.0.0.7:65535", Address("10.0.0.7", 65535)),
    ("[::1]:2222", Address("::1", 2222)),
    ("[fe80::1%eth0]:2222", Address("fe80::1%eth0", 2222)),
    ("localhost:auto", Address("localhost", 0)),
    ("localhost:0", Address("localhost", 0)),
    (" my-host_1:80 ", Address("my-host_1", 80)),
])
def test_parse_address_valid(text, expected):
    assert parse_address(text, "p", "s") == expected


@pytest.mark.parametrize("text, fragment", [
    ("localhost:-1", "out of range"),
    ("localhost:65536", "out of range"),
    ("localhost:", "empty port"),
    (":2222", "empty host"),
    ("[::1]2222", "is not '[ipv6]:port'"),
    ("[nothex]:1", "not a valid IPv6 address"),
    ("a$b:1", "contains '$'"),
    ("a`b`:1", "contains '`'"),
    ("-host:1", "not a valid host name"),
    ("a..b:1", "not a valid host name"),
    (None, "got null"),
])
def test_parse_address_invalid(text, fragment):
    with pytest.raises(SpecError) as info:
        parse_address(text, "cluster.ps[3]", "f.yaml")
    assert info.value.field_path == "cluster.ps[3]" and fragment in str(info.value)


def test_address_str_round_trips():
    for text in ("localhost:2222", "[::1]:2222", "a.b.c:9"):
        assert str(parse_address(text, "p", "s")) == text


def test_defaults_filled_and_train_optional():
    spec = parse_spec({"cluster": {"ps": ["a:1"], "worker": ["b:2"]}}, "m")
    assert spec.train == TrainConfig()
    spec = parse_spec("cluster: {ps: ['a:1'], worker: ['b:2']}\ntrain:\n", "t")
    assert spec.train == TrainConfig()


def test_train_values_typed():
    spec = parse_spec({"cluster": {"ps": ["a:1"], "worker": ["b:2", "c:3"]},
                       "train": {"learning_rate": 1, "save_checkpoint_secs": 30, "mode": "sync",
                                 "replicas_to_aggregate": 2, "seed": 0}}, "m")
    assert spec.train.learning_rate == 1.0 and isinstance(spec.train.learning_rate, float)
    assert spec.train.save_checkpoint_secs == 30.0 and spec.train.replicas_to_aggregate == 2


def test_auto_ports_are_not_duplicates_but_fixed_ones_are_case_insensitive():
    spec = parse_spec({"cluster": {"ps": ["localhost:auto"], "worker": ["localhost:auto", "localhost:0"]}}, "m")
    assert has_auto_ports(spec)
    with pytest.raises(SpecError, match=r"duplicate address LOCALHOST:1 \(also at cluster.ps\[0\]\)"):
        parse_spec({"cluster": {"ps": ["localhost:1"], "worker": ["LOCALHOST:1"]}}, "m")


def test_dump_spec_round_trips(tmp_path):
    for path in SHIPPED:
        spec = load_spec(path, allow_counts=True)
        if not isinstance(spec, ClusterSpec):
            continue
        out = tmp_path / path.name
        out.write_text(dump_spec(spec))
        assert load_spec(out) == spec
    spec = parse_spec({"cluster": {"ps": ["[::1]:2222"], "worker": ["[::1]:2223", "h:auto"]},
                       "train": {"learning_rate": 0.5, "seed": 7, "save_checkpoint_steps": 10}}, "m")
    assert parse_spec(dump_spec(spec), "again") == spec


def test_merge_train_overrides_only_given_values():
    base = TrainConfig(max_steps=10, model="mlp")
    merged = merge_train(base, {"max_steps": "50", "batch_size": None, "learning_rate": "0.01", "mode": "sync"})
    assert merged == dataclasses.replace(base, max_steps=50, learning_rate=0.01, mode="sync")
    assert merge_train(base, {}) == base


@pytest.mark.parametrize("overrides, field_path, fragment", [
    ({"max_steps": "abc"}, "--max_steps", "expected an integer, got 'abc'"),
    ({"max_steps": 0}, "--max_steps", "must be >= 1"),
    ({"max_steps": True}, "--max_steps", "got bool true"),
    ({"learning_rate": "0"}, "--learning_rate", "must be > 0"),
    ({"learning_rate": "nan"}, "--learning_rate", "finite"),
    ({"mode": "asink"}, "--mode", "did you mean 'async'?"),
    ({"model": "cifar"}, "--model", "did you mean 'cifar10'?"),
    ({"bogus": 1}, "--bogus", "unknown key 'bogus'"),
    ({"save_checkpoint_steps": 5, "save_checkpoint_secs": 5}, "--save_checkpoint_secs", "not both"),
    ({"replicas_to_aggregate": 4}, "--replicas_to_aggregate", "between 1 and the number of workers (3)"),
    ({"train_dir": ""}, "--train_dir", "must not be empty"),
])
def test_merge_train_errors(overrides, field_path, fragment):
    with pytest.raises(SpecError) as info:
        merge_train(TrainConfig(), overrides, num_workers=3)
    assert info.value.source == "--flags" and info.value.field_path == field_path
    assert fragment in info.value.message


def test_merge_train_checkpoint_flag_replaces_the_other_setting():
    base = TrainConfig(save_checkpoint_secs=30.0)
    merged = merge_train(base, {"save_checkpoint_steps": 100})
    assert (merged.save_checkpoint_steps, merged.save_checkpoint_secs) == (100, None)


def test_with_addresses_replaces_ports_and_keeps_train():
    spec = load_spec(ROOT / "cluster_specs" / "local.yaml")
    new = with_addresses(spec, [Address("127.0.0.1", 5000)], ["127.0.0.1:5001", Address("127.0.0.1", 5002)])
    assert not has_auto_ports(new) and new.train == spec.train and new.source == spec.source
    assert new.worker[1] == Address("127.0.0.1", 5002)
    with pytest.raises(SpecError, match="duplicate"):
        with_addresses(spec, ["127.0.0.1:5000"], ["127.0.0.1:5000"])


def test_specs_are_frozen_and_equality_ignores_source():
    a = parse_spec({"cluster": {"ps": ["a:1"], "worker": ["b:2"]}}, "one.yaml")
    b = parse_spec({"cluster": {"ps": ["a:1"], "worker": ["b:2"]}}, "two.yaml")
    assert a == b and hash(a) == hash(b)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.ps = ()  # type: ignore[misc]
    assert isinstance(a, ClusterSpec)


def test_light_modules_do_not_import_tensorflow():
    code = ("import sys, psworker, psworker.spec, psworker.spec.interop, psworker.spec.plan, psworker.cli; "
            "sys.exit(1 if 'tensorflow' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


def test_a_count_spec_may_name_one_chief_and_one_evaluator(tmp_path):
    """TF2 ParameterServerStrategy scripts under a scheduler: `chief: 1` is kept (it was dropped silently)."""
    path = tmp_path / "pss.yaml"
    path.write_text("cluster: {chief: 1, ps: 1, worker: 2, evaluator: 1}\n")
    assert dict(load_spec(path, allow_counts=True).counts) == {"chief": 1, "ps": 1, "worker": 2, "evaluator": 1}
    path.write_text("cluster: {chief: 2, ps: 1, worker: 2}\n")
    with pytest.raises(SpecError, match=r"cluster\.chief: TensorFlow runs at most one chief task, got 2"):
        load_spec(path, allow_counts=True)
