"""The metrics facade over prometheus_client: the API services use, and what /metrics shows."""

from __future__ import annotations

import pytest
from prometheus_client.core import GaugeMetricFamily

from shoal.shared.metrics import Registry
from tests.integration.gateway_harness import find_sample, parse_samples


def test_counter_gauge_histogram_render_in_the_text_format() -> None:
    registry = Registry()
    requests = registry.counter("shoal_test_requests_total", "Requests", ["model", "outcome"])
    requests.inc(model="m", outcome="ok")
    requests.inc(2, model="m", outcome="ok")
    in_flight = registry.gauge("shoal_test_in_flight", "In flight", ["model"])
    in_flight.set(3, model="m")
    latency = registry.histogram("shoal_test_seconds", "Latency", ["model"], buckets=(0.1, 1.0))
    latency.observe(0.5, model="m")
    text = registry.render()
    assert find_sample(text, 'shoal_test_requests_total{outcome="ok",model="m"}') == 3
    assert find_sample(text, 'shoal_test_in_flight{model="m"}') == 3
    assert find_sample(text, 'shoal_test_seconds_bucket{model="m",le="0.1"}') == 0
    assert find_sample(text, 'shoal_test_seconds_bucket{model="m",le="1.0"}') == 1
    assert find_sample(text, 'shoal_test_seconds_count{model="m"}') == 1
    assert "# TYPE shoal_test_requests_total counter" in text
    assert not [s for s in parse_samples(text) if s.name.endswith("_created")], "no _created series"
    assert requests.get(model="m", outcome="ok") == 3 and in_flight.get(model="m") == 3


def test_a_counter_is_exposed_with_total_even_when_declared_without() -> None:
    registry = Registry()
    registry.counter("shoal_test_things", "Things").inc()
    assert find_sample(registry.render(), "shoal_test_things_total") == 1


def test_registering_again_returns_the_same_metric_and_checks_the_declaration() -> None:
    registry = Registry()
    first = registry.gauge("shoal_test_g", "G", ["node"])
    assert registry.gauge("shoal_test_g", "G", ["node"]) is first
    with pytest.raises(AssertionError, match="different types"):
        registry.histogram("shoal_test_g", "G", ["node"])
    with pytest.raises(AssertionError, match="different labels"):
        registry.gauge("shoal_test_g", "G", ["model"])
    with pytest.raises(AssertionError, match="prefix"):
        registry.gauge("other_g", "G")
    with pytest.raises(AssertionError, match="labels"):
        first.set(1, model="x")


def test_registries_are_independent_and_collectors_come_and_go() -> None:
    one, two = Registry(), Registry()
    one.counter("shoal_test_c_total", "C").inc()
    two.counter("shoal_test_c_total", "C")  # no clash: each has its own CollectorRegistry

    class Collector:
        def collect(self):  # type: ignore[no-untyped-def]
            family = GaugeMetricFamily("shoal_test_collected", "From elsewhere", labels=["replica"])
            family.add_metric(["r1"], 7)
            yield family

    collector = Collector()
    two.register_collector(collector)  # type: ignore[arg-type]
    assert find_sample(two.render(), 'shoal_test_collected{replica="r1"}') == 7
    assert find_sample(one.render(), 'shoal_test_collected{replica="r1"}') is None
    two.unregister_collector(collector)  # type: ignore[arg-type]
    assert find_sample(two.render(), 'shoal_test_collected{replica="r1"}') is None
