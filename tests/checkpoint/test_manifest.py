"""The manifest of a checkpoint: finalize, verify (each kind of damage named), list, fall back, prune."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

import pytest
from checkpoint_helpers import CONFIG, tiny_policy, write_checkpoint, write_unfinished

from gcore_rl.checkpoint import layout, stacking
from gcore_rl.checkpoint.manifest import (
    DCP_METADATA,
    FileEntry,
    Manifest,
    config_sha256,
    file_sha256,
    finalize,
    frozen_model,
    list_checkpoints,
    newest_valid,
    prune,
    read_dcp_metadata,
    read_manifest,
    verify,
)
from gcore_rl.errors import CheckpointError

SHARD = "trainer/__0_0.distcp"
"""The one DCP shard a single-process save writes."""


def _relist(folder: Path, relative: str) -> None:
    """Record the current size and sha256 of `relative` in the manifest (as if the save had written it so)."""
    manifest = read_manifest(folder)
    path = folder / relative
    manifest.files = [FileEntry(relative, path.stat().st_size, file_sha256(path)) if entry.path == relative else entry
                      for entry in manifest.files]
    (folder / layout.MANIFEST).write_text(manifest.to_json())


def _expect_unusable(folder: Path, *needles: str, checksums: bool = True) -> str:
    """verify raises one paragraph naming the folder, the needles and what to do; returns the message."""
    with pytest.raises(CheckpointError) as raised:
        verify(folder, checksums=checksums)
    message = str(raised.value)
    assert str(folder) in message
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message
    return message


def test_finalize_renames_the_folder_and_lists_every_file(tmp_path, tiny_dir):
    unfinished = write_unfinished(tmp_path, 7, tiny_policy(), tiny_dir)
    final = finalize(unfinished, step=7, config_sha256="c" * 64, controllers=2, trainer_devices=3, devices=8,
                     frozen=[frozen_model("reference", tiny_dir)], save_seconds=1.5)
    assert final == tmp_path / "step-00000007" and not unfinished.exists()
    on_disk = sorted(p.relative_to(final).as_posix() for p in final.rglob("*") if p.is_file())
    manifest = read_manifest(final)
    assert [entry.path for entry in manifest.files] == [name for name in on_disk if name != layout.MANIFEST]
    assert {DCP_METADATA, SHARD, "model/config.json", layout.TRAINER_STATE, "controller-0.json"} <= set(on_disk)
    for entry in manifest.files:
        assert entry.bytes == (final / entry.path).stat().st_size
        assert entry.sha256 == file_sha256(final / entry.path)
    assert (manifest.step, manifest.controllers, manifest.trainer_devices, manifest.devices) == (7, 2, 3, 8)
    assert manifest.save_seconds == 1.5 and manifest.config_sha256 == "c" * 64
    assert datetime.fromisoformat(manifest.created).utcoffset() == timezone.utc.utcoffset(None)
    assert not (final / (layout.MANIFEST + ".tmp")).exists()


@pytest.mark.parametrize("name", ["step-00000007", "weights", "step-00000008.incomplete"])
def test_finalize_refuses_a_folder_that_is_not_the_unfinished_save_of_the_step(tmp_path, name):
    (tmp_path / name).mkdir()
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        finalize(tmp_path / name, step=7, config_sha256="", controllers=1, trainer_devices=1, devices=1, frozen=[])


def test_manifest_round_trips_through_json(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path, 3, tiny_dir)
    manifest = read_manifest(folder)
    assert Manifest.from_json(manifest.to_json()) == manifest
    assert manifest.frozen[0].role == "reference" and manifest.frozen[0].path == str(tiny_dir.resolve())
    assert manifest.total_bytes == sum(entry.bytes for entry in manifest.files) > 0


def test_config_sha256_ignores_key_order_and_sees_every_value():
    assert config_sha256({"a": 1, "b": {"c": 2, "d": 3}}) == config_sha256({"b": {"d": 3, "c": 2}, "a": 1})
    assert config_sha256(CONFIG) != config_sha256({**CONFIG, "run": {"steps": 5}})
    assert len(config_sha256({})) == 64


def test_frozen_model_checksum_follows_the_weights(tmp_path, tiny_dir):
    copy = Path(shutil.copytree(tiny_dir, tmp_path / "copy"))
    assert frozen_model("judge", copy).sha256 == frozen_model("judge", tiny_dir).sha256
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert frozen_model("judge", copy).sha256 != frozen_model("judge", tiny_dir).sha256
    assert Path(frozen_model("judge", os.path.relpath(copy)).path).is_absolute()
    with pytest.raises(CheckpointError, match="no weight files"):
        frozen_model("judge", tmp_path)


def test_verify_accepts_a_fresh_checkpoint_and_reads_its_dcp_metadata(tmp_path, tiny_dir):
    folder, model = write_checkpoint(tmp_path, 3, tiny_dir)
    assert verify(folder).step == 3
    assert verify(folder, checksums=False).step == 3
    saved = read_dcp_metadata(folder).state_dict_metadata
    stacks = json.loads((folder / layout.TRAINER_STATE).read_text())["stacks"]["model"]
    assert {f"model.{key}" for key in stacks} <= set(saved)
    assert set(stacking.members_by_name(stacks)) == {(name, "param") for name in model.state_dict()}


def test_verify_names_a_truncated_file_with_both_sizes(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path, 3, tiny_dir)
    shard = folder / SHARD
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    _expect_unusable(folder, str(shard), f"{size // 2} bytes", f"lists {size}", "truncated", "run.resume=PATH",
                     checksums=False)


def test_verify_names_a_missing_shard(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path, 3, tiny_dir)
    (folder / SHARD).unlink()
    _expect_unusable(folder, str(folder / SHARD), "missing")


def test_verify_finds_a_changed_byte_only_with_checksums(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path, 3, tiny_dir)
    shard = folder / SHARD
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    _expect_unusable(folder, str(shard), "sha256")
    assert verify(folder, checksums=False).step == 3


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    (f'{{"format": {layout.FORMAT_VERSION}, "step": 3}}', "lacks the field(s) created"),
    ('{"format": 1, "step": 3}', "format version is 1, and this gcore-rl reads version"),  # before the stacked moments
    ('{"format": 99}', "format version is 99"),
    ("[1, 2]", "not a JSON object"),
])
def test_verify_names_a_damaged_manifest(tmp_path, tiny_dir, text, needle):
    folder, _ = write_checkpoint(tmp_path, 3, tiny_dir)
    (folder / layout.MANIFEST).write_text(text)
    _expect_unusable(folder, str(folder / layout.MANIFEST), needle)


def test_verify_refuses_a_folder_without_manifest_or_an_unfinished_one(tmp_path, tiny_dir):
    _expect_unusable(tiny_dir, str(tiny_dir / layout.MANIFEST))
    unfinished = write_unfinished(tmp_path, 4, tiny_policy(), tiny_dir)
    _expect_unusable(unfinished, "never finished")


class _Exploit:
    """Pickles as a call of os.system (what a planted `.metadata` would do on a plain `pickle.load`)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_verify_refuses_to_unpickle_anything_but_dcp_metadata(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path / "root", 3, tiny_dir)
    marker = tmp_path / "pwned"
    (folder / DCP_METADATA).write_bytes(pickle.dumps(_Exploit(marker)))
    _relist(folder, DCP_METADATA)  # the checksum matches: only the unpickler stands in the way
    _expect_unusable(folder, str(folder / DCP_METADATA), f"refuses to unpickle {os.system.__module__}.system")
    assert not marker.exists()


def test_verify_names_a_shard_the_metadata_needs_but_the_manifest_does_not_list(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path, 3, tiny_dir)
    manifest = read_manifest(folder)
    manifest.files = [entry for entry in manifest.files if entry.path != SHARD]
    (folder / layout.MANIFEST).write_text(manifest.to_json())
    _expect_unusable(folder, str(folder / SHARD), "does not list")


def test_verify_refuses_a_manifest_of_another_step(tmp_path, tiny_dir):
    folder, _ = write_checkpoint(tmp_path, 3, tiny_dir)
    (folder / layout.MANIFEST).write_text(replace(read_manifest(folder), step=4).to_json())
    _expect_unusable(folder, "records step 4")


def test_list_checkpoints_shows_finished_and_unfinished_folders_of_a_run(tmp_path, tiny_dir):
    root = tmp_path / "run" / "checkpoints"
    for step in (4, 2):
        write_checkpoint(root, step, tiny_dir)
    write_unfinished(root, 6, tiny_policy(), tiny_dir)
    (root / "notes").mkdir()
    (root / "step-12").mkdir()
    (root / "README").write_text("not a checkpoint")
    infos = list_checkpoints(tmp_path / "run")
    assert [(info.step, info.complete) for info in infos] == [(2, True), (4, True), (6, False)]
    assert infos[0].path == root / "step-00000002" and infos[0].created and infos[0].devices == 2
    assert (infos[2].created, infos[2].controllers, infos[2].trainer_devices, infos[2].devices) == (None,) * 4
    assert all(info.bytes > 10_000 for info in infos)
    assert list_checkpoints(root) == infos
    assert list_checkpoints(tmp_path / "nowhere") == []


def test_newest_valid_falls_back_past_a_damaged_and_an_unfinished_checkpoint(tmp_path, tiny_dir):
    for step in (2, 4):
        write_checkpoint(tmp_path, step, tiny_dir)
    write_unfinished(tmp_path, 6, tiny_policy(), tiny_dir)
    (tmp_path / "step-00000004" / SHARD).unlink()
    found, skipped = newest_valid(tmp_path)
    assert found == tmp_path / "step-00000002"
    assert len(skipped) == 2
    assert "step-00000006.incomplete" in skipped[0] and "never finished" in skipped[0]
    assert str(tmp_path / "step-00000004" / SHARD) in skipped[1]
    (tmp_path / "step-00000002" / layout.MANIFEST).unlink()
    assert newest_valid(tmp_path)[0] is None
    assert newest_valid(tmp_path / "nowhere") == (None, [])


def test_prune_keeps_the_newest_k_and_unfinished_saves_newer_than_them(tmp_path, tiny_dir):
    for step in (1, 2, 3, 4):
        write_checkpoint(tmp_path, step, tiny_dir)
    for step in (2, 5):
        write_unfinished(tmp_path, step, tiny_policy(), tiny_dir)
    removed = prune(tmp_path, keep=2)
    assert sorted(path.name for path in removed) == ["step-00000001", "step-00000002", "step-00000002.incomplete"]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["step-00000003", "step-00000004",
                                                                "step-00000005.incomplete"]
    assert prune(tmp_path, keep=1) == [tmp_path / "step-00000003"]
    with pytest.raises(ValueError, match="keep=0"):
        prune(tmp_path, keep=0)
    assert [info.step for info in list_checkpoints(tmp_path)] == [4, 5]
