"""Scenario files: defaults, size strings, the shipped scenarios, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.shared.model_settings import FairnessSettings, SleepSettings
from shoal.shared.placement.config import PlacementConfig
from shoal.sim.scenario import ScenarioError, load_scenario, parse_scenario
from shoal.sim.traces import rank_models

SCENARIOS = Path(__file__).resolve().parents[2] / "sim" / "scenarios"
GiB = 1 << 30
MODEL = {"name": "m", "params_b": 7.0, "measured_bytes": "20GiB"}


def test_a_minimal_scenario_takes_the_defaults() -> None:
    scenario = parse_scenario({"models": [MODEL]})
    assert scenario.cluster.total_gpus == 16 * 8
    assert scenario.cluster.placement == PlacementConfig()
    model = scenario.models[0]
    assert model.measured_bytes == 20 * GiB and model.raw_weight_bytes == 14_000_000_000
    assert isinstance(model.fairness, FairnessSettings) and model.fairness.min_runtime_s == 10.0
    assert isinstance(model.sleep, SleepSettings) and model.sleep.idle_timeout_s == 0.0
    assert scenario.policies == ["shoal", "dedicated", "seed", "lru"]
    assert scenario.slo.ttft_s == 2.0 and scenario.slo.attainment == 0.99


def test_a_cluster_of_any_gpu_count_fills_whole_nodes_then_the_rest() -> None:
    scenario = parse_scenario({"models": [MODEL], "cluster": {"gpus_per_node": 8}})
    assert scenario.with_gpus(20).cluster.get_gpus_by_node() == [8, 8, 4]
    assert scenario.with_gpus(16).cluster.get_gpus_by_node() == [8, 8]
    assert scenario.with_gpus(3).cluster.total_gpus == 3


def test_the_search_bound_is_one_gpu_per_replica() -> None:
    scenario = parse_scenario({"cluster": {"gpu_memory_bytes": "80GiB"}, "models": [
        {**MODEL, "count": 3, "replicas": 2}, {**MODEL, "name": "big", "measured_bytes": "150GiB", "replicas": 0}]})
    assert scenario.get_max_gpus() == 3 * 2 + 1 * 2


@pytest.mark.parametrize("name", ["default.toml", "scale.toml"])
def test_the_shipped_scenarios_load(name: str) -> None:
    scenario = load_scenario(SCENARIOS / name)
    keys = rank_models(scenario.models, interleave=scenario.trace.popularity.interleave)
    assert len(keys) == len(set(keys)) == (100 if name == "default.toml" else 500)
    assert scenario.trace.duration_s == 86400


@pytest.mark.parametrize(("raw", "needle"), [
    ({"models": [MODEL], "cluster": {"num_nodes": 0}}, "num_nodes must be >= 1 - at `$.cluster`"),
    ({"models": [MODEL], "cluster": {"gpu_memory_bytes": "80 gigs"}}, "at `$.cluster.gpu_memory_bytes`"),
    ({"models": [MODEL], "cluster": {"gpus": 8}}, "unknown field `gpus` - at `$.cluster`"),
    ({"models": [MODEL], "cluster": {"placement": {"fraction_threshold": 2.0}}},
     "fraction_threshold must be in (0, 1], got 2.0 - at `$.cluster.placement`"),
    ({"models": [{**MODEL, "params_b": "seven"}]}, "Expected `float`, got `str` - at `$.models[0].params_b`"),
    ({"models": [{**MODEL, "replicas": -1}]}, "m: replicas must be >= 0 - at `$.models[0]`"),
    ({"models": [{**MODEL, "fairness": {"max_wait": 3}}]}, "unknown field `max_wait` - at `$.models[0].fairness`"),
    ({"models": [{**MODEL, "sleep": {"level": "frozen"}}]}, "at `$.models[0].sleep.level`"),
    ({"models": [MODEL, MODEL]}, "duplicate model names ['m']"),
    ({"models": []}, "at least one [[models]] entry"),
    ({"models": [MODEL], "timing": {"disk_bytes_per_s": 0}}, "rates must be > 0 - at `$.timing`"),
    ({"models": [MODEL], "trace": {"arrivals": {"kind": "poisson", "cv": 2.0}}},
     "cv is for kind = \"gamma\" (poisson has cv 1) - at `$.trace.arrivals`"),
    ({"models": [MODEL], "trace": {"arrivals": {"diurnal_amplitude": 1.5}}},
     "diurnal_amplitude must be in [0, 1) - at `$.trace.arrivals`"),
    ({"models": [MODEL], "trace": {"kind": "csv"}}, "needs a path - at `$.trace`"),
    ({"models": [MODEL], "trace": {"kind": "parquet"}}, "at `$.trace.kind`"),
    ({"models": [MODEL], "slo": {"attainment": 1.5}}, "attainment must be in (0, 1] - at `$.slo`"),
    ({"models": [MODEL], "policies": ["shoal", "vllm"]}, "at `$.policies[1]`"),
    ({"models": [MODEL], "search": {"min_gpus": 10, "max_gpus": 5}}, "max_gpus must be 0 or >= min_gpus"),
])
def test_a_bad_scenario_is_an_error_naming_the_key(raw: dict[str, object], needle: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(raw)
    assert needle in str(caught.value)


def test_a_bad_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="scenario file not found"):
        load_scenario(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[cluster\nnum_nodes = 2\n")
    with pytest.raises(ScenarioError, match=r"broken\.toml: not valid TOML"):
        load_scenario(broken)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('[[models]]\nname = "m"\nparams_b = 1\nmeasured_bytes = "1GiB"\nreplica = 2\n')
    with pytest.raises(ScenarioError, match=r"wrong.toml\): Object contains unknown field `replica` - at `\$.models\[0\]`"):
        load_scenario(wrong)
