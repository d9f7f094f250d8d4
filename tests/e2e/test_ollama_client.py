"""Ollama's own Python client (`ollama`) against `shoal up`'s ``/api``: what a user of Ollama,
or of a tool built on it, does first. Every answer is checked against what the OpenAI API
answers to the same request, so the two APIs cannot drift apart."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import ollama
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import ShoalUp, context_length

pytestmark = pytest.mark.e2e

SMALL = "demo/llama-5m"
OTHER = "demo/qwen2-25m"
GREEDY = {"temperature": 0, "num_predict": 8}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                   "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}


@pytest.fixture(scope="module")
def api(shoal: ShoalUp) -> ollama.Client:
    return ollama.Client(host=shoal.base_url, timeout=240)


def _http(shoal: ShoalUp, method: str, path: str, body: dict[str, Any] | bytes | None = None
          ) -> tuple[int, str, bytes]:
    """(status, content type, body) of a raw request."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(shoal.base_url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def _register(shoal: ShoalUp, **model: Any) -> None:
    status, _, body = _http(shoal, "POST", "/admin/models", model)
    assert status == 200, body


def test_the_server_answers_ollamas_probes(shoal: ShoalUp, api: ollama.Client) -> None:
    status, _, body = _http(shoal, "GET", "/")
    assert status == 200 and b"Shoal is running" in body
    status, _, body = _http(shoal, "GET", "/api/version")
    version = json.loads(body)
    assert status == 200 and version["shoal_version"]
    # Ollama's numbering (clients refuse servers older than 0.6.4), not Shoal's
    assert tuple(int(part) for part in version["version"].split(".")) >= (0, 6, 4)


def test_tags_list_the_served_models_with_their_details(shoal: ShoalUp, api: ollama.Client,
                                                        client: openai.OpenAI) -> None:
    served = sorted(model.id for model in client.models.list())
    deadline = time.monotonic() + 60
    while True:  # a model's details come from its inspection by a node agent, just after startup
        listed = api.list().models
        if all(m.details is not None and m.details.family for m in listed) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert sorted(m.model or "" for m in listed) == served
    small = next(m for m in listed if m.model == SMALL)
    assert small.details is not None and small.details.family == "llama" and small.details.parameter_size
    assert (small.size or 0) > 0 and small.digest and len(small.digest) == 64
    shown = api.show(OTHER)
    assert shown.details is not None and shown.details.family == "qwen2"
    assert shown.capabilities is not None and {"completion", "tools"} <= set(shown.capabilities)
    assert shown.modelinfo is not None and shown.modelinfo["general.architecture"] == "qwen2"


def test_pulling_a_registered_model_succeeds_at_once(api: ollama.Client) -> None:
    """A script that pulls before it chats (``ollama.pull(model)``) goes on: the model is
    there. Its ``:latest`` name too; an unregistered model is Ollama's error, saying why."""
    assert api.pull(SMALL).status == "success"
    assert [progress.status for progress in api.pull(SMALL + ":latest", stream=True)] == ["pulling manifest",
                                                                                         "success"]
    with pytest.raises(ollama.ResponseError) as caught:
        api.pull("llama3.2")
    assert caught.value.status_code == 404 and "does not download models" in caught.value.error


def test_chat_answers_as_the_openai_api_does(api: ollama.Client, client: openai.OpenAI,
                                             demo_models_root: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a sea."}]
    reply = api.chat(model=SMALL, messages=messages, options=GREEDY)
    expected = client.chat.completions.create(model=SMALL, messages=messages, max_tokens=8, temperature=0)
    assert reply.message.role == "assistant" and reply.message.content == expected.choices[0].message.content
    assert reply.done and reply.done_reason == expected.choices[0].finish_reason
    assert expected.usage is not None
    assert (reply.prompt_eval_count, reply.eval_count) == (expected.usage.prompt_tokens,
                                                           expected.usage.completion_tokens)
    assert reply.total_duration and reply.eval_duration is not None and reply.load_duration is not None
    assert reply.total_duration >= reply.load_duration + reply.eval_duration

    parts = list(api.chat(model=SMALL, messages=messages, options=GREEDY, stream=True))
    assert "".join(part.message.content or "" for part in parts) == reply.message.content
    assert [part.done for part in parts] == [False] * (len(parts) - 1) + [True]
    assert (parts[-1].eval_count, parts[-1].done_reason) == (reply.eval_count, reply.done_reason)

    prefilled = [*messages, {"role": "assistant", "content": "The Bal"}]  # Ollama continues a last answer
    continued = api.chat(model=SMALL, messages=prefilled, options=GREEDY)
    expected_continued = client.chat.completions.create(model=SMALL, messages=prefilled, max_tokens=8, temperature=0,
                                                        extra_body={"continue_final_message": True})
    assert continued.message.content == expected_continued.choices[0].message.content
    assert expected_continued.usage is not None
    assert continued.prompt_eval_count == expected_continued.usage.prompt_tokens

    scored = api.chat(model=SMALL, messages=messages, options=GREEDY, logprobs=True, top_logprobs=2)
    expected_scores = client.chat.completions.create(model=SMALL, messages=messages, max_tokens=8, temperature=0,
                                                     logprobs=True, top_logprobs=2).choices[0].logprobs
    assert scored.logprobs is not None and expected_scores is not None and expected_scores.content is not None
    assert [(entry.token, len(entry.top_logprobs or ())) for entry in scored.logprobs] == [
        (entry.token, 2) for entry in expected_scores.content]
    assert [entry.logprob for entry in scored.logprobs] == pytest.approx(
        [entry.logprob for entry in expected_scores.content], abs=1e-4)
    streamed_scores = [e for part in api.chat(model=SMALL, messages=messages, options=GREEDY, logprobs=True,
                                              stream=True) for e in part.logprobs or ()]
    assert [e.token for e in streamed_scores] == [e.token for e in scored.logprobs]


def test_generate_is_a_chat_turn_or_with_raw_a_completion(api: ollama.Client, client: openai.OpenAI,
                                                          demo_models_root: Path) -> None:
    templated = api.generate(model=OTHER, prompt="Why is the sea salty?", system="Be brief.", options=GREEDY)
    chat = client.chat.completions.create(model=OTHER, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why is the sea salty?"}])
    assert templated.response == chat.choices[0].message.content and chat.usage is not None
    assert templated.prompt_eval_count == chat.usage.prompt_tokens

    raw = api.generate(model=OTHER, prompt="The sea is", raw=True, options=GREEDY)
    completion = client.completions.create(model=OTHER, prompt="The sea is", max_tokens=8, temperature=0)
    assert raw.response == completion.choices[0].text
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / OTHER)
    assert raw.prompt_eval_count == len(tokenizer.encode("The sea is"))
    streamed = list(api.generate(model=OTHER, prompt="The sea is", raw=True, options=GREEDY, stream=True))
    assert "".join(part.response or "" for part in streamed) == raw.response and streamed[-1].done


def test_options_reach_the_sampler(api: ollama.Client) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    seeded = {"temperature": 1.0, "seed": 11, "num_predict": 12, "top_k": 50, "repeat_penalty": 1.2}
    first = api.chat(model=SMALL, messages=messages, options=seeded).message.content
    assert api.chat(model=SMALL, messages=messages, options=seeded).message.content == first
    capped = api.chat(model=SMALL, messages=messages, options={"num_predict": 3, "num_ctx": 8192})
    assert capped.eval_count == 3 and capped.done_reason == "length"  # num_ctx: the operator's, ignored
    # Steps Shoal's sampler lacks are ignored (as current Ollama does); values it bounds are clamped.
    lenient = api.chat(model=SMALL, messages=messages,
                       options={"mirostat": 2, "typical_p": 0.7, "temperature": 5, "top_k": 40.0, "num_predict": 3.0})
    assert lenient.eval_count == 3 and lenient.done
    tagged = api.chat(model=SMALL + ":latest", messages=messages, options=GREEDY)  # Ollama's default tag
    assert tagged.model == SMALL + ":latest" and tagged.eval_count


def test_a_format_schema_shapes_the_answer(api: ollama.Client) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["sea"],
              "properties": {"sea": {"enum": ["Baltic", "North"]}}}
    reply = api.chat(model=SMALL, messages=[{"role": "user", "content": "A sea?"}], format=schema,
                     options={"num_predict": 40, "temperature": 0})
    assert json.loads(reply.message.content or "")["sea"] in ("Baltic", "North")
    generated = api.generate(model=SMALL, prompt="A sea?", format="json", options={"num_predict": 40})
    assert generated.done_reason == "length" or isinstance(json.loads(generated.response or ""), dict)


def test_calls_come_as_ollama_tool_calls_with_object_arguments(shoal: ShoalUp, api: ollama.Client,
                                                               demo_models_root: Path) -> None:
    """A model whose calls are Llama-style JSON objects; the answer is made one by ``format``
    (random weights never write a call), then read as a call."""
    _register(shoal, key="org/ollama-calls", path=SMALL, tool_call_parser="llama3_json")
    call_object = {"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
                   "properties": {"name": {"const": "get_time"},
                                  "parameters": TIME_TOOL["function"]["parameters"]}}  # type: ignore[index]
    kwargs: dict[str, Any] = dict(model="org/ollama-calls", messages=[{"role": "user", "content": "Time?"}],
                                  tools=[TIME_TOOL], format=call_object, options={"num_predict": 60, "temperature": 0})
    reply = api.chat(**kwargs)
    (call,) = reply.message.tool_calls or []
    assert call.function.name == "get_time" and call.function.arguments["zone"] in ("UTC", "CET")
    assert reply.message.content == "" and reply.done_reason == "stop"
    status, _, raw = _http(shoal, "POST", "/api/chat", {**kwargs, "stream": False})
    (wire_call,) = json.loads(raw)["message"]["tool_calls"]  # Ollama's current shape: an id, an index
    assert status == 200 and wire_call["id"].startswith("call_") and wire_call["function"]["index"] == 0
    streamed = [c for part in api.chat(**kwargs, stream=True) for c in part.message.tool_calls or ()]
    assert [(c.function.name, dict(c.function.arguments)) for c in streamed] == [
        (call.function.name, dict(call.function.arguments))]

    # The call and its result go back to the model as its template renders them.
    turns = [{"role": "user", "content": "Time?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"function": {"name": "get_time", "arguments": {"zone": "UTC"}}}]},
             {"role": "tool", "content": "12:00", "tool_name": "get_time"}]
    answer = api.chat(model=OTHER, messages=turns, tools=[TIME_TOOL], options=GREEDY)
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / OTHER)
    sent_tool = ollama.Tool.model_validate(TIME_TOOL).model_dump(exclude_none=True)  # as the client sends it
    text = tokenizer.apply_chat_template(turns, tools=[sent_tool], tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n12:00\n</tool_response>" in text and '"arguments": {"zone": "UTC"}' in text
    assert answer.prompt_eval_count == len(tokenizer.encode(text, add_special_tokens=False))


def test_a_reasoning_models_thinking_comes_apart(shoal: ShoalUp, api: ollama.Client) -> None:
    _register(shoal, key="org/ollama-thinker", path=SMALL, reasoning_parser="deepseek_r1",
              grammar_after_reasoning=False)
    shaped = {"const": "plan</think>answer"}  # random weights never close a think block
    kwargs: dict[str, Any] = dict(model="org/ollama-thinker", messages=[{"role": "user", "content": "2+2?"}],
                                  format=shaped, options={"num_predict": 40})
    reply = api.chat(**kwargs, think=True)
    assert (reply.message.thinking, reply.message.content) == ('"plan', 'answer"')
    parts = list(api.chat(**kwargs, think=True, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == '"plan'
    assert "".join(p.message.content or "" for p in parts) == 'answer"'
    generated = api.generate(model="org/ollama-thinker", prompt="2+2?", format=shaped, think="high",
                             options={"num_predict": 40})
    assert (generated.thinking, generated.response) == ('"plan', 'answer"')
    assert api.show("org/ollama-thinker").capabilities == ["completion", "tools", "thinking"]
    with pytest.raises(ollama.ResponseError) as caught:
        api.chat(model=SMALL, messages=[{"role": "user", "content": "x"}], think=True)
    assert caught.value.status_code == 400 and "does not support thinking" in caught.value.error


def test_embed_is_the_openai_apis_embedding(shoal: ShoalUp, api: ollama.Client, client: openai.OpenAI) -> None:
    texts = ["The sea is calm.", "A storm comes."]
    embedded = api.embed(model=SMALL, input=texts)
    expected = client.embeddings.create(model=SMALL, input=texts)
    assert len(embedded.embeddings) == 2
    for vector, item in zip(embedded.embeddings, expected.data, strict=True):
        assert list(vector) == pytest.approx(item.embedding, abs=1e-6)
    assert embedded.prompt_eval_count == expected.usage.prompt_tokens
    # the older /api/embeddings answers the vector as the model computed it, as Ollama does
    # (vLLM's normalize: false); /api/embed normalizes unless told not to
    older = list(api.embeddings(model=SMALL, prompt=texts[0]).embedding)
    raw = client.embeddings.create(model=SMALL, input=texts[0], extra_body={"normalize": False}).data[0].embedding
    assert older == pytest.approx(raw, abs=1e-5)
    length = sum(value * value for value in raw) ** 0.5
    assert abs(length - 1.0) > 1e-3, "a final hidden state is not of unit length"
    assert [value / length for value in raw] == pytest.approx(expected.data[0].embedding, abs=1e-6)
    status, _, body = _http(shoal, "POST", "/api/embed", {"model": SMALL, "input": texts[0], "normalize": False})
    assert status == 200 and json.loads(body)["embeddings"][0] == pytest.approx(raw, abs=1e-5)
    assert list(api.embeddings(model=SMALL, prompt="").embedding) == []
    assert list(api.embed(model=SMALL, input=[]).embeddings) == []  # loads the model, embeds nothing

    short = api.embed(model=SMALL, input=texts[0], dimensions=8).embeddings[0]  # as Ollama shortens one
    first = expected.data[0].embedding[:8]
    norm = sum(value * value for value in first) ** 0.5
    assert list(short) == pytest.approx([value / norm for value in first], abs=1e-6)


def test_a_conversation_longer_than_the_context_loses_its_oldest_messages(
        shoal: ShoalUp, api: ollama.Client, client: openai.OpenAI, demo_models_root: Path) -> None:
    """Ollama's truncation of a chat: the system message and the latest turns that fit are
    read (with room to answer); ``truncate: false`` makes it a 400, as ``/v1`` answers."""
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}. " + "The tide comes in. " * 40}
             for i in range(41)]
    messages = [{"role": "system", "content": "Be brief."}, *turns]
    context = context_length(client, SMALL)
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)
    whole = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert len(tokenizer.encode(whole, add_special_tokens=False)) > context
    reply = api.chat(model=SMALL, messages=messages, options=GREEDY)
    assert reply.done and reply.prompt_eval_count is not None and reply.prompt_eval_count < context
    kept = {len(tokenizer.encode(tokenizer.apply_chat_template([messages[0], *turns[n:]], tokenize=False,
                                                               add_generation_prompt=True),
                                 add_special_tokens=False)): n for n in range(len(turns))}
    assert reply.prompt_eval_count in kept and kept[reply.prompt_eval_count] > 0
    status, _, raw = _http(shoal, "POST", "/api/chat", {"model": SMALL, "messages": messages, "truncate": False})
    assert status == 400 and "error" in json.loads(raw)


def test_a_prompt_longer_than_the_context_loses_its_start_unless_truncate_is_false(
        shoal: ShoalUp, api: ollama.Client, client: openai.OpenAI, demo_models_root: Path) -> None:
    """Ollama's truncation of a prompt (or a chat's last message) that no dropped message makes
    fit: its first 4 tokens (the template's opening) and its latest are read, room left for
    ``num_predict``; the answer is what ``/v1`` answers to those tokens. ``truncate: false``: a 400."""
    text = "The tide comes in over the sand, and the gulls call. " * 500
    context = context_length(client, SMALL)
    tokenizer = AutoTokenizer.from_pretrained(demo_models_root / SMALL)
    cases = {"/api/generate": {"prompt": text}, "/api/chat": {"messages": [{"role": "user", "content": text}]}}
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    assert len(ids) > context
    kept = ids[:4] + ids[-(context - GREEDY["num_predict"] - 4):]
    expected = client.completions.create(model=SMALL, prompt=kept, max_tokens=8, temperature=0)
    assert expected.usage is not None and expected.usage.prompt_tokens == context - 8
    for path, body in cases.items():
        status, _, raw = _http(shoal, "POST", path, {"model": SMALL, **body, "options": GREEDY, "stream": False})
        answer = json.loads(raw)
        assert status == 200 and answer["done"], answer
        assert answer["prompt_eval_count"] == context - 8 and answer["eval_count"] == expected.usage.completion_tokens
        said = answer["response"] if path == "/api/generate" else answer["message"]["content"]
        assert said and said == expected.choices[0].text
        status, _, raw = _http(shoal, "POST", path, {"model": SMALL, **body, "stream": False, "truncate": False})
        assert status == 400 and "prompt is too long" in json.loads(raw)["error"]


def test_a_corpus_at_once_is_embedded_in_batches(api: ollama.Client, client: openai.OpenAI) -> None:
    """LangChain's `OllamaEmbeddings` sends every document in one request; OpenAI takes 2,048
    inputs: both are computed 128 at a time, in order."""
    corpus = [f"Document {i} is about the sea." for i in range(300)]
    embedded = api.embed(model=SMALL, input=corpus).embeddings
    listed = client.embeddings.create(model=SMALL, input=corpus)
    assert len(embedded) == len(listed.data) == 300 and [item.index for item in listed.data] == list(range(300))
    one = client.embeddings.create(model=SMALL, input=corpus[257]).data[0].embedding
    assert list(embedded[257]) == pytest.approx(one, abs=1e-5)
    assert listed.data[257].embedding == pytest.approx(one, abs=1e-5)


def test_an_input_longer_than_the_context_loses_its_end_unless_truncate_is_false(
        api: ollama.Client, client: openai.OpenAI, demo_models_root: Path) -> None:
    """Ollama's ``truncate`` (on by default): the input's first tokens that fit the context
    (with room for one more) are embedded; ``truncate: false`` makes it an error."""
    long_text = "The tide comes in over the sand. " * 400
    ids = AutoTokenizer.from_pretrained(demo_models_root / SMALL).encode(long_text)
    context = context_length(client, SMALL)
    assert len(ids) > context
    embedded = api.embed(model=SMALL, input=long_text)
    assert embedded.prompt_eval_count == context - 1
    start = client.embeddings.create(model=SMALL, input=[ids[:context - 1]]).data[0].embedding
    assert list(embedded.embeddings[0]) == pytest.approx(start, abs=1e-5)
    with pytest.raises(ollama.ResponseError) as caught:
        api.embed(model=SMALL, input=long_text, truncate=False)
    assert caught.value.status_code == 400


def test_load_ps_and_unload_follow_the_models_replicas(shoal: ShoalUp, api: ollama.Client) -> None:
    """An empty request loads a model (it answers once a replica serves), ``/api/ps`` lists it
    with its GPU bytes, ``keep_alive: 0`` puts it to sleep, and the next request wakes it."""
    _register(shoal, key="org/ollama-sleeper", path=SMALL)
    assert "org/ollama-sleeper" not in [m.model for m in api.ps().models]
    assert api.generate(model="org/ollama-sleeper").done_reason == "load"
    running = {m.model: m for m in api.ps().models}
    sleeper = running["org/ollama-sleeper"]
    assert (sleeper.size_vram or 0) > 0 and sleeper.expires_at is not None and sleeper.expires_at.year == 9999
    assert sleeper.context_length

    assert api.chat(model="org/ollama-sleeper", messages=[], keep_alive=0).done_reason == "unload"
    deadline = time.monotonic() + 60
    while "org/ollama-sleeper" in [m.model for m in api.ps().models]:
        assert time.monotonic() < deadline, "the model did not leave its GPU"
        time.sleep(0.2)
    woken = api.chat(model="org/ollama-sleeper", messages=[{"role": "user", "content": "hi"}], options=GREEDY)
    assert woken.done and woken.load_duration and woken.load_duration > 0
    assert "org/ollama-sleeper" in [m.model for m in api.ps().models]


@pytest.mark.parametrize(("method", "path", "body", "status", "says"), [
    ("POST", "/api/chat", {"model": "org/none", "messages": [{"role": "user", "content": "x"}]}, 404,
     "does not exist"),
    ("POST", "/api/chat", b"{not json", 400, "not valid JSON"),
    ("POST", "/api/chat", {"model": SMALL, "messages": [{"role": "user", "content": "x",
                                                         "images": ["aGVsbG8="]}]}, 400, "images"),
    ("POST", "/api/generate", {"model": SMALL, "prompt": "x", "keep_alive": "soon"}, 400, "keep_alive"),
    ("POST", "/api/generate", {"model": SMALL, "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("POST", "/api/show", {"model": "org/none"}, 404, "does not exist"),
    ("POST", "/api/show", {}, 400, "model is required"),
    ("POST", "/api/generate", {"model": SMALL, "prompt": "x", "raw": True, "system": "y"}, 400, "system"),
    ("POST", "/api/pull", {"model": "llama3"}, 404, "is not registered: Shoal does not download models"),
    ("POST", "/api/pull", {}, 400, "model is required"),
    ("POST", "/api/copy", {"source": SMALL, "destination": "x"}, 501, "POST /admin/models"),
    ("DELETE", "/api/delete", {"model": SMALL}, 501, "does not pull or create"),
    ("GET", "/api/nothing", None, 404, "no route"),
])
def test_errors_are_ollamas_error_objects(shoal: ShoalUp, method: str, path: str, body: Any, status: int,
                                          says: str) -> None:
    code, content_type, raw = _http(shoal, method, path, body)
    assert code == status and content_type.startswith("application/json")
    error = json.loads(raw)
    assert set(error) == {"error"} and says in error["error"], error


def test_a_streamed_chat_is_json_lines_counted_in_the_gateways_metrics(shoal: ShoalUp) -> None:
    status, content_type, raw = _http(shoal, "POST", "/api/chat", {
        "model": SMALL, "messages": [{"role": "user", "content": "hi"}], "options": GREEDY})
    lines = [json.loads(line) for line in raw.decode().splitlines()]
    assert status == 200 and content_type.startswith("application/x-ndjson")
    assert lines[-1]["done"] is True and all(line["done"] is False for line in lines[:-1])
    assert {"total_duration", "prompt_eval_count", "eval_count"} <= set(lines[-1])
    _, _, metrics = _http(shoal, "GET", "/metrics")
    assert f'shoal_gateway_requests_total{{kind="ollama_chat",model="{SMALL}",outcome="ok"}}'.encode() in metrics
