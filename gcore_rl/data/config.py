"""Configuration of the prompt data source."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gcore_rl.data.chat import check_chat_template_option
from gcore_rl.data.indexed import check_indexed_task, is_indexed_task
from gcore_rl.data.tasks import TASKS
from gcore_rl.errors import ConfigError, DataError

SUPPORTED_SUFFIXES: dict[str, str] = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
"""File suffix → `datasets` builder name used to read a prompt file."""

OverlongPolicy = Literal["error", "truncate", "drop"]
"""What an RL job does with a prompt too long for the policy's context (see `gcore_rl.data.lengths`)."""


@dataclass
class DataConfig:
    """Where training prompts come from: a built-in synthetic task or a JSONL/Parquet file."""

    task: str | None = field(
        default="addition",
        metadata={"help": "Synthetic task to generate rows from: a built-in one (addition, addition_chat, reversal, judge_addition, addition_preferences, shapes_vqa, shapes_preferences, judge_shapes; gcore_rl/data/tasks.py) or reasoning_gym:NAME (a reasoning-gym generator, the tasks extra; its scorer is then the default reward); null to read `path` instead."},
    )
    path: str | None = field(
        default=None,
        metadata={"help": "JSONL (.jsonl/.json) or Parquet (.parquet) file of prompt rows, or a folder written by "
                          "Hugging Face datasets' save_to_disk, used when `task` is null."},
    )
    prompt_field: str = field(default="prompt", metadata={"help": "Column holding the prompt text."})
    messages_field: str = field(
        default="messages",
        metadata={"help": "Column holding a conversation (list of {role: system|user|assistant, content}); a file "
                          "with it is chat-format and rendered with the chat template (see gcore_rl/data/chat.py)."},
    )
    chat_template: str | None = field(
        default=None,
        metadata={"help": "Chat template for chat-format rows: Jinja text or the path of a .jinja file "
                          "(null: the tokenizer's own)."},
    )
    answer_field: str | None = field(
        default="answer",
        metadata={"help": "Column holding the reference answer passed to rewards as `answer` (null: no answer column)."},
    )
    num_prompts: int = field(default=2000, metadata={"help": "Synthetic tasks only: number of training rows generated."})
    task_options: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "Options of the synthetic task, e.g. {digits: 3} for addition, {min_len: 2, max_len: 6} for reversal, or a reasoning-gym generator's config keys (plus chat: 1 for conversation rows)."},
    )
    eval_prompts: int = field(
        default=200,
        metadata={"help": "Synthetic tasks only: held-out rows (generated with a different seed) used for accuracy evaluation."},
    )
    payload_image_size: int = field(
        default=0,
        metadata={"help": "Synthetic tasks only: attach a random 3×S×S uint8 `image` to every row (S = this value; 0 = none), a per-sample payload for data-plane tests and benchmarks."},
    )
    images_field: str = field(
        default="images",
        metadata={"help": "Column holding each row's images: a list of paths (relative to the data file's folder, or "
                          "absolute), of encoded image bytes, or of {bytes, path} structs as datasets.Image stores them. "
                          "The prompt has one <image> placeholder per image, in order (a chat row: one {type: image} "
                          "content part per image). Rows get them as RGB PIL images in `images`."},
    )
    max_image_pixels: int = field(
        default=4096 * 4096,
        metadata={"help": "Most pixels (width × height) one image of a row may have; a larger one stops the job before "
                          "the first step, naming the row and the file."},
    )
    shuffle: bool = field(default=True, metadata={"help": "Visit prompts in a fresh random order every epoch."})
    seed: int = field(default=0, metadata={"help": "Seed for synthetic generation and the per-epoch shuffle."})

    def validate(self) -> None:
        if (self.task is None) == (self.path is None):
            raise ConfigError("task", "set exactly one of `task` (built-in synthetic task) or `path` (prompt file)")
        if is_indexed_task(self.task):
            try:
                check_indexed_task(self.task, self.task_options)
            except DataError as exc:
                raise ConfigError("task", str(exc)) from exc
        elif self.task is not None and self.task not in TASKS:
            raise ConfigError("task", f"unknown task `{self.task}`; available tasks: {', '.join(sorted(TASKS))} "
                              f", reasoning_gym:NAME and textarena:ID")
        if self.path is not None:
            suffix = Path(self.path).suffix.lower()
            if suffix not in SUPPORTED_SUFFIXES and not Path(self.path).expanduser().is_dir():
                raise ConfigError(
                    "path",
                    f"unsupported file type `{suffix or '(none)'}` for {self.path}; "
                    f"use one of {', '.join(SUPPORTED_SUFFIXES)}, or a folder written by datasets' save_to_disk",
                )
        if not self.messages_field:
            raise ConfigError("messages_field", "must be a non-empty column name")
        check_chat_template_option(self.chat_template)
        if not self.images_field:
            raise ConfigError("images_field", "must be a non-empty column name")
        if self.max_image_pixels < 1:
            raise ConfigError("max_image_pixels", f"must be >= 1, got {self.max_image_pixels}")
        if not self.prompt_field:
            raise ConfigError("prompt_field", "must be a non-empty column name")
        if self.answer_field is not None and not self.answer_field:
            raise ConfigError("answer_field", "must be a non-empty column name or null")
        if self.num_prompts <= 0:
            raise ConfigError("num_prompts", f"must be > 0, got {self.num_prompts}")
        if self.payload_image_size < 0:
            raise ConfigError("payload_image_size", f"must be >= 0, got {self.payload_image_size}")
        if self.eval_prompts < 0:
            raise ConfigError("eval_prompts", f"must be >= 0, got {self.eval_prompts}")

    def source_name(self) -> str:
        """The prompt source as messages name it: ``prompt file PATH`` or ``synthetic task 'NAME'``."""
        return f"prompt file {self.path}" if self.task is None else f"synthetic task '{self.task}'"


@dataclass
class RolloutDataConfig(DataConfig):
    """Prompts of an RL job: a `DataConfig`, plus what to do with prompts too long for the policy."""

    overlong_prompts: OverlongPolicy = field(
        default="error",
        metadata={"help": "A prompt whose tokens plus sampling.max_new_tokens exceed the policy's context "
                          "(max_position_embeddings in its config.json), checked on every row before the first step: "
                          "'error' stops the job naming the row; 'truncate' keeps the prompt's last tokens; 'drop' "
                          "leaves the row out. Truncated and dropped rows (training and held-out) are counted in "
                          "data/prompts_truncated and data/prompts_dropped."},
    )
