"""Text conditioning of a flow model: prompts → per-token states ``[B, L, D]`` and pooled vectors ``[B, P]``.

Which text parts a model folder holds decides how prompts are encoded (`load_text_conditioning`):

one encoder (the tiny models of `gcore-rl init-tiny-diffusion`)::

    text_encoder/  CLIPTextModelWithProjection     tokenizer/
    tokens [B, L, D]  last_hidden_state of the prompt and its EOS, right-padded to L and attention-masked
    pooled [B, P]     text_embeds (the projected EOS state)

SD3 release (text_encoder_2/ present; as diffusers' ``StableDiffusion3Pipeline.encode_prompt``, clip_skip None)::

    text_encoder/ CLIP-L, text_encoder_2/ CLIP-G (CLIPTextModelWithProjection), text_encoder_3/ T5EncoderModel
    (optional), tokenizer/, tokenizer_2/, tokenizer_3/
    tokens [B, Lc + Lt, Dt]  [CLIP-L ‖ CLIP-G penultimate hidden states, zero-padded from D_L + D_G to Dt]
                             followed along the sequence by T5's last_hidden_state (zeros without text_encoder_3/;
                             Dt = the transformer's joint_attention_dim)
    pooled [B, P_L + P_G]    CLIP-L's text_embeds ‖ CLIP-G's

FLUX release (text_encoder_2/ present; as ``FluxPipeline.encode_prompt``)::

    text_encoder/ CLIPTextModel, text_encoder_2/ T5EncoderModel, tokenizer/, tokenizer_2/
    tokens [B, Lt, Dt]  T5's last_hidden_state
    pooled [B, H]       CLIP's pooler_output (its final EOS state)

In the release layouts Lc is tokenizer/'s ``model_max_length`` (77 for the real CLIP tokenizers) and Lt
the T5 ``max_sequence_length``: `load_flow_model`'s `text_tokens`, else ``model_index.json``'s
``max_sequence_length`` (the tiny folders write one), else the pipelines' default (SD3 256, FLUX 512).
Release prompts are tokenized as the pipelines do: with the tokenizer's special tokens, padded to the
length, longer ones cut (not refused), no attention mask. Every layout pads every prompt to the same
length, so a prompt's conditioning does not depend on its batch and is cached per prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from gcore_rl.errors import DataError, ModelLoadError
from gcore_rl.models.tiny import EOS_TOKEN, TOKENIZER_SIZE, build_char_tokenizer

PIPELINE_SEQUENCE_LENGTH = {"sd3": 256, "flux": 512}
"""T5 tokens per prompt when neither the caller nor model_index.json says (diffusers' encode_prompt defaults)."""

CLIP_TYPES = ("clip_text_model", "clip")
T5_TYPES = ("t5",)


@dataclass
class TextCondition:
    """Text conditioning of a batch: per-token states ``[B, L, D]`` and pooled vectors ``[B, P]``."""

    tokens: Tensor
    pooled: Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, index: Tensor | list[int]) -> TextCondition:
        return TextCondition(self.tokens[index], self.pooled[index])

    def to(self, device: torch.device) -> TextCondition:
        return TextCondition(self.tokens.to(device), self.pooled.to(device))

    def repeat(self, n: int) -> TextCondition:
        """Each row n times in a row (a prompt's group of n images)."""
        return TextCondition(self.tokens.repeat_interleave(n, dim=0), self.pooled.repeat_interleave(n, dim=0))

    @staticmethod
    def cat(parts: list[TextCondition]) -> TextCondition:
        return TextCondition(torch.cat([p.tokens for p in parts]), torch.cat([p.pooled for p in parts]))


class PromptEncoder:
    """Prompts → `TextCondition` with frozen encoders; each distinct prompt is encoded once and cached."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[Tensor, Tensor]] = {}

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """tokens ``[n, L, D]`` and pooled ``[n, P]`` of `prompts` (a row must not depend on the other prompts)."""
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> TextCondition:
        for prompt in dict.fromkeys(prompts):
            if prompt not in self._cache:
                # one at a time: a batch's GEMMs may round a row differently by batch size, and the cache's
                # contents must not depend on which prompts came first (a resumed run starts with none)
                tokens, pooled = self.encode([prompt])
                self._cache[prompt] = (tokens[0], pooled[0])
        return TextCondition(torch.stack([self._cache[p][0] for p in prompts]),
                             torch.stack([self._cache[p][1] for p in prompts]))


class TextEncoder(PromptEncoder):
    """The one-encoder layout: prompts are tokenized without special tokens, end with the tokenizer's EOS
    (whose projected state is the pooled vector) and are right-padded to `max_tokens`."""

    def __init__(self, model: nn.Module, tokenizer, max_tokens: int):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens

    def token_ids(self, prompt: str) -> list[int]:
        ids = self.tokenizer.encode(prompt, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        if len(ids) > self.max_tokens:
            raise DataError(f"prompt {prompt!r} has {len(ids)} tokens with its EOS; the text encoder "
                            f"takes at most {self.max_tokens} (its max_position_embeddings): shorten the prompt")
        return ids + [self.tokenizer.pad_token_id] * (self.max_tokens - len(ids))

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        ids = torch.tensor([self.token_ids(p) for p in prompts])
        out = self.model(input_ids=ids, attention_mask=(ids != self.tokenizer.pad_token_id).long())
        return out.last_hidden_state, out.text_embeds


@dataclass
class FrozenTextModel:
    """One text encoder of a release folder and its tokenizer."""

    model: nn.Module
    tokenizer: object

    def __post_init__(self) -> None:
        self.model.eval().requires_grad_(False)

    def ids(self, prompts: list[str], length: int) -> Tensor:
        """``[n, length]`` token ids as diffusers' pipelines make them: special tokens added, padded, longer prompts cut."""
        return self.tokenizer(prompts, padding="max_length", max_length=length, truncation=True,
                              return_tensors="pt").input_ids


class SD3TextEncoders(PromptEncoder):
    """SD3's conditioning from CLIP-L, CLIP-G and (optionally) T5; shapes in the module docstring."""

    def __init__(self, clip_l: FrozenTextModel, clip_g: FrozenTextModel, t5: FrozenTextModel | None,
                 clip_tokens: int, t5_tokens: int, joint_dim: int):
        super().__init__()
        self.clip_l, self.clip_g, self.t5 = clip_l, clip_g, t5
        self.clip_tokens, self.t5_tokens, self.joint_dim = clip_tokens, t5_tokens, joint_dim

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        states, pooled = [], []
        for clip in (self.clip_l, self.clip_g):  # both padded to tokenizer/'s length, as the pipeline does
            out = clip.model(clip.ids(prompts, self.clip_tokens), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out.text_embeds)
        clip_states = torch.cat(states, dim=-1)  # [n, Lc, D_L + D_G]
        if self.t5 is not None:
            t5_states = self.t5.model(self.t5.ids(prompts, self.t5_tokens)).last_hidden_state  # [n, Lt, Dt]
        else:
            t5_states = clip_states.new_zeros(len(prompts), self.t5_tokens, self.joint_dim)
        clip_states = nn.functional.pad(clip_states, (0, t5_states.shape[-1] - clip_states.shape[-1]))
        return torch.cat([clip_states, t5_states], dim=1), torch.cat(pooled, dim=-1)


class FluxTextEncoders(PromptEncoder):
    """FLUX's conditioning: T5's states as the text stream, CLIP's pooled output as the pooled vector."""

    def __init__(self, clip: FrozenTextModel, t5: FrozenTextModel, clip_tokens: int, t5_tokens: int):
        super().__init__()
        self.clip, self.t5, self.clip_tokens, self.t5_tokens = clip, t5, clip_tokens, t5_tokens

    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        pooled = self.clip.model(self.clip.ids(prompts, self.clip_tokens)).pooler_output  # [n, H]
        return self.t5.model(self.t5.ids(prompts, self.t5_tokens)).last_hidden_state, pooled


def load_text_conditioning(root: Path, transformer_config, arch: str, text_tokens: int | None) -> PromptEncoder:
    """The prompt encoder of the folder `root` (layouts in the module docstring) for a transformer with
    `transformer_config`; ModelLoadError names the part that is missing or does not fit."""
    if not (root / "text_encoder_2").is_dir():
        return _load_one_encoder(root, transformer_config, text_tokens)
    t5_tokens = text_tokens or int(_model_index(root).get("max_sequence_length") or PIPELINE_SEQUENCE_LENGTH[arch])
    if arch == "sd3":
        return _load_sd3(root, transformer_config, t5_tokens)
    return _load_flux(root, transformer_config, t5_tokens)


def _load_one_encoder(root: Path, config, text_tokens: int | None) -> TextEncoder:
    from transformers import CLIPTextModelWithProjection

    declared = _model_index(root).get("text_encoder_2")
    declared = declared[-1] if isinstance(declared, list) else declared
    if declared:
        raise ModelLoadError(f"'{root}' lists text_encoder_2 (a {declared}) in model_index.json but has no text_encoder_2/ "
                             "folder: an SD3/FLUX release builds the transformer's text stream from all of its text "
                             "encoders; copy the missing part into the folder")
    model = _load_part(CLIPTextModelWithProjection, root / "text_encoder")
    tokenizer = _load_tokenizer(root / "tokenizer")
    width, pooled = model.config.hidden_size, model.config.projection_dim
    if (width, pooled) != (config.joint_attention_dim, config.pooled_projection_dim):
        raise ModelLoadError(f"the text encoder at '{root / 'text_encoder'}' gives {width}-wide states and {pooled}-wide "
                             f"pooled vectors but the transformer expects joint_attention_dim={config.joint_attention_dim} "
                             f"and pooled_projection_dim={config.pooled_projection_dim}; a folder with one text encoder "
                             "must match both, and an SD3/FLUX release also needs text_encoder_2/ and tokenizer_2/ "
                             "(SD3: text_encoder_3/ and tokenizer_3/ too, or neither), which this folder lacks")
    return TextEncoder(model, tokenizer, text_tokens or model.config.max_position_embeddings)


def _load_sd3(root: Path, config, t5_tokens: int) -> SD3TextEncoders:
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    clip_l = _frozen(root, 1, CLIPTextModelWithProjection, CLIP_TYPES, "sd3")
    clip_g = _frozen(root, 2, CLIPTextModelWithProjection, CLIP_TYPES, "sd3")
    has_t5 = (root / "text_encoder_3").is_dir() or (root / "tokenizer_3").is_dir()
    t5 = _frozen(root, 3, T5EncoderModel, T5_TYPES, "sd3") if has_t5 else None
    if t5 is not None:
        _check_width(root, "text_encoder_3/ (T5) gives states", t5.model.config.d_model, "joint_attention_dim",
                     config.joint_attention_dim)
    clip_widths = [clip.model.config.hidden_size for clip in (clip_l, clip_g)]
    if sum(clip_widths) > config.joint_attention_dim:
        raise ModelLoadError(f"in '{root}' the states of text_encoder/ ({clip_widths[0]} wide) and text_encoder_2/ "
                             f"({clip_widths[1]} wide) side by side are {sum(clip_widths)} wide, more than the "
                             f"transformer's joint_attention_dim={config.joint_attention_dim} (SD3 zero-pads them to "
                             "the T5 width); the text encoders do not belong to this transformer")
    pooled = [clip.model.config.projection_dim for clip in (clip_l, clip_g)]
    _check_width(root, f"text_encoder/ and text_encoder_2/ give pooled vectors of {pooled[0]} + {pooled[1]}, together",
                 sum(pooled), "pooled_projection_dim", config.pooled_projection_dim)
    return SD3TextEncoders(clip_l, clip_g, t5, _clip_tokens(root, clip_l, clip_g), t5_tokens, config.joint_attention_dim)


def _load_flux(root: Path, config, t5_tokens: int) -> FluxTextEncoders:
    from transformers import CLIPTextModel, T5EncoderModel

    clip = _frozen(root, 1, CLIPTextModel, CLIP_TYPES, "flux")
    t5 = _frozen(root, 2, T5EncoderModel, T5_TYPES, "flux")
    _check_width(root, "text_encoder/ (CLIP) gives pooled vectors", clip.model.config.hidden_size,
                 "pooled_projection_dim", config.pooled_projection_dim)
    _check_width(root, "text_encoder_2/ (T5) gives states", t5.model.config.d_model, "joint_attention_dim",
                 config.joint_attention_dim)
    return FluxTextEncoders(clip, t5, _clip_tokens(root, clip), t5_tokens)


def _frozen(root: Path, number: int, model_class, model_types: tuple[str, ...], arch: str) -> FrozenTextModel:
    """text_encoder{_n}/ and tokenizer{_n}/ of a release folder, after checking both are there and the model's type."""
    suffix = "" if number == 1 else f"_{number}"
    encoder, tokenizer = root / f"text_encoder{suffix}", root / f"tokenizer{suffix}"
    missing = [f"{part.name}/" for part in (encoder, tokenizer) if not part.is_dir()]
    if missing:
        raise ModelLoadError(f"'{root}' is laid out as an {arch.upper()} release (it has text_encoder_2/) but lacks "
                             f"{' and '.join(missing)}: each text encoder of the release needs its folder and its "
                             "tokenizer's folder")
    model_type = read_json(encoder / "config.json").get("model_type")
    if model_type not in model_types:
        raise ModelLoadError(f"'{encoder}' holds a {model_type!r} model; an {arch.upper()} release has a "
                             f"{model_class.__name__} (model_type {' or '.join(model_types)}) there")
    return FrozenTextModel(_load_part(model_class, encoder), _load_tokenizer(tokenizer))


def _clip_tokens(root: Path, *clips: FrozenTextModel) -> int:
    """The CLIP prompt length of a release: tokenizer/'s model_max_length, which every CLIP must have positions for."""
    length = clips[0].tokenizer.model_max_length
    positions = min(clip.model.config.max_position_embeddings for clip in clips)
    if length > positions:
        raise ModelLoadError(f"'{root / 'tokenizer'}' pads prompts to model_max_length={length} tokens but the CLIP text "
                             f"encoders of '{root}' have {positions} positions; set model_max_length in "
                             f"tokenizer/tokenizer_config.json to at most {positions}")
    return length


def _check_width(root: Path, what: str, width: int, key: str, expected: int) -> None:
    if width != expected:
        raise ModelLoadError(f"in '{root}' {what} {width} wide, but the transformer expects {key}={expected}; "
                             "the text encoders do not belong to this transformer")


def _load_part(model_class, folder: Path) -> nn.Module:
    try:
        return model_class.from_pretrained(folder, dtype=torch.float32)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load '{folder}' as a {model_class.__name__}: {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


def _load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer at '{folder}': {type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''}") from exc


def _model_index(root: Path) -> dict:
    return read_json(root / "model_index.json") if (root / "model_index.json").is_file() else {}


def read_json(path: Path) -> dict:
    """The JSON object in `path`; ModelLoadError naming the file if it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read '{path}': {exc}") from exc


RELEASE_TEXT_PARTS = {
    "sd3": {"text_encoder": "CLIPTextModelWithProjection", "text_encoder_2": "CLIPTextModelWithProjection",
            "text_encoder_3": "T5EncoderModel"},
    "flux": {"text_encoder": "CLIPTextModel", "text_encoder_2": "T5EncoderModel"},
}
"""The text encoders of each architecture's release layout, by folder, with their transformers class."""


def tiny_widths(arch: str, layout: str, hidden: int) -> dict[str, int]:
    """Widths of the tiny text encoders of `layout` (one encoder of width `hidden`, or a release in the
    proportions of the real ones: CLIP-L `hidden`, CLIP-G 2·`hidden`, T5 4·`hidden`) and the transformer's
    ``joint_attention_dim`` and ``pooled_projection_dim`` that fit them."""
    if layout == "one":
        return {"text_encoder": hidden, "joint_attention_dim": hidden, "pooled_projection_dim": hidden}
    if arch == "sd3":
        return {"text_encoder": hidden, "text_encoder_2": 2 * hidden, "text_encoder_3": 4 * hidden,
                "joint_attention_dim": 4 * hidden, "pooled_projection_dim": 3 * hidden}
    return {"text_encoder": hidden, "text_encoder_2": 4 * hidden, "joint_attention_dim": 4 * hidden,
            "pooled_projection_dim": hidden}


def write_tiny_text_parts(out: Path, arch: str, layout: str, hidden: int, layers: int, tokens: int) -> None:
    """Write random text encoders (`layers` layers, `tokens` positions, widths from `tiny_widths`) and their
    character tokenizers: `layout` "one" (text_encoder/, tokenizer/) or "release" (`RELEASE_TEXT_PARTS`)."""
    import transformers

    widths = tiny_widths(arch, layout, hidden)
    if layout == "one":
        tokenizer = tiny_tokenizer(None)
        transformers.CLIPTextModelWithProjection(_clip_config(hidden, layers, tokens, tokenizer)).save_pretrained(
            out / "text_encoder")
        tokenizer.save_pretrained(out / "tokenizer")
        return
    tokenizer = tiny_tokenizer(tokens)
    for part, class_name in RELEASE_TEXT_PARTS[arch].items():
        width = widths[part]
        config = (_t5_config(width, layers, tokenizer) if class_name == "T5EncoderModel"
                  else _clip_config(width, layers, tokens, tokenizer))
        getattr(transformers, class_name)(config).save_pretrained(out / part)
        tokenizer.save_pretrained(out / part.replace("text_encoder", "tokenizer"))


def tiny_tokenizer(tokens: int | None):
    """The project's character tokenizer, right-padded. With `tokens` (release layouts) it pads to that
    length by default and appends EOS as its special token, as the real CLIP and T5 tokenizers end a
    prompt (CLIP pools the EOS state)."""
    from tokenizers import processors

    tokenizer = build_char_tokenizer()
    tokenizer.padding_side = "right"
    if tokens is not None:
        tokenizer.model_max_length = tokens
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"$A {EOS_TOKEN}", special_tokens=[(EOS_TOKEN, tokenizer.eos_token_id)])
    return tokenizer


def _clip_config(width: int, layers: int, tokens: int, tokenizer):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=TOKENIZER_SIZE, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=layers,
        num_attention_heads=2, max_position_embeddings=tokens, projection_dim=width, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id)


def _t5_config(width: int, layers: int, tokenizer):
    from transformers import T5Config

    return T5Config(
        vocab_size=TOKENIZER_SIZE, d_model=width, d_kv=width // 2, d_ff=2 * width, num_layers=layers, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=32, feed_forward_proj="gated-gelu",
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
