"""Prompt rows with images: JSONL paths, Parquet bytes, `datasets.Image` folders and chat image parts load as
RGB PIL images for a shard's own rows only; every bad image is a DataError naming the file and the global row
before the first step; the synthetic `shapes_vqa` task is deterministic and survives `write-task`."""

from __future__ import annotations

import io
import json
import tempfile

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from gcore_rl.cli import main
from gcore_rl.data import images as image_module
from gcore_rl.data import lengths, tasks
from gcore_rl.data.config import DataConfig, RolloutDataConfig
from gcore_rl.data.lengths import PromptRoom, load_fitted_shard
from gcore_rl.data.prompts import PromptEncoder, policy_prompt_encoder
from gcore_rl.data.sources import load_eval_rows, load_prompt_rows
from gcore_rl.data.tasks import image_folder, make_task_rows, write_task_jsonl
from gcore_rl.errors import DataError
from gcore_rl.models.loading import load_tokenizer
from gcore_rl.models.tiny import TinyModelConfig, build_char_tokenizer, write_tiny_model
from gcore_rl.models.vision import TinyVisionConfig
from gcore_rl.records import VisionPrompt
from gcore_rl.rewards.image import PALETTE

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "yellow": (255, 255, 0)}


@pytest.fixture(autouse=True)
def private_temp_dir(tmp_path, monkeypatch):
    """Keep the Arrow cache of prompt files (under the temp dir) inside this test's tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory) -> PromptEncoder:
    """The tiny Qwen2-VL's prompt encoder (16-pixel images: 4 image tokens, plus the two slot markers)."""
    cfg = TinyModelConfig(arch="qwen2_vl", hidden_size=64, num_layers=2, intermediate_size=128,
                          vision=TinyVisionConfig(image_size=16))
    path = write_tiny_model(tmp_path_factory.mktemp("vlm") / "tiny-vl", cfg)
    return policy_prompt_encoder(str(path), load_tokenizer(str(path)))


def png(colour: str, size: int = 16) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (size, size), COLOURS[colour]).save(buffer, format="PNG")
    return buffer.getvalue()


def pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def colour_rows(tmp_path, colours=("red", "green", "blue", "yellow", "red")) -> list[dict]:
    """JSONL rows naming PNG files in tmp_path/img by relative path (one image a row)."""
    (tmp_path / "img").mkdir(exist_ok=True)
    rows = []
    for index, colour in enumerate(colours):
        (tmp_path / "img" / f"{index}.png").write_bytes(png(colour))
        rows.append({"prompt": "<image>colour?", "answer": colour, "images": [f"img/{index}.png"]})
    return rows


def test_jsonl_paths_relative_to_the_file_load_as_rgb_images_of_owned_rows_only(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "rows.jsonl", colour_rows(tmp_path))
    opened = []
    original = image_module._open_image
    monkeypatch.setattr(image_module, "_open_image", lambda source, *a: opened.append(str(source)) or original(source, *a))
    rows = load_prompt_rows(DataConfig(task=None, path=str(path)), 1, 2)
    assert [row["answer"] for row in rows] == ["green", "yellow"]  # global rows 1 and 3
    assert opened == [str(tmp_path / "img" / "1.png"), str(tmp_path / "img" / "3.png")]  # no other row decoded
    for row in rows:
        [image] = row["images"]
        assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (16, 16)
        assert (pixels(image) == COLOURS[row["answer"]]).all()
        assert row["prompt"] == "<image>colour?"


def test_parquet_bytes_structs_and_a_renamed_column_give_the_same_rows(tmp_path):
    table = [{"prompt": "<image>and<image>", "answer": "x", "pictures": [png("red"), png("blue")]},
             {"prompt": "no image", "answer": "y", "pictures": []}]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "bytes.parquet")
    features = datasets.Features({"prompt": datasets.Value("string"), "answer": datasets.Value("string"),
                                  "pictures": datasets.Sequence(datasets.Image())})
    structs = datasets.Dataset.from_dict({key: [row[key] for row in table] for key in table[0]}, features=features)
    structs.save_to_disk(str(tmp_path / "saved"))  # {bytes, path} structs, the datasets.Image layout
    for name in ("bytes.parquet", "saved"):
        rows = load_prompt_rows(DataConfig(task=None, path=str(tmp_path / name), images_field="pictures"))
        assert "pictures" not in rows[0] and [pixels(im)[0, 0].tolist() for im in rows[0]["images"]] == \
            [[255, 0, 0], [0, 0, 255]], name
        assert rows[1] == {"prompt": "no image", "answer": "y"}, name  # a row without images is a text row


def test_chat_rows_with_image_parts_render_placeholders_and_encode_with_their_images(tmp_path, vlm):
    (tmp_path / "a.png").write_bytes(png("green"))
    user = [{"type": "image"}, {"type": "text", "text": "colour?"}]
    row = {"messages": [{"role": "system", "content": [{"type": "text", "text": "Look."}]},
                        {"role": "user", "content": user},
                        {"role": "assistant", "content": [{"type": "text", "text": "green"}]}],
           "images": ["a.png"]}
    path = write_jsonl(tmp_path / "chat.jsonl", [row, row])
    data = RolloutDataConfig(task=None, path=str(path))
    fitted = load_fitted_shard(data, vlm, PromptRoom(positions=256, max_new_tokens=8, model_path="m"), 0, 1)
    for fitted_row in fitted.rows:
        assert fitted_row["prompt"] == "S:Look.\nU:<image>colour?\nA:" and fitted_row["answer"] == "green"
        encoded = vlm(fitted_row)
        assert isinstance(encoded, VisionPrompt) and encoded.images.count == 1
        assert (pixels(fitted_row["images"][0]) == COLOURS["green"]).all()


def load_error(tmp_path, rows, **options) -> str:
    """The DataError message of loading `rows` (as JSONL in tmp_path) on shard 1 of 2 (the row at fault is global row 3)."""
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as info:
        load_prompt_rows(DataConfig(task=None, path=str(path), **options), 1, 2)
    assert f"prompt file {path}, row 3" in str(info.value)
    return str(info.value)


def test_a_missing_image_file_names_the_row_and_the_path(tmp_path):
    rows = colour_rows(tmp_path)
    rows[3]["images"] = ["img/gone.png"]
    assert f"image 0 is the file {tmp_path / 'img' / 'gone.png'}, which does not exist" in load_error(tmp_path, rows)


def test_corrupt_bytes_name_the_row_and_for_a_path_the_file(tmp_path):
    rows = colour_rows(tmp_path)
    (tmp_path / "img" / "3.png").write_bytes(png("red")[:40])  # a cut-off PNG: the header reads, the pixels do not
    assert f"file {tmp_path / 'img' / '3.png'} cannot be decoded as an image" in load_error(tmp_path, rows)
    table = [{"prompt": "<image>", "answer": "x", "images": [png("red")]} for _ in range(4)]
    table[3]["images"] = [b"not an image at all"]
    pq.write_table(pa.Table.from_pylist(table), tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=rf"prompt file {tmp_path / 'bad.parquet'}, row 3: image 0 \(19 bytes\) "
                                        "cannot be decoded as an image"):
        load_prompt_rows(DataConfig(task=None, path=str(tmp_path / "bad.parquet")), 1, 2)


@pytest.mark.parametrize(("prompt", "placeholders"), [("<image><image>colour?", 2), ("colour?", 0)])
def test_placeholders_that_do_not_pair_with_images_are_found_on_every_shard(tmp_path, prompt, placeholders):
    rows = colour_rows(tmp_path)
    rows[3]["prompt"] = prompt
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    for shard in range(2):  # counted on the whole file: the shard that does not own row 3 reports it as well
        with pytest.raises(DataError, match=rf"prompt file {path}, row 3: the prompt has {placeholders} <image> "
                                            "placeholders but the row has 1 image;"):
            load_prompt_rows(DataConfig(task=None, path=str(path)), shard, 2)


def test_chat_image_parts_that_do_not_pair_with_images_and_images_in_replies_are_refused(tmp_path):
    def chat(user, reply="red", images=("a.png",)):
        return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}],
                "images": list(images)}

    good = chat([{"type": "image"}, {"type": "text", "text": "colour?"}])
    extra = chat([{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}])
    assert "the prompt has 2 image parts in its `messages` but the row has 1 image;" in \
        load_error(tmp_path, [good, good, good, extra])
    in_reply = chat([{"type": "text", "text": "?"}], reply=[{"type": "image"}], images=())
    assert "turn 1 of `messages` (assistant) has an image in content part 0" in \
        load_error(tmp_path, [good, good, good, in_reply])


def test_an_image_over_max_image_pixels_or_a_decompression_bomb_is_refused(tmp_path, monkeypatch):
    rows = colour_rows(tmp_path)
    (tmp_path / "img" / "3.png").write_bytes(png("red", size=20))
    message = load_error(tmp_path, rows, max_image_pixels=300)
    assert f"image 0, file {tmp_path / 'img' / '3.png'} is 20×20 = 400 pixels, more than data.max_image_pixels=300" in message
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 150)  # PIL refuses images over twice this
    assert "refused by PIL as a possible decompression bomb" in load_error(tmp_path, rows)


def test_a_prompt_too_long_with_its_image_tokens_is_an_error_or_dropped_never_truncated(tmp_path, vlm):
    path = write_jsonl(tmp_path / "rows.jsonl", colour_rows(tmp_path))  # "<image>colour?": 6 image + 7 text tokens
    room = PromptRoom(positions=18, max_new_tokens=6, model_path="m")  # 12 prompt tokens fit
    for policy, match in [("error", r"row 1: the prompt has 13 tokens \(its 1 image\(s\) included\) but only 12 fit"),
                          ("truncate", "never shortens a prompt with images.*data.overlong_prompts=drop")]:
        with pytest.raises(DataError, match=match):
            load_fitted_shard(RolloutDataConfig(task=None, path=str(path), overlong_prompts=policy), vlm, room, 1, 2)
    dropped = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "short", "answer": "a"}, *colour_rows(tmp_path)[:1]])
    fitted = load_fitted_shard(RolloutDataConfig(task=None, path=str(dropped), overlong_prompts="drop"), vlm, room, 0, 1)
    assert fitted.rows == [{"prompt": "short", "answer": "a"}] and fitted.metrics["data/prompts_dropped"] == 1.0
    roomy = PromptRoom(positions=19, max_new_tokens=6, model_path="m")
    assert len(load_fitted_shard(RolloutDataConfig(task=None, path=str(path)), vlm, roomy, 0, 1).rows) == 5  # 13 tokens fit exactly


def test_a_text_only_policy_given_images_fails_before_step_one_for_training_and_held_out_rows(monkeypatch):
    text_only = PromptEncoder(build_char_tokenizer())
    room = PromptRoom(positions=None, max_new_tokens=4, model_path="m")  # no limit: the rows are checked all the same
    data = RolloutDataConfig(task="shapes_vqa", num_prompts=4, eval_prompts=4)
    with pytest.raises(DataError, match="synthetic task 'shapes_vqa', row 1 has 1 image but the policy is a text-only"):
        load_fitted_shard(data, text_only, room, 1, 2)
    monkeypatch.setattr(lengths, "load_prompt_rows", lambda *_: [{"prompt": "x", "answer": "y"}])  # text training rows
    with pytest.raises(DataError, match="the held-out rows of synthetic task 'shapes_vqa', row 1 has 1 image "):
        load_fitted_shard(data, text_only, room, 1, 2)


def test_shapes_vqa_is_deterministic_and_answerable_from_the_image_alone():
    def drawn(seed, **options):
        return load_prompt_rows(DataConfig(task="shapes_vqa", num_prompts=40, seed=seed, task_options=options))

    rows = drawn(3, questions=2)
    again, other = drawn(3, questions=2), drawn(4, questions=2)
    assert [pixels(row["images"][0]).tobytes() for row in rows] == [pixels(row["images"][0]).tobytes() for row in again]
    assert [pixels(row["images"][0]).tobytes() for row in rows] != [pixels(row["images"][0]).tobytes() for row in other]
    assert {row["question"] for row in rows} == {"colour", "count"} and {row["count"] for row in rows} == {1, 2, 3}
    for row in rows:
        image = pixels(row["images"][0])
        assert image.shape == (32, 32, 3) and row["prompt"] == f"<image>{row['question']}?" and "scene" not in row
        lit = image.any(axis=-1)
        assert (image[lit] == np.round(np.asarray(PALETTE[row["colour"]]) * 255)).all()  # one colour: the answer's
        quadrants = [lit[r:r + 16, c:c + 16].any() for r in (0, 16) for c in (0, 16)]
        assert sum(quadrants) == row["count"]  # one shape a quadrant, so the count is on the image
        assert row["answer"] == (row["colour"] if row["question"] == "colour" else str(row["count"]))
    assert {row["question"] for row in drawn(3)} == {"colour"} and {row["question"] for row in drawn(3, questions=1)} == {"count"}
    assert pixels(drawn(3, size=16)[0]["images"][0]).shape == (16, 16, 3)
    with pytest.raises(DataError, match="questions"):
        make_task_rows("shapes_vqa", 2, seed=0, questions=3)


def test_task_images_are_drawn_for_owned_training_and_held_out_rows_only(monkeypatch):
    drawn = []
    original = tasks.draw_scene
    monkeypatch.setattr(tasks, "draw_scene", lambda scene, colour: drawn.append(scene) or original(scene, colour))
    data = DataConfig(task="shapes_vqa", num_prompts=10, eval_prompts=6)
    rows, held_out = load_prompt_rows(data, 1, 3), load_eval_rows(data, 1, 3)
    assert (len(rows), len(held_out), len(drawn)) == (3, 2, 5)
    assert all(len(row["images"]) == 1 for row in [*rows, *held_out])
    assert [row["answer"] for row in held_out] == [row["answer"] for row in load_eval_rows(data)[1::3]]


def test_write_task_round_trip_gives_the_same_prompts_answers_and_pixels(tmp_path, vlm):
    out = tmp_path / "shapes.jsonl"
    assert main(["write-task", "shapes_vqa", str(out), "rows=7", "seed=5", "questions=2"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[2]["images"] == ["shapes-images/00002.png"] and (image_folder(out) / "00006.png").is_file()
    written = load_prompt_rows(DataConfig(task=None, path=str(out)))
    generated = load_prompt_rows(DataConfig(task="shapes_vqa", num_prompts=7, seed=5, task_options={"questions": 2}))
    for loaded, made in zip(written, generated, strict=True):
        assert {k: v for k, v in loaded.items() if k != "images"} == {k: v for k, v in made.items() if k != "images"}
        assert (pixels(loaded["images"][0]) == pixels(made["images"][0])).all()
        assert list(vlm(loaded)) == list(vlm(made))
    image_folder(tmp_path / "other.jsonl").mkdir()  # a dataset's images are never replaced either
    with pytest.raises(DataError, match="other-images' already exists"):
        write_task_jsonl("shapes_vqa", tmp_path / "other.jsonl", 2)
