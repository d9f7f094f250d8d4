"""What each node step waits on: the previous step of its replica; for a from_cache or
create, every earlier to_cache / delete on any of its GPUs; nothing that has finished."""

from __future__ import annotations

from shoal.services.scheduler.step_graph import StepGraph, StepWaits

GPU0, GPU1 = ("n0", 0), ("n0", 1)


def test_the_module_docs_example() -> None:
    graph = StepGraph()
    assert graph.add("to_cache", "x1", [GPU0]) == StepWaits(0, None, ())
    assert graph.add("create", "z1", [GPU0]) == StepWaits(1, None, (0,))
    assert graph.add("from_cache", "x1", [GPU1]) == StepWaits(2, 0, ())
    graph.forget(0)
    assert graph.add("create", "y1", [GPU0]) == StepWaits(3, None, ())


def test_a_create_waits_on_every_earlier_freeing_step_on_any_of_its_gpus_once_each() -> None:
    graph = StepGraph()
    graph.add("delete", "a", [GPU0, GPU1])  # 0: a two-GPU replica stops
    graph.add("to_cache", "b", [GPU1])  # 1
    graph.add("to_cache", "c", [("n1", 0)])  # 2: same index, another node
    assert graph.add("create", "m", [GPU1, GPU0]) == StepWaits(3, None, (0, 1))
    assert graph.add("from_cache", "w", [("n1", 0)]) == StepWaits(4, None, (2,))
    assert graph.add("create", "v", [("n1", 1)]) == StepWaits(5, None, ())


def test_freeing_steps_wait_only_on_their_own_replica() -> None:
    graph = StepGraph()
    graph.add("to_cache", "a", [GPU0])  # 0
    assert graph.add("delete", "b", [GPU0]) == StepWaits(1, None, ())
    graph.add("create", "c", [GPU0])  # 2: waits on 0 and 1
    assert graph.add("delete", "c", [GPU0]) == StepWaits(3, 2, ()), "create before stop"
    assert graph.add("to_cache", "a", [GPU0]) == StepWaits(4, 0, ())


def test_creates_do_not_hold_up_later_creates_on_their_gpus() -> None:
    graph = StepGraph()
    graph.add("create", "a", [GPU0])
    assert graph.add("create", "b", [GPU0]) == StepWaits(1, None, ())


def test_each_step_waits_on_the_latest_unfinished_step_of_its_replica() -> None:
    graph = StepGraph()
    graph.add("to_cache", "x", [GPU0])  # 0
    graph.add("from_cache", "x", [GPU1])  # 1: waits on 0
    assert graph.add("to_cache", "x", [GPU1]) == StepWaits(2, 1, ())
    graph.forget(0)  # an earlier step finishing leaves the latest in place
    assert graph.add("from_cache", "x", [GPU0]) == StepWaits(3, 2, ())
    assert graph.num_unfinished == 3


def test_finished_steps_are_forgotten_from_every_gpu_they_freed() -> None:
    graph = StepGraph()
    graph.add("delete", "a", [GPU0, GPU1])  # 0
    graph.add("delete", "b", [GPU1])  # 1
    graph.forget(0)
    assert graph.add("create", "m", [GPU0, GPU1]) == StepWaits(2, None, (1,))
    graph.forget(1)
    graph.forget(2)
    assert graph.num_unfinished == 0
    assert graph.add("create", "n", [GPU0, GPU1]) == StepWaits(3, None, ())
    assert graph.add("create", "a", [GPU0]) == StepWaits(4, None, ()), "a's finished delete is forgotten"
