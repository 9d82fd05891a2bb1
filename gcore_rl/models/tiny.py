"""A tiny random causal LM and a character-level tokenizer, built locally.

Everything in the project runs without network access, so tests and the demo start from a
model made here: a Llama- (or Qwen2-) architecture `transformers` model with random weights and a
character-level `tokenizers` tokenizer whose vocabulary is the printable ASCII set. Both are
written in Hugging Face format, so `AutoModelForCausalLM.from_pretrained(path)` and
`AutoTokenizer.from_pretrained(path)` load them like any other checkpoint.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from gcore_rl.errors import ConfigError
from gcore_rl.models.loading import save_model_dir
from gcore_rl.models.vision import (
    VISION_SPECIAL_TOKENS,
    TinyVisionConfig,
    build_tiny_image_processor,
    build_tiny_vlm,
)

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
#: Characters of the tiny vocabulary: printable ASCII without tab/newline control codes, plus newline.
CHARACTERS = "".join(ch for ch in string.printable if ch not in "\t\r\x0b\x0c")
TINY_CHAT_TEMPLATE = (
    "{% if tools %}T:{% for tool in tools %}{{ tool['function']['name'] }};{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}<tool_response>{{ message['content'] }}</tool_response>{{ '\\n' }}"
    "{% else %}"
    "{% if message['role'] == 'system' %}S:{% elif message['role'] == 'user' %}U:{% else %}A:{% endif %}"
    "{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% else %}{{ '\\n' }}{% endif %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}A:{% endif %}"
)
"""The character tokenizer's minimal chat template (see `gcore_rl.data.chat`): ``S:`` / ``U:`` turns end
with a newline, ``A:`` turns with EOS, and the generation prompt is ``A:``; ``[system "add", user "1+2=", assistant "3"]`` renders as
``"S:add\\nU:1+2=\\nA:3<eos>"``. Short, so sequences stay within the tiny model's context. Tool use
(Hermes-like, tools by name only): with `tools` a first line ``T:name;name;\\n``, and a ``tool`` message as
``<tool_response>ANSWER</tool_response>\\n`` after the assistant turn that called it."""
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Tool-call markers that `init-tiny tool_tokens=true` makes single tokens (kept when decoding, so a parser reads them)."""
#: Size of the character tokenizer's vocabulary: the special tokens and one token per character.
TOKENIZER_SIZE = len(SPECIAL_TOKENS) + len(set(CHARACTERS))


@dataclass
class TinyModelConfig:
    """Shape of the tiny random model written by `gcore-rl init-tiny`."""

    hidden_size: int = field(default=128, metadata={"help": "Width of the residual stream."})
    num_layers: int = field(default=4, metadata={"help": "Number of decoder layers."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads (query)."})
    num_kv_heads: int = field(default=2, metadata={"help": "Key/value heads (grouped-query attention)."})
    intermediate_size: int = field(default=384, metadata={"help": "Hidden width of the MLP."})
    max_positions: int = field(default=256, metadata={"help": "Longest sequence the model accepts."})
    seed: int = field(default=0, metadata={"help": "Seed of the random initialisation."})
    arch: Literal["llama", "qwen2", "qwen2_vl"] = field(
        default="llama", metadata={"help": "Architecture: llama, qwen2 (biases on q/k/v, as in Qwen2/2.5), or qwen2_vl "
                                           "(a Qwen2-VL vision-language model: Qwen2 text stack, vision tower, M-RoPE; "
                                           "its image processor is written beside it)."})
    vision: TinyVisionConfig = field(default_factory=TinyVisionConfig, metadata={"help": "The vision tower and image size (arch qwen2_vl only)."})
    vocab_size: int = field(
        default=0, metadata={"help": "Rows of the embedding and LM head (0 = the tokenizer's size); larger values "
                                     "give a real model's shape, e.g. 151936 for Qwen2."})
    tool_tokens: bool = field(
        default=False, metadata={"help": "Add <tool_call>, </tool_call>, <tool_response> and </tool_response> to the "
                                         "tokenizer as single tokens (tool-using policies: shorter trajectories)."})

    def validate(self) -> None:
        for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_positions"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be at least 1, got {getattr(self, key)}")
        if self.hidden_size % self.num_heads:
            raise ConfigError("hidden_size", f"{self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
                              "every attention head gets hidden_size / num_heads dimensions")
        if (self.hidden_size // self.num_heads) % 2:
            raise ConfigError("hidden_size", f"hidden_size / num_heads = {self.hidden_size // self.num_heads} is odd; "
                              "rotary position embeddings need an even head dimension")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}; "
                              "grouped-query attention shares each key/value head among equally many query heads")
        if self.vocab_size and self.vocab_size < TOKENIZER_SIZE:
            raise ConfigError("vocab_size", f"{self.vocab_size} is smaller than the character tokenizer's "
                              f"{TOKENIZER_SIZE} tokens; use 0 (the tokenizer's size) or at least {TOKENIZER_SIZE}")


def build_char_tokenizer(extra_special: tuple[str, ...] = (), extra_tokens: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """Return a character-level fast tokenizer: one token per character of `CHARACTERS`.

    Ids 0, 1, 2 are `<pad>`, `<eos>`, `<unk>`; decoding concatenates characters without spaces.
    Its chat template is `TINY_CHAT_TEMPLATE`. `extra_special` tokens (a vision-language model's image
    slot markers) follow the characters and are skipped when decoding; `extra_tokens` (`TOOL_TOKENS`) come
    after them and are decoded like characters.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in CHARACTERS:
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(extra_special)})
    tokenizer.add_tokens(list(extra_tokens))  # ordinary added tokens: matched whole, and decoded
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(cfg: TinyModelConfig, vocab_size: int, pad_id: int, eos_id: int) -> PreTrainedModel:
    """Return a randomly initialised Llama (or Qwen2) causal LM of the given shape (fp32).

    `vocab_size` is the tokenizer's size; `cfg.vocab_size`, when larger, widens the embedding.
    """
    if cfg.vocab_size and cfg.vocab_size < vocab_size:
        raise ValueError(f"init-tiny: vocab_size={cfg.vocab_size} is smaller than the tokenizer's {vocab_size} tokens")
    text = dict(
        vocab_size=cfg.vocab_size or vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=pad_id,
        eos_token_id=eos_id,
        bos_token_id=None,
        torch_dtype="float32",
    )
    if cfg.arch == "qwen2_vl":
        raise ValueError("build_tiny_model: a qwen2_vl model needs its tokenizer; use write_tiny_model")
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if cfg.arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    torch.manual_seed(cfg.seed)
    return model_cls(config_cls(**text))


def write_tiny_model(out_dir: str | Path, cfg: TinyModelConfig | None = None) -> Path:
    """Write a tiny random model and its tokenizer to `out_dir` in Hugging Face format."""
    cfg = cfg or TinyModelConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.arch == "qwen2_vl":
        return _write_tiny_vlm(out, cfg)
    tokenizer = build_char_tokenizer(extra_tokens=TOOL_TOKENS if cfg.tool_tokens else ())
    model = build_tiny_model(cfg, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return save_model_dir(model, tokenizer, out)


def _write_tiny_vlm(out: Path, cfg: TinyModelConfig) -> Path:
    """A tiny random Qwen2-VL (text shape of `cfg`, vision tower of `cfg.vision`), its tokenizer (the
    character tokenizer plus the image slot tokens) and its image processor."""
    tokenizer = build_char_tokenizer(VISION_SPECIAL_TOKENS)
    text = dict(vocab_size=max(cfg.vocab_size, len(tokenizer)), hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                max_position_embeddings=cfg.max_positions, tie_word_embeddings=True,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    model = build_tiny_vlm(text, cfg.vision, tokenizer, cfg.seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    save_model_dir(model, tokenizer, out)
    build_tiny_image_processor(cfg.vision).save_pretrained(out)
    return out


def write_tiny_reward_model(out_dir: str | Path, cfg: TinyModelConfig | None = None) -> Path:
    """Write a tiny random scalar reward model (sequence classifier of `cfg.arch`, one label) and its tokenizer.

    The same body as `write_tiny_model` with a one-output `score` head in place of the LM head,
    loadable with `AutoModelForSequenceClassification` (see `gcore_rl.rewards.reward_model`).
    """
    cfg = cfg or TinyModelConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_char_tokenizer()
    config = build_tiny_model(cfg, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id).config
    config.num_labels = 1
    torch.manual_seed(cfg.seed)
    return save_model_dir(AutoModelForSequenceClassification.from_config(config), tokenizer, out)
