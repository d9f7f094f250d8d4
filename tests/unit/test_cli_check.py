"""``shoal check``: a configuration's faults found before anything starts, on the demo
models' real files."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.cli.check import check
from shoal.cli.launcher import model_specs
from shoal.cli.main import main
from shoal.shared.config import load_config


def _config_file(tmp_path: Path, models_root: Path, body: str) -> Path:
    path = tmp_path / "shoal.toml"
    path.write_text(f'demo_models = false\n[node]\nmodels_root = "{models_root}"\ngpus = "virtual:2x1GiB"\n{body}')
    return path


def test_a_sound_configuration_passes(tmp_path: Path, demo_models_root: Path, capsys: pytest.CaptureFixture[str]
                                      ) -> None:
    path = _config_file(tmp_path, demo_models_root, '[[models]]\nkey = "org/small"\npath = "demo/llama-5m"\n'
                                                    'min_replicas = 2\n')
    assert main(["check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "org/small     LlamaForCausalLM, 5.0M parameters" in out
    assert "2 replica(s) kept up fit this node's GPUs" in out and out.endswith("0 error(s), 0 warning(s)\n")


def test_each_fault_is_named_worst_first(tmp_path: Path, demo_models_root: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = _config_file(tmp_path, demo_models_root, '''
[gateway]
host = "0.0.0.0"
[[models]]
key = "org/big"
path = "demo/llama-100m"
memory_override_bytes = "3GiB"
[[models]]
key = "org/missing"
path = "nowhere/model"
[[models]]
key = "org/kept"
path = "demo/llama-5m"
min_replicas = 3
[[models]]
key = "org/long"
path = "demo/llama-5m"
max_model_len = 100000
''')
    findings = check(load_config(path), model_specs(load_config(path)))
    by_subject = {finding.subject: finding for finding in findings}
    assert [finding.level for finding in findings][:5] == ["error"] * 4 + ["warning"]
    assert "open to anyone who can reach 0.0.0.0:8000" in by_subject["gateway"].message
    assert "it never fits: this node's 2 GPU(s) of 1.00 GiB at most" in by_subject["org/big"].message
    assert "'nowhere/model': no such directory under the models root" in by_subject["org/missing"].message
    assert by_subject["org/long"].message == (
        "max_model_len 100000 is longer than the checkpoint's 2048 positions (max_position_embeddings): "
        "set max_model_len to 2048 or less")
    kept = by_subject["min_replicas"]  # three replicas of 0.8 GiB on two GPUs of 1 GiB
    assert kept.level == "warning" and "org/kept is left out" in kept.message
    assert main(["check", "--config", str(path)]) == 1
    assert capsys.readouterr().out.endswith("4 error(s), 1 warning(s)\n")


def test_fit_follows_the_schedulers_rules(tmp_path: Path, demo_models_root: Path) -> None:
    """A replica larger than one GPU takes whole GPUs (as the scheduler places it); a share
    of at least `fraction_threshold` of a GPU reserves all of it."""
    path = _config_file(tmp_path, demo_models_root, '''
[[models]]
key = "org/spread"
path = "demo/llama-5m"
memory_override_bytes = "1.5GiB"
[[models]]
key = "org/share"
path = "demo/llama-5m"
memory_override_bytes = "0.3GiB"
min_replicas = 2
''')
    findings = {finding.subject: finding for finding in check(load_config(path), model_specs(load_config(path)))}
    assert findings["org/spread"].level == "ok"
    assert findings["min_replicas"].level == "ok" and "0.60 GiB of 2.00 reserved" in findings["min_replicas"].message
    spread_kept = _config_file(tmp_path, demo_models_root, '''
[[models]]
key = "org/spread"
path = "demo/llama-5m"
memory_override_bytes = "1.5GiB"
min_replicas = 1
[[models]]
key = "org/share"
path = "demo/llama-5m"
memory_override_bytes = "0.3GiB"
min_replicas = 1
''')  # the spread replica takes both GPUs whole: nothing is left for the other
    kept = {f.subject: f for f in check(load_config(spread_kept), model_specs(load_config(spread_kept)))}
    assert kept["min_replicas"].level == "warning" and "org/share is left out" in kept["min_replicas"].message


def test_demo_models_shoal_up_has_not_written_yet_are_not_faults(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--models-root", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.endswith("0 error(s), 0 warning(s)\n")


def test_an_invalid_file_is_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "shoal.toml"
    path.write_text('[[models]]\nkey = "x"\npath = "../etc"\n')
    assert main(["check", "--config", str(path)]) == 2
    assert "must be relative to the models root" in capsys.readouterr().err


def test_shoal_up_refuses_a_model_it_can_never_serve_before_starting_anything(
        tmp_path: Path, demo_models_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As vLLM refuses a model it cannot load: no NATS server, no services, no 503s that say
    "retry" for ever; each model named, with why."""
    path = _config_file(tmp_path, demo_models_root, '''
[[models]]
key = "org/fine"
path = "demo/llama-5m"
[[models]]
key = "org/missing"
path = "nowhere/model"
[[models]]
key = "org/big"
path = "demo/llama-5m"
memory_override_bytes = "3GiB"
''')
    assert main(["up", "--config", str(path), "--state-dir", str(tmp_path / "state")]) == 2
    err = capsys.readouterr().err
    assert "shoal up: model org/missing: " in err and "nowhere/model" in err
    assert "shoal up: model org/big: " in err and "never fits" in err
    assert "org/fine" not in err
    assert not (tmp_path / "state").exists(), "nothing was started (no NATS store, no logs)"
