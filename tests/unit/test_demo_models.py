"""Demo models: real files under tmp_path, real transformers loads, real generation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shoal.cli.demo_models import (
    CHAT_TEMPLATE,
    DEMO_MODEL_KEYS,
    SPECIAL_TOKEN_IDS,
    DemoModel,
    demo_model_configs,
    make_demo_models,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
SMALLEST = "demo/llama-5m"
SMALL_MODELS = ["demo/llama-5m", "demo/qwen2-25m"]
NOMINAL_PARAMETERS = {"demo/llama-5m": 5e6, "demo/qwen2-25m": 25e6, "demo/llama-100m": 100e6}
ARCHITECTURES = {
    "demo/llama-5m": "LlamaForCausalLM",
    "demo/qwen2-25m": "Qwen2ForCausalLM",
    "demo/llama-100m": "LlamaForCausalLM",
}


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[DemoModel]]:
    """All three demo models, made once for the module (a few seconds)."""
    models_root = tmp_path_factory.mktemp("models")
    return models_root, make_demo_models(models_root)


@pytest.fixture(scope="module")
def models_root(made: tuple[Path, list[DemoModel]]) -> Path:
    return made[0]


def _snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime) of every file: any rewrite changes it."""
    return {
        str(path.relative_to(root)): (path.stat().st_ino, path.stat().st_size, path.stat().st_mtime_ns)
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def _file_bytes(model_dir: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(model_dir.iterdir())}


def test_makes_every_demo_model(made: tuple[Path, list[DemoModel]]) -> None:
    models_root, demo_models = made
    assert [model.key for model in demo_models] == list(DEMO_MODEL_KEYS) == list(NOMINAL_PARAMETERS)
    for model in demo_models:
        assert model.path == model.key
        assert model.architecture == ARCHITECTURES[model.key]
        config = json.loads((models_root / model.path / "config.json").read_text())
        assert config["architectures"] == [model.architecture]
        assert config["max_position_embeddings"] == 2048
        assert config["dtype"] == "float32"
        assert config["num_key_value_heads"] < config["num_attention_heads"], "every demo model uses GQA"
    assert [(m.key, m.path) for m in demo_model_configs(models_root)] == [(key, key) for key in DEMO_MODEL_KEYS]


def test_parameter_counts_match_names_and_configs(made: tuple[Path, list[DemoModel]]) -> None:
    models_root, demo_models = made
    for model in demo_models:
        nominal = NOMINAL_PARAMETERS[model.key]
        assert 0.7 * nominal <= model.num_parameters <= 1.3 * nominal, (model.key, model.num_parameters)
        config = AutoConfig.from_pretrained(models_root / model.path)
        with torch.device("meta"):  # counts from the config alone, without loading weights
            from_config = AutoModelForCausalLM.from_config(config).num_parameters()
        assert model.num_parameters == from_config


def test_second_call_is_fast_and_changes_nothing(models_root: Path) -> None:
    before = _snapshot(models_root)
    started = time.monotonic()
    again = make_demo_models(models_root)
    elapsed_s = time.monotonic() - started
    assert elapsed_s < 1.0
    assert _snapshot(models_root) == before
    assert [model.key for model in again] == list(DEMO_MODEL_KEYS)


def test_same_bytes_in_two_roots(models_root: Path, tmp_path: Path) -> None:
    (model,) = make_demo_models(tmp_path, names=[SMALLEST])
    assert _file_bytes(tmp_path / model.path) == _file_bytes(models_root / model.path)


def test_force_rewrites_with_the_same_bytes(tmp_path: Path) -> None:
    make_demo_models(tmp_path, names=[SMALLEST])
    weights = tmp_path / SMALLEST / "model.safetensors"
    before_bytes, before_inode = weights.read_bytes(), weights.stat().st_ino
    make_demo_models(tmp_path, names=[SMALLEST], force=True)
    assert weights.stat().st_ino != before_inode
    assert weights.read_bytes() == before_bytes
    assert [path.name for path in (tmp_path / "demo").iterdir()] == ["llama-5m"], "no staging dir left"


def test_incomplete_model_is_made_again(tmp_path: Path) -> None:
    make_demo_models(tmp_path, names=[SMALLEST])
    (tmp_path / SMALLEST / "model.safetensors").unlink()
    assert demo_model_configs(tmp_path) == []
    make_demo_models(tmp_path, names=[SMALLEST])
    assert [(m.key, m.path) for m in demo_model_configs(tmp_path)] == [(SMALLEST, SMALLEST)]


def test_a_model_made_by_an_older_shoal_gets_todays_chat_template_and_keeps_its_weights(tmp_path: Path) -> None:
    make_demo_models(tmp_path, names=[SMALLEST])
    template, weights = tmp_path / SMALLEST / "chat_template.jinja", tmp_path / SMALLEST / "model.safetensors"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    weights_before = (weights.stat().st_ino, weights.stat().st_mtime_ns)
    make_demo_models(tmp_path, names=[SMALLEST])
    assert template.read_text(encoding="utf-8") == CHAT_TEMPLATE
    assert (weights.stat().st_ino, weights.stat().st_mtime_ns) == weights_before
    assert "tools" in AutoTokenizer.from_pretrained(tmp_path / SMALLEST).chat_template


def test_making_models_leaves_the_callers_rng_alone(tmp_path: Path) -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    make_demo_models(tmp_path, names=[SMALLEST])
    assert torch.equal(torch.rand(4), expected)


def test_unknown_name_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="demo/gpt-1t"):
        make_demo_models(tmp_path, names=["demo/gpt-1t"])


@pytest.mark.parametrize(
    "text",
    [
        "The river begins as a thin thread of water high in the hills.",
        "def add(a, b):\n    return a + b  # 2 + 2 = 4\n\n\tindented\r\n",
        "Prices: 1,250.00 EUR on 2024-03-18; café, naïve, 東京, emoji 🚀, zero-width\u200bspace",
        "  leading and trailing spaces  ",
    ],
)
def test_tokenizer_round_trips_text_identically_in_every_model_dir(models_root: Path, text: str) -> None:
    tokenizers = [AutoTokenizer.from_pretrained(models_root / key) for key in DEMO_MODEL_KEYS]
    encodings = [tokenizer(text)["input_ids"] for tokenizer in tokenizers]
    assert all(encoding == encodings[0] for encoding in encodings), "one tokenizer, whichever class loads it"
    assert len(encodings[0]) < len(text.encode()), "BPE merges something"
    for tokenizer, encoding in zip(tokenizers, encodings, strict=True):
        assert tokenizer.decode(encoding) == text


def test_tokenizer_special_tokens_match_the_configs(models_root: Path) -> None:
    for key in DEMO_MODEL_KEYS:
        tokenizer = AutoTokenizer.from_pretrained(models_root / key)
        config = AutoConfig.from_pretrained(models_root / key)
        generation = json.loads((models_root / key / "generation_config.json").read_text())
        assert len(tokenizer) == config.vocab_size == 4096
        assert tokenizer.unk_token_id == SPECIAL_TOKEN_IDS["<|unk|>"]
        assert tokenizer.convert_tokens_to_ids("<|im_start|>") == SPECIAL_TOKEN_IDS["<|im_start|>"]
        ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
        assert ids == (config.bos_token_id, config.eos_token_id, config.pad_token_id)
        assert ids == (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"])
        assert tokenizer.eos_token == "<|im_end|>", "generation ends with the ChatML turn"
        assert tokenizer("<|im_start|>user\nhi<|im_end|>")["input_ids"][0] == tokenizer.convert_tokens_to_ids(
            "<|im_start|>"
        ), "special tokens are never split"


def test_chat_template_renders_chatml_with_generation_prompt(models_root: Path) -> None:
    messages = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": [{"type": "text", "text": "Two "}, {"type": "text", "text": "parts."}]},
    ]
    expected = (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        "<|im_start|>user\nTwo parts.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    for key in DEMO_MODEL_KEYS:
        tokenizer = AutoTokenizer.from_pretrained(models_root / key)
        assert tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == expected
        assert tokenizer.apply_chat_template(messages, tokenize=False) == expected.removesuffix(
            "<|im_start|>assistant\n"
        )
        input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert input_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
        assert input_ids[-3:] == tokenizer("<|im_start|>assistant\n")["input_ids"]


@pytest.mark.parametrize("key", SMALL_MODELS)
def test_small_models_load_and_generate(models_root: Path, key: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(models_root / key)
    model = AutoModelForCausalLM.from_pretrained(models_root / key, trust_remote_code=False)
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "Tell me about rivers."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    num_prompt_tokens = prompt["input_ids"].shape[1]
    output = model.generate(**prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert output.shape == (1, num_prompt_tokens + 8)
    assert isinstance(tokenizer.decode(output[0, num_prompt_tokens:]), str)


def test_script_lists_the_models(models_root: Path) -> None:
    script = REPO_ROOT / "scripts" / "make_demo_models.py"
    result = subprocess.run(
        [sys.executable, str(script), "--models-root", str(models_root)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    listed = [line.split("\t")[0] for line in result.stdout.splitlines()]
    assert listed == list(DEMO_MODEL_KEYS)
