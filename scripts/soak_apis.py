"""Soak a running Shoal through its APIs at once while models keep being put to sleep.

    python scripts/soak_apis.py --base-url http://127.0.0.1:8000 --duration-s 120
    python scripts/soak_apis.py --aliases 17 --batch 300   # 20 models on the GPUs, and a batch file

`--clients` OpenAI clients stream chats, as many Ollama clients stream chats or embed, as
many Anthropic clients stream messages or count tokens, and as many Cohere clients rerank
(or score pairs on ``/v1/score``), each on a model drawn at random from those served; every
`--unload-every-s` one model is unloaded (Ollama's ``keep_alive: 0``: its replicas sleep) so
that requests keep meeting sleeping, waking and loading replicas. `--aliases N` first
registers N more models (``soak/<n>``, each a demo model's files under another key) so that
far more models compete for the GPUs than fit; `--batch N` runs ``shoal run-batch`` on N
requests over all the models meanwhile, and counts its lines that are not a 200; `--batch-api N`
uploads as many to OpenAI's Batch API (a batch per endpoint) and waits for them; `--churn-every-s`
removes one of those models (``DELETE /admin/models``: its replicas stop under load) and
registers it again, over and over: a request for it meanwhile may get a 404, not counted as a
failure. Exits 1 if
any request failed or the gateway holds reply inboxes once the load has stopped (a leak);
prints the counts either way (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import anthropic
import cohere
import httpx
import ollama
import openai
from cohere.core.api_error import ApiError as CohereError

DEMO_MODELS = ("demo/llama-5m", "demo/qwen2-25m", "demo/llama-100m")
DOCUMENTS = ["The harbour keeps the boats.", "Cats sleep all day.", "At night the fleet returns to port."]


async def _openai_client(base_url: str, models: list[str], until: float, done: Counter[str],
                         failures: list[str]) -> None:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=240)
    while time.monotonic() < until:
        model = random.choice(models)
        try:
            stream = await client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, stream=True)
            async for _ in stream:
                pass
            done["openai_chat"] += 1
        except openai.OpenAIError as exc:
            failures.append(f"openai chat {model}: {exc!r}"[:300])
    await client.close()


async def _ollama_client(base_url: str, models: list[str], until: float, done: Counter[str],
                         failures: list[str]) -> None:
    client = ollama.AsyncClient(host=base_url, timeout=240)
    while time.monotonic() < until:
        model = random.choice(models)
        try:
            if random.random() < 0.3:
                await client.embed(model=model, input=["a short text", "another"])
                done["ollama_embed"] += 1
            else:
                async for _ in await client.chat(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 options={"num_predict": 8}, stream=True):
                    pass
                done["ollama_chat"] += 1
        except (ollama.ResponseError, httpx.HTTPError) as exc:
            failures.append(f"ollama {model}: {exc!r}"[:300])


async def _anthropic_client(base_url: str, models: list[str], until: float, done: Counter[str],
                            failures: list[str]) -> None:
    client = anthropic.AsyncAnthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=240)
    while time.monotonic() < until:
        model = random.choice(models)
        messages: list[anthropic.types.MessageParam] = [{"role": "user", "content": "Hi"}]
        try:
            if random.random() < 0.2:
                await client.messages.count_tokens(model=model, messages=messages)
                done["anthropic_count_tokens"] += 1
            else:
                async with client.messages.stream(model=model, max_tokens=8, messages=messages) as stream:
                    await stream.get_final_message()
                done["anthropic_messages"] += 1
        except anthropic.AnthropicError as exc:
            failures.append(f"anthropic {model}: {exc!r}"[:300])
    await client.close()


async def _cohere_client(base_url: str, models: list[str], until: float, done: Counter[str],
                         failures: list[str]) -> None:
    client = cohere.AsyncClientV2(base_url=base_url, api_key="unused", timeout=240)
    async with httpx.AsyncClient(timeout=240) as http:
        while time.monotonic() < until:
            model = random.choice(models)
            try:
                if random.random() < 0.3:
                    response = await http.post(base_url + "/v1/score", json={
                        "model": model, "text_1": "Where do boats go?", "text_2": DOCUMENTS})
                    if response.status_code != 200:
                        raise httpx.HTTPStatusError(response.text[:200], request=response.request, response=response)
                    done["scores"] += 1
                else:
                    await client.rerank(model=model, query="Where do boats go?", documents=DOCUMENTS, top_n=2)
                    done["reranks"] += 1
            except (CohereError, httpx.HTTPError) as exc:
                failures.append(f"rerank {model}: {exc!r}"[:300])


async def _registered_aliases(base_url: str, count: int) -> None:
    """`count` more models, each a demo model's files under a key of its own."""
    async with httpx.AsyncClient(timeout=120) as http:
        for n in range(count):
            response = await http.post(base_url + "/admin/models", json={
                "key": f"soak/{n}", "path": DEMO_MODELS[n % len(DEMO_MODELS)]})
            response.raise_for_status()


def _batch_requests(models: list[str], count: int) -> list[dict]:
    """`count` lines of OpenAI's batch format over `models`: chats, and every fourth an embedding."""
    requests = []
    for n in range(count):
        model = models[n % len(models)]
        if n % 4 == 3:
            url, body = "/v1/embeddings", {"model": model, "input": ["a short text", "another"]}
        else:
            url, body = "/v1/chat/completions", {"model": model, "max_tokens": 8,
                                                 "messages": [{"role": "user", "content": f"Hello {n}"}]}
        requests.append({"custom_id": f"r{n}", "method": "POST", "url": url, "body": body})
    return requests


async def _batch(base_url: str, models: list[str], count: int, done: Counter[str], failures: list[str]) -> None:
    """``shoal run-batch`` on `count` requests over `models`, beside the clients."""
    with tempfile.TemporaryDirectory() as folder:
        batch, output = Path(folder) / "batch.jsonl", Path(folder) / "out.jsonl"
        batch.write_text("".join(json.dumps(request) + "\n" for request in _batch_requests(models, count)))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "shoal.cli.main", "run-batch", "-i", str(batch), "-o", str(output),
            "--url", base_url, "--concurrency", "8", stderr=asyncio.subprocess.PIPE)
        _, stderr = await process.communicate()
        records = [json.loads(line) for line in output.read_text().splitlines()] if output.exists() else []
        answered = [record for record in records if (record.get("response") or {}).get("status_code") == 200]
        done["batch_lines"] += len(answered)
        if process.returncode != 0 or len(answered) != count:
            failures.append(f"run-batch: exit {process.returncode}, {len(answered)}/{count} answered: "
                            f"{stderr.decode()[-300:]}")


async def _batch_api(base_url: str, models: list[str], count: int, done: Counter[str], failures: list[str]) -> None:
    """OpenAI's Batch API on `count` requests over `models` (a batch per endpoint), beside the
    clients; waits for the batches to end."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", timeout=60)
    requests = _batch_requests(models, count)
    batches = []
    for endpoint in ("/v1/chat/completions", "/v1/embeddings"):
        lines = "".join(json.dumps(request) + "\n" for request in requests if request["url"] == endpoint)
        source = await client.files.create(file=("soak.jsonl", lines.encode()), purpose="batch")
        batches.append(await client.batches.create(input_file_id=source.id, endpoint=endpoint,  # type: ignore[arg-type]
                                                   completion_window="24h"))
    for batch in batches:
        while batch.status not in ("completed", "failed", "cancelled", "expired"):
            await asyncio.sleep(2)
            batch = await client.batches.retrieve(batch.id)
        counts = batch.request_counts
        completed, failed = (counts.completed, counts.failed) if counts else (0, 0)
        done["batch_api_lines"] += completed
        if batch.status != "completed" or failed:
            first = ((await client.files.content(batch.error_file_id)).text.splitlines()[0][:200]
                     if batch.error_file_id else batch.errors)
            failures.append(f"batch {batch.endpoint}: {batch.status}, {failed} failed; first: {first}")
    await client.close()


async def _churner(base_url: str, num_aliases: int, until: float, every_s: float, done: Counter[str],
                   failures: list[str]) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() + every_s < until:
            await asyncio.sleep(every_s)
            n = random.randrange(num_aliases)
            try:
                (await http.delete(f"{base_url}/admin/models/soak/{n}")).raise_for_status()
                await asyncio.sleep(every_s / 2)
                (await http.post(base_url + "/admin/models", json={
                    "key": f"soak/{n}", "path": DEMO_MODELS[n % len(DEMO_MODELS)]})).raise_for_status()
                done["churns"] += 1
            except httpx.HTTPError as exc:
                failures.append(f"churn soak/{n}: {exc!r}"[:300])


def _is_removed(failure: str) -> bool:
    """A request for a model the churn removed meanwhile (``soak/<n>``): its 404 is the right answer."""
    return " soak/" in failure and any(sign in failure for sign in ("does not exist", "is not registered"))


async def _unloader(base_url: str, models: list[str], until: float, every_s: float, done: Counter[str],
                    failures: list[str]) -> None:
    client = ollama.AsyncClient(host=base_url, timeout=240)
    while time.monotonic() + every_s < until:
        await asyncio.sleep(every_s)
        model = random.choice(models)
        try:
            await client.generate(model=model, keep_alive=0)
            done["unloads"] += 1
        except (ollama.ResponseError, httpx.HTTPError) as exc:
            failures.append(f"unload {model}: {exc!r}"[:300])


async def soak(base_url: str, duration_s: float, num_clients: int, unload_every_s: float, num_aliases: int = 0,
               batch_size: int = 0, churn_every_s: float = 0.0, batch_api_size: int = 0) -> int:
    await _registered_aliases(base_url, num_aliases)
    async with httpx.AsyncClient(timeout=30) as http:
        models = [m["id"] for m in (await http.get(base_url + "/v1/models")).json()["data"]]
    steady = [m for m in models if not (churn_every_s and m.startswith("soak/"))]  # never removed meanwhile
    until = time.monotonic() + duration_s
    done: Counter[str] = Counter()
    failures: list[str] = []
    await asyncio.gather(
        *(_openai_client(base_url, models, until, done, failures) for _ in range(num_clients)),
        *(_ollama_client(base_url, models, until, done, failures) for _ in range(num_clients)),
        *(_anthropic_client(base_url, models, until, done, failures) for _ in range(num_clients)),
        *(_cohere_client(base_url, models, until, done, failures) for _ in range(num_clients)),
        *([_batch(base_url, steady, batch_size, done, failures)] if batch_size else []),
        *([_batch_api(base_url, steady, batch_api_size, done, failures)] if batch_api_size else []),
        *([_churner(base_url, num_aliases, until, churn_every_s, done, failures)]
          if churn_every_s and num_aliases else []),
        _unloader(base_url, models, until, unload_every_s, done, failures))
    await asyncio.sleep(3)  # the last replies' confirmations
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = (await http.get(base_url + "/metrics")).text
    inboxes = next(float(line.split()[1]) for line in metrics.splitlines()
                   if line.startswith("shoal_gateway_reply_inboxes "))
    if churn_every_s:
        done["404_removed_meanwhile"] = sum(map(_is_removed, failures))
        failures = [failure for failure in failures if not _is_removed(failure)]
    print(f"models {len(models)}, {duration_s:g} s, {num_clients} clients per API: "
          f"{dict(sorted(done.items()))}; failed {len(failures)}; reply inboxes after {inboxes:g}")
    for failure in failures[:20]:
        print("  " + failure)
    return 1 if failures or inboxes else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=6, help="clients per API (OpenAI, Ollama, Anthropic, Cohere)")
    parser.add_argument("--unload-every-s", type=float, default=4.0)
    parser.add_argument("--aliases", type=int, default=0, help="register this many more models first (soak/<n>)")
    parser.add_argument("--batch", type=int, default=0, help="run shoal run-batch on this many requests meanwhile")
    parser.add_argument("--batch-api", type=int, default=0,
                        help="run this many requests through OpenAI's Batch API meanwhile (and wait for them)")
    parser.add_argument("--churn-every-s", type=float, default=0.0,
                        help="remove one of the --aliases models and register it again this often (0: never)")
    args = parser.parse_args()
    sys.exit(asyncio.run(soak(args.base_url, args.duration_s, args.clients, args.unload_every_s, args.aliases,
                              args.batch, args.churn_every_s, args.batch_api)))


if __name__ == "__main__":
    main()
