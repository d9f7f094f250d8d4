"""Tiny demo models made locally: random seeded weights and a BPE tokenizer trained on shipped text.

`shoal up` on a fresh machine and the tests serve these, so nothing is ever downloaded. Every
model directory is a normal Hugging Face checkpoint that loads with `from_pretrained` and
`trust_remote_code=False`. The model key is also the directory, relative to the models root::

    <models_root>/demo/llama-5m/     config.json            model.safetensors   tokenizer.json
    <models_root>/demo/qwen2-25m/    generation_config.json chat_template.jinja tokenizer_config.json
    <models_root>/demo/llama-100m/

The same bytes come out of every run with the same library versions: the tokenizer is trained on
`demo_corpus.txt` (once per run, the same one saved into every directory) and each model's weights
come from its own fixed seed.

torch, tokenizers and transformers are imported only where a model is made: the control-plane
services ask this module which demo models exist and must not pay seconds of imports for that.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
from safetensors import safe_open

from shoal.shared.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerFast

log = structlog.get_logger(__name__)

VOCAB_SIZE = 4096
MAX_POSITION_EMBEDDINGS = 2048
UNK_TOKEN = "<|unk|>"
BOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
# The trainer puts special tokens first, so this order fixes their ids: 0..4.
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)
SPECIAL_TOKEN_IDS = {token: token_id for token_id, token in enumerate(SPECIAL_TOKENS)}

# ChatML, with tools as Qwen2.5 renders them (Hermes style): the functions listed in the system
# turn, calls as <tool_call> JSON, results as <tool_response> in a user turn. Content may be a
# string or a list of OpenAI-style parts ({"type": "text", "text": ...}). As Qwen3's, it takes
# `enable_thinking` (chat_template_kwargs): false closes an empty think block in the prompt.
CHAT_TEMPLATE = (
    "{%- macro content(message) %}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] %}{%- for part in message['content'] if part['type'] == 'text' %}"
    "{{- part['text'] }}{%- endfor %}{%- endif %}"
    "{%- endmacro %}"
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- content(messages[0]) + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'"
    " + 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments'"
    " + ' within <tool_call></tool_call> XML tags:\\n<tool_call>\\n'"
    " + '{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or loop.previtem['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content(message) + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif not (tools and loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content(message) }}"
    "{%- for call in message['tool_calls'] or [] %}"
    "{%- if loop.first and content(message) or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{%- set arguments = call['function']['arguments'] %}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' }}"
    "{{- (arguments if arguments is string else arguments | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_CORPUS_FILE = "demo_corpus.txt"  # package data, next to this module
_WEIGHTS_FILE = "model.safetensors"
_CHAT_TEMPLATE_FILE = "chat_template.jinja"  # transformers writes the tokenizer's template there
_REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    _WEIGHTS_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
)


@dataclass(frozen=True)
class DemoModel:
    """One demo model on disk."""

    key: str
    """Model key clients use, e.g. `demo/llama-5m`."""
    path: str
    """Directory of the checkpoint, relative to the models root."""
    architecture: str
    """transformers architecture class name, e.g. `LlamaForCausalLM`."""
    num_parameters: int
    """Distinct parameters, as stored in the weights file (tied embeddings counted once)."""


@dataclass(frozen=True)
class _Recipe:
    """Shape and seed of one demo model."""

    key: str
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_word_embeddings: bool
    seed: int

    def make_config(self) -> PretrainedConfig:
        """The model config, with the tokenizer's special token ids."""
        from transformers import LlamaConfig, Qwen2Config

        config_class = {"LlamaForCausalLM": LlamaConfig, "Qwen2ForCausalLM": Qwen2Config}[self.architecture]
        # Qwen2 always has q/k/v biases; Llama has none (attention_bias defaults to False).
        return config_class(
            architectures=[self.architecture],
            vocab_size=VOCAB_SIZE,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            max_position_embeddings=MAX_POSITION_EMBEDDINGS,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=SPECIAL_TOKEN_IDS[BOS_TOKEN],
            eos_token_id=SPECIAL_TOKEN_IDS[EOS_TOKEN],
            pad_token_id=SPECIAL_TOKEN_IDS[PAD_TOKEN],
            dtype="float32",
        )


# Head dim 64 everywhere; every model uses grouped-query attention.
_RECIPES = (
    _Recipe("demo/llama-5m", "LlamaForCausalLM", 256, 704, 4, 4, 2, tie_word_embeddings=False, seed=5),
    _Recipe("demo/qwen2-25m", "Qwen2ForCausalLM", 512, 1536, 8, 8, 2, tie_word_embeddings=True, seed=25),
    _Recipe("demo/llama-100m", "LlamaForCausalLM", 768, 2560, 12, 12, 4, tie_word_embeddings=False, seed=100),
)

DEMO_MODEL_KEYS: tuple[str, ...] = tuple(recipe.key for recipe in _RECIPES)


def make_demo_models(
    models_root: Path, *, force: bool = False, names: Iterable[str] | None = None
) -> list[DemoModel]:
    """Write the demo models under `models_root`, skipping complete ones unless `force`.

    Args:
        models_root: directory that holds model checkpoints; created if missing.
        force: rewrite models that are already complete.
        names: only these model keys (default: all of `DEMO_MODEL_KEYS`).

    Returns:
        The requested demo models, in `DEMO_MODEL_KEYS` order, whether written now or before.

    Raises:
        ValueError: `names` holds a key that is not a demo model.
    """
    recipes = _select_recipes(names)
    models_root.mkdir(parents=True, exist_ok=True)
    missing = [recipe for recipe in recipes if force or not _is_complete(models_root / recipe.key)]
    for recipe in recipes:
        if recipe not in missing:
            _refresh_chat_template(models_root / recipe.key)
    if missing:
        tokenizer = _train_tokenizer()
        for recipe in missing:
            _write_model(recipe, tokenizer, models_root / recipe.key)
    log.info(
        "demo_models.ready",
        models_root=str(models_root),
        num_written=len(missing),
        num_already_present=len(recipes) - len(missing),
    )
    return [_read_model(recipe, models_root) for recipe in recipes]


def demo_model_configs(models_root: Path) -> list[ModelConfig]:
    """How to serve every complete demo model under `models_root` (key = path, defaults otherwise)."""
    return [ModelConfig(key=recipe.key, path=recipe.key) for recipe in _RECIPES
            if _is_complete(models_root / recipe.key)]


def _select_recipes(names: Iterable[str] | None) -> list[_Recipe]:
    if names is None:
        return list(_RECIPES)
    wanted = set(names)
    unknown = wanted - set(DEMO_MODEL_KEYS)
    if unknown:
        raise ValueError(f"unknown demo models {sorted(unknown)}; known: {list(DEMO_MODEL_KEYS)}")
    return [recipe for recipe in _RECIPES if recipe.key in wanted]


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in _REQUIRED_FILES)


def _refresh_chat_template(model_dir: Path) -> None:
    """Give a model made by an older Shoal today's chat template (the weights stay)."""
    template = model_dir / _CHAT_TEMPLATE_FILE
    if not template.is_file() or template.read_text(encoding="utf-8") != CHAT_TEMPLATE:
        template.write_text(CHAT_TEMPLATE, encoding="utf-8")
        template.chmod(0o644)
        log.info("demo_model.chat_template_updated", path=str(template))


def _train_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the shipped corpus, wrapped for transformers with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    corpus = Path(__file__).with_name(_CORPUS_FILE).read_text(encoding="utf-8")
    backend = Tokenizer(models.BPE())
    # AutoTokenizer loads a qwen2 checkpoint as Qwen2Tokenizer whatever tokenizer_config.json says, and
    # that class rebuilds the normalizer and pre-tokenizer as below. Training with the same pipeline
    # makes every model directory tokenize identically, whichever class loads it.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(corpus.splitlines(keepends=True), trainer=trainer)
    trained_ids = {token: backend.token_to_id(token) for token in SPECIAL_TOKENS}
    assert trained_ids == SPECIAL_TOKEN_IDS, f"special tokens must keep ids 0..4, got {trained_ids}"
    log.info("demo_tokenizer.trained", vocab_size=backend.get_vocab_size(), corpus_chars=len(corpus))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )


def _write_model(recipe: _Recipe, tokenizer: PreTrainedTokenizerFast, target: Path) -> None:
    """Make one model and move it into place with one rename, so a crash never leaves half a model."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = recipe.make_config()
    with torch.random.fork_rng(devices=[]):  # seed a private stream; the caller's RNG stays as it was
        torch.manual_seed(recipe.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a model directory is not
    try:
        with _progress_bars_disabled():
            model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for path in staging.iterdir():
            path.chmod(0o644)  # safetensors writes the weights 0600; any local user may read a model
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info(
        "demo_model.written",
        model=recipe.key,
        path=str(target),
        weights_bytes=(target / _WEIGHTS_FILE).stat().st_size,
    )


@contextmanager
def _progress_bars_disabled() -> Iterator[None]:
    """Silence transformers' tqdm bars (they write to stderr), then restore their previous state."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _read_model(recipe: _Recipe, models_root: Path) -> DemoModel:
    """Describe a complete model on disk; its parameters are counted from the weights file's header."""
    with safe_open(models_root / recipe.key / _WEIGHTS_FILE, framework="numpy") as weights:
        num_parameters = sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118
    return DemoModel(recipe.key, recipe.key, recipe.architecture, num_parameters)
