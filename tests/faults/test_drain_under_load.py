"""A replica evicted (drained) while it runs requests: what its drain timeout cuts short is handed
back (a NAK and a notice, never a 503) and runs again on the other replica; every client gets
its whole answer, greedy streams the same text once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shoal.shared.nats_server import EmbeddedNatsServer
from tests.faults.harness import fault_cluster, model

MAX_TOKENS = 600
ACK_WAIT_S = 30.0
"""The model consumer's (`ensure_model_consumer`)."""


async def test_a_drain_under_load_hands_back_what_it_cuts_and_loses_nothing(
        nats_server: EmbeddedNatsServer, demo_models_root: Path, tmp_path: Path) -> None:
    async with fault_cluster(nats_server.url, demo_models_root, tmp_path / "logs",
                             [model("m", min_replicas=2, drain_timeout_s=0.2)]) as cluster:
        await cluster.wait_serving("m", 2)
        reference = await cluster.complete("m", max_tokens=MAX_TOKENS)
        before = len(cluster.notices)
        tasks = [asyncio.create_task(cluster.complete("m", max_tokens=MAX_TOKENS, stream=i % 2 == 1))
                 for i in range(8)]

        async def all_started() -> bool:
            return sum(1 for _, n in cluster.notices[before:] if n.state == "started") >= len(tasks)

        await cluster.wait_for(all_started, "every request started", timeout_s=60)
        victim = max(await cluster.serving("m"), key=lambda r: len(cluster.started_on(r.replica_id)))
        reply = await cluster.schedulers[0].evict("m", victim.replica_id)
        assert reply.ok, reply

        answers = await asyncio.gather(*tasks)
        for answer in answers:
            assert answer.status == 200, answer.body
            if answer.events:
                assert not any("error" in e for e in answer.events), answer.events[-1]
                assert answer.events[-1]["usage"]["completion_tokens"] == MAX_TOKENS
            else:
                assert answer.body["usage"]["completion_tokens"] == MAX_TOKENS
            assert answer.text == reference.text, "greedy: handed back and run again, the same text once"
        handed_back = [n for _, n in cluster.notices[before:]
                       if n.state == "handed_back" and n.replica_id == victim.replica_id]
        print(f"\nDRAIN under load: {len(handed_back)} requests handed back by the drained replica, "
              f"{len(answers)}/{len(answers)} answered in full")
        assert handed_back, "the drain timeout cut nothing short: the test did not test a hand-back"
        # Handed back means taken again now, not after the consumer's ack wait (30 s): a worker
        # whose barrier is up hands back what reaches it after its last fetch, too.
        for at, notice in cluster.notices[before:]:
            if notice.state == "handed_back":
                restarted = [t for t, n in cluster.notices[before:] if n.request_id == notice.request_id
                             and n.state == "started" and n.attempt > notice.attempt]
                assert restarted and restarted[0] - at < ACK_WAIT_S / 2, (notice.request_id, restarted, at)
        assert victim.replica_id not in {r.replica_id for r in await cluster.serving("m")}, "parked or stopped"
        await cluster.assert_no_orphans()
        await cluster.assert_memory_matches_records()
