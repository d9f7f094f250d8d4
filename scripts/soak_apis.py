"""Soak a running Shoal through its three APIs at once while models keep being put to sleep.

    python scripts/soak_apis.py --base-url http://127.0.0.1:8000 --duration-s 120

`--clients` OpenAI clients stream chats, as many Ollama clients stream chats or embed, and as
many Anthropic clients stream messages or count tokens, each on a model drawn at random from
those served; every `--unload-every-s` one model is unloaded
(Ollama's ``keep_alive: 0``: its replicas sleep) so that requests keep meeting sleeping,
waking and loading replicas. Exits 1 if any request failed or the gateway holds reply inboxes
once the load has stopped (a leak); prints the counts either way (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter

import anthropic
import httpx
import ollama
import openai


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


async def soak(base_url: str, duration_s: float, num_clients: int, unload_every_s: float) -> int:
    async with httpx.AsyncClient(timeout=30) as http:
        models = [m["id"] for m in (await http.get(base_url + "/v1/models")).json()["data"]]
    until = time.monotonic() + duration_s
    done: Counter[str] = Counter()
    failures: list[str] = []
    await asyncio.gather(
        *(_openai_client(base_url, models, until, done, failures) for _ in range(num_clients)),
        *(_ollama_client(base_url, models, until, done, failures) for _ in range(num_clients)),
        *(_anthropic_client(base_url, models, until, done, failures) for _ in range(num_clients)),
        _unloader(base_url, models, until, unload_every_s, done, failures))
    await asyncio.sleep(3)  # the last replies' confirmations
    async with httpx.AsyncClient(timeout=30) as http:
        metrics = (await http.get(base_url + "/metrics")).text
    inboxes = next(float(line.split()[1]) for line in metrics.splitlines()
                   if line.startswith("shoal_gateway_reply_inboxes "))
    print(f"models {len(models)}, {duration_s:g} s, {num_clients} clients per API: "
          f"{dict(sorted(done.items()))}; failed {len(failures)}; reply inboxes after {inboxes:g}")
    for failure in failures[:20]:
        print("  " + failure)
    return 1 if failures or inboxes else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=6, help="clients per API (OpenAI, Ollama, Anthropic)")
    parser.add_argument("--unload-every-s", type=float, default=4.0)
    args = parser.parse_args()
    sys.exit(asyncio.run(soak(args.base_url, args.duration_s, args.clients, args.unload_every_s)))


if __name__ == "__main__":
    main()
