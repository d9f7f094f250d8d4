"""How a worker's end reads in its replica's ``last_error`` (services/node_agent/processes.py)."""

from __future__ import annotations

from shoal.services.node_agent.processes import describe_exit


def test_a_killed_worker_names_the_signal_not_a_negative_code() -> None:
    assert describe_exit(-9, '{"event": "request_done"}\n') == "worker killed by SIGKILL"
    assert describe_exit(-15, "") == "worker killed by SIGTERM"
    assert describe_exit(-11, "Fatal Python error: Segmentation fault\n\n") == (
        "worker killed by SIGSEGV: Fatal Python error: Segmentation fault")


def test_an_exited_worker_names_its_code_and_its_logs_last_line() -> None:
    tail = "Traceback (most recent call last):\n  ...\nOSError: truncated safetensors file\n"
    assert describe_exit(1, tail) == "worker exited with code 1: OSError: truncated safetensors file"
    assert describe_exit(1, "x" * 1000) == "worker exited with code 1: " + "x" * 300
