"""Model Artifacts: GGUF inspection, fingerprints, and slicing into shard files.

An artifact is identified by its *fingerprint*: a sha256 over its metadata and its
tensor index (name, type, shape, size, and the sha256 of each tensor's whole bytes, the
digest a manifest lists), so that no byte of the weights can change under the same
fingerprint, and a shard file can prove which artifact it was cut from. Hashing every
byte of a multi-GB model takes seconds: each file is hashed once, and the digests are
kept against the file's identity in a :class:`DigestCache`.

A *shard file* holds the tensors of one layer range with absolute block numbers, the
range keys the patched llama.cpp reads (``shard.layer_start`` / ``shard.layer_end``),
the parent's fingerprint and the parent's whole tensor index. From those the parent
fingerprint is recomputed and every local tensor's bytes are checked against the
parent index's digest at load, so a file edited or cut from another model is refused.

This module reads GGUF with the ``gguf`` package; it never imports ``llama_cpp``.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import platformdirs
from gguf import GGMLQuantizationType

from noderuntime.models import gguf as ggufio

SHARD_START_KEY = "shard.layer_start"
SHARD_END_KEY = "shard.layer_end"
PARENT_FINGERPRINT_KEY = "noderuntime.parent.fingerprint"
PARENT_INDEX_KEY = "noderuntime.parent.tensor_index"
# Keys that describe how a file was cut, not what model it holds: a shard file's range and
# parent, a gguf-split part's number and count (so a model stored in parts has the
# fingerprint of the same model in one file, and its shard files name no other parts).
_NON_IDENTITY_PREFIXES = ("shard.", "noderuntime.", "GGUF.", "split.")

SUPPORTED_ARCHITECTURES = frozenset({"llama", "qwen3", "qwen3moe", "gemma3"})
_FINGERPRINT_DOMAIN = b"noderuntime-artifact-v2\n"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
HASH_CHUNK = 16 << 20
# A file whose mtime is this close to when its hashing began may still be written within the
# same timestamp tick (coarse kernel clocks, 2 s on FAT): its digests are not kept (git's "racy" rule).
RACY_NS = 2_000_000_000
MAX_CACHED_FILES = 1024

log = logging.getLogger(__name__)


class ArtifactError(Exception):
    """A model file is missing, malformed, or not what it claims to be."""


@attrs.frozen
class LayerRange:
    """A contiguous half-open range of transformer blocks ``[start, end)``."""

    start: int
    end: int

    def __attrs_post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"invalid layer range {self.start}:{self.end}: need 0 <= start < end")

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse ``"A:B"``."""
        parts = text.strip().split(":")
        if len(parts) != 2:
            raise ValueError(f"invalid layer range {text!r}: expected START:END, e.g. 0:15")
        try:
            start, end = int(parts[0]), int(parts[1])
        except ValueError:
            raise ValueError(f"invalid layer range {text!r}: START and END must be integers") from None
        return cls(start, end)

    @classmethod
    def parse_list(cls, text: str) -> list[LayerRange]:
        """Parse ``"0:10,10:20,20:30"``."""
        return [cls.parse(part) for part in text.split(",") if part.strip()]

    def check_within(self, n_layer: int) -> None:
        """Raise ``ValueError`` unless the range lies inside a model of ``n_layer`` blocks."""
        if self.end > n_layer:
            raise ValueError(f"layer range {self} is outside the model, which has {n_layer} layers (0:{n_layer})")

    def __len__(self) -> int:
        return self.end - self.start

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.start <= layer < self.end

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


@attrs.frozen
class TensorEntry:
    """One line of a tensor index."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]  # ggml order: ne0 first
    n_bytes: int
    sha256: str  # of the tensor's whole bytes, its padding excluded (the manifest's digest)

    def line(self) -> str:
        """The canonical text form stored in shard files and hashed into fingerprints."""
        shape = ",".join(str(d) for d in self.shape)
        return f"{self.name}\t{self.ggml_type}\t{shape}\t{self.n_bytes}\t{self.sha256}"

    @classmethod
    def from_line(cls, line: str) -> TensorEntry:
        """Parse :meth:`line` output; raises ``ArtifactError`` on malformed text."""
        try:
            name, ggml_type, shape, n_bytes, digest = line.split("\t")
            if not _SHA256_RE.match(digest):
                raise ValueError(digest)
            return cls(name, int(ggml_type), tuple(int(d) for d in shape.split(",")), int(n_bytes), digest)
        except ValueError:
            raise ArtifactError(f"malformed tensor index line {line[:200]!r}") from None


@attrs.frozen
class ArtifactInfo:
    """What a GGUF file holds, as far as routing and loading need to know."""

    path: Path
    fingerprint: str  # of the whole model: the parent's for a shard file ("" unverified: see inspect)
    file_fingerprint: str  # of this file's own metadata and tensors ("" unverified)
    architecture: str
    name: str
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    context_length: int
    file_type: int
    quant: str
    n_tensors: int
    tensor_bytes: int
    file_bytes: int
    layer_range: LayerRange  # the whole model for an unsliced file
    has_chat_template: bool

    @property
    def is_shard_file(self) -> bool:
        """True when the file holds only a slice of the model."""
        return self.layer_range != LayerRange(0, self.n_layer)


def _open(path: Path) -> ggufio.GGUFFile:
    if not path.is_file():
        raise ArtifactError(f"model file not found: {path}")
    try:
        return ggufio.read(path)
    except ggufio.GGUFError as exc:
        raise ArtifactError(f"{path} is not a valid GGUF file: {exc}") from None
    except OSError as exc:
        raise ArtifactError(f"cannot read {path}: {exc}") from None


def _scalar(gguf: ggufio.GGUFFile, key: str, default: Any = None) -> Any:
    field = gguf.fields.get(key)
    if field is None or field.type == ggufio.ARRAY:
        return default
    return field.value()


def _integer(gguf: ggufio.GGUFFile, key: str, default: int | None, path: Path) -> int | None:
    """An integer metadata value; :class:`ArtifactError` when the file stores another type."""
    value = _scalar(gguf, key)
    if value is None:
        return default
    if type(value) is not int:  # a string, a float (inf even), a bool: int() would raise untyped
        raise ArtifactError(f"{path}: metadata {key} is {value!r:.40}, not an integer")
    return value


def _array_len(gguf: ggufio.GGUFFile, key: str) -> int:
    field = gguf.fields.get(key)
    return field.count if field is not None and field.type == ggufio.ARRAY else 0


def vocabulary_digest(path: str | os.PathLike[str]) -> str:
    """The sha256 of a GGUF file's token list (``tokenizer.ggml.tokens``, ids in order).

    Two files with the same digest map every token id to the same text: one model can draft
    for the other (``up --draft``). :class:`ArtifactError` for a file without a token list.
    """
    gguf = _open(Path(path))
    field = gguf.fields.get("tokenizer.ggml.tokens")
    if field is None or field.type != ggufio.ARRAY or field.array_type != ggufio.STRING:
        raise ArtifactError(f"{path} holds no token list (tokenizer.ggml.tokens)")
    # the raw bytes from the value on: the count and each token's length and text
    return hashlib.sha256(field.raw[field.value_offset :]).hexdigest()


def _identity_fields(gguf: ggufio.GGUFFile) -> list[tuple[str, bytes]]:
    return sorted((key, field.raw) for key, field in gguf.fields.items() if not key.startswith(_NON_IDENTITY_PREFIXES))


def tensor_sha256(fd: int, offset: int, n_bytes: int, progress: Callable[[int], object] | None = None) -> str:
    """The sha256 of the ``n_bytes`` at ``offset`` of the open file ``fd``: a tensor's digest.

    ``progress`` is called with the bytes read after each chunk.
    """
    digest = hashlib.sha256()
    buf = bytearray(min(n_bytes, HASH_CHUNK))
    view = memoryview(buf)
    at, end = offset, offset + n_bytes
    while at < end:
        got = os.preadv(fd, [view[: min(len(buf), end - at)]], at)
        if got <= 0:
            raise ArtifactError(f"the file ended inside a tensor, at byte {at}")
        digest.update(view[:got])  # hashlib lets go of the GIL for large updates: the pool runs in parallel
        at += got
        if progress is not None:
            progress(got)
    return digest.hexdigest()


def _hash_tensors(gguf: ggufio.GGUFFile, progress: Callable[[int], object] | None) -> list[str]:
    """The sha256 of every tensor of ``gguf``, in file order, read on a few threads."""
    workers = max(1, min(8, os.cpu_count() or 1, len(gguf.tensors)))
    with (
        gguf.path.open("rb") as f,
        concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tensor-sha256") as pool,
    ):
        fd = f.fileno()
        jobs = [pool.submit(tensor_sha256, fd, t.offset, t.n_bytes, progress) for t in gguf.tensors]
        return [job.result() for job in jobs]


@attrs.frozen
class DigestStatistics:
    """What a :class:`DigestCache` did: files answered from the cache, files hashed, bytes hashed."""

    hits: int
    misses: int
    bytes_hashed: int


def default_cache_dir() -> Path:
    """Where tensor digests are kept: ``$NODERUNTIME_DIGESTS``, or the user cache directory's ``tensor-digests``."""
    env = os.environ.get("NODERUNTIME_DIGESTS")
    return Path(env) if env else Path(platformdirs.user_cache_dir("noderuntime")) / "tensor-digests"


class DigestCache:
    """The sha256 of each tensor of a model file, computed once and kept against the file's identity.

    The identity is the file's device, inode, size and modification time: a file written
    again, in place or anew, is hashed again. The path is recorded but not compared, so a
    file verified under a temporary name and renamed into place (what a pull and a split
    do) is not read twice. A file modified within :data:`RACY_NS` of its hashing is not
    kept: a write in the same timestamp tick would leave its identity unchanged. A hit
    reads no tensor byte. At most ``max_files`` files are kept, the least recent dropped.
    """

    def __init__(self, folder: str | os.PathLike[str] | None = None, *, max_files: int = MAX_CACHED_FILES) -> None:
        self.folder = Path(folder) if folder is not None else default_cache_dir()
        self.max_files = max_files
        self._hits = self._misses = self._bytes = 0

    def statistics(self) -> DigestStatistics:
        """A snapshot of what this cache did."""
        return DigestStatistics(self._hits, self._misses, self._bytes)

    def digests(self, gguf: ggufio.GGUFFile, progress: Callable[[int], object] | None = None) -> list[str]:
        """The sha256 of each of ``gguf``'s tensors, in file order: kept ones, else read and kept."""
        started = time.time_ns()
        try:
            before = os.stat(gguf.path)
        except OSError as exc:
            raise ArtifactError(f"cannot read {gguf.path}: {exc}") from None
        entry = self.folder / f"{before.st_dev}-{before.st_ino}.json"
        layout = [[t.name, t.offset, t.n_bytes] for t in gguf.tensors]
        kept = self._read(entry, before, layout)
        if kept is not None:
            self._hits += 1
            return kept
        self._misses += 1
        try:
            digests = _hash_tensors(gguf, progress)
        except OSError as exc:
            raise ArtifactError(f"cannot read {gguf.path}: {exc}") from None
        self._bytes += sum(t.n_bytes for t in gguf.tensors)
        after = os.stat(gguf.path)
        if _identity(after) == _identity(before) and before.st_mtime_ns <= started - RACY_NS:
            self._write(entry, gguf.path, before, [[*row, d] for row, d in zip(layout, digests, strict=True)])
        return digests

    def _read(self, entry: Path, stat: os.stat_result, layout: list[list[Any]]) -> list[str] | None:
        try:
            data = json.loads(entry.read_bytes())
        except (OSError, ValueError):
            return None  # none kept, or one a crash cut short: hash again
        if not isinstance(data, dict) or data.get("identity") != list(_identity(stat)):
            return None
        rows = data.get("tensors")
        if not isinstance(rows, list) or [row[:3] for row in rows if isinstance(row, list)] != layout:
            return None
        digests = [row[3] for row in rows if len(row) == 4]
        if len(digests) != len(layout) or not all(isinstance(d, str) and _SHA256_RE.match(d) for d in digests):
            return None
        return digests

    def _write(self, entry: Path, path: Path, stat: os.stat_result, rows: list[list[Any]]) -> None:
        data = {"path": str(path.resolve()), "identity": list(_identity(stat)), "tensors": rows}
        tmp = entry.with_name(f".{entry.name}.{os.getpid()}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, separators=(",", ":")))
            os.replace(tmp, entry)
            self._prune()
        except OSError as exc:  # a read-only or full cache costs time, never a refusal
            tmp.unlink(missing_ok=True)
            log.warning("cannot keep the tensor digests of %s in %s: %s", path, self.folder, exc)

    def _prune(self) -> None:
        files = list(self.folder.glob("*.json"))
        if len(files) <= self.max_files:
            return
        by_age = sorted(files, key=lambda f: f.stat().st_mtime_ns)
        for old in by_age[: len(files) - self.max_files]:
            old.unlink(missing_ok=True)


def _identity(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


_default_cache: DigestCache | None = None


def default_cache() -> DigestCache:
    """The process's cache in :func:`default_cache_dir` (made on first use)."""
    global _default_cache
    if _default_cache is None or _default_cache.folder != default_cache_dir():
        _default_cache = DigestCache()
    return _default_cache


def tensor_index(
    gguf: ggufio.GGUFFile,
    *,
    cache: DigestCache | None = None,
    progress: Callable[[int], object] | None = None,
) -> list[TensorEntry]:
    """The tensor index of a file's tensors, in file order, each with the sha256 of its bytes.

    The digests come from ``cache`` (:func:`default_cache` when None) when it holds this very
    file; otherwise every tensor is read, and ``progress`` called with the bytes read.
    """
    digests = (cache or default_cache()).digests(gguf, progress)
    return [
        TensorEntry(t.name, t.ggml_type, t.shape, t.n_bytes, digest)
        for t, digest in zip(gguf.tensors, digests, strict=True)
    ]


def fingerprint_of(gguf: ggufio.GGUFFile, index: Iterable[TensorEntry]) -> str:
    """The fingerprint of a model with ``gguf``'s metadata and the tensors ``index`` lists.

    For a model stored in gguf-split parts: the first part's header and every part's tensors.
    """
    return _fingerprint(_identity_fields(gguf), index)


def model_fields(gguf: ggufio.GGUFFile) -> list[bytes]:
    """The raw metadata fields that say what model a file holds, in file order: what shard files copy."""
    return [f.raw for key, f in gguf.fields.items() if not key.startswith(_NON_IDENTITY_PREFIXES)]


def shard_fields(
    model: Sequence[bytes], layers: LayerRange, fingerprint: str, parent: Sequence[TensorEntry]
) -> list[bytes]:
    """The raw metadata of the shard file of ``layers``: the model's fields, then its range and its parent."""
    return [
        *model,
        ggufio.uint32_field(SHARD_START_KEY, layers.start),
        ggufio.uint32_field(SHARD_END_KEY, layers.end),
        ggufio.string_field(PARENT_FINGERPRINT_KEY, fingerprint),
        ggufio.string_array_field(PARENT_INDEX_KEY, [entry.line() for entry in parent]),
    ]


def shard_file_name(stem: str, layers: LayerRange) -> str:
    """The name :func:`split` gives the shard file of ``layers`` of the model file named ``stem``."""
    return f"{stem}.layers-{layers.start}-{layers.end}.gguf"


def tied_output(index: Iterable[TensorEntry]) -> bool:
    """Whether the model's output head is its token embedding (it has no ``output.weight``)."""
    return not any(entry.name == "output.weight" for entry in index)


def _fingerprint(fields: Iterable[tuple[str, bytes]], index: Iterable[TensorEntry]) -> str:
    return fingerprint_of_digests((field_digest(name, blob) for name, blob in fields), sorted(e.line() for e in index))


def field_digest(key: str, raw: bytes) -> bytes:
    """What a fingerprint hashes of one identity field: a party shown the digests of the others
    and one field whole can check that field against the fingerprint (``tracker.shapes``)."""
    return hashlib.sha256(key.encode() + b"\0" + raw).digest()


def fingerprint_of_digests(field_digests: Iterable[bytes], index_lines: Iterable[str]) -> str:
    """The fingerprint of a model whose identity fields, in key order, have ``field_digests``
    (:func:`field_digest`) and whose tensor index is ``index_lines`` (:meth:`TensorEntry.line`, sorted)."""
    digest = hashlib.sha256(_FINGERPRINT_DOMAIN)
    for one in field_digests:
        digest.update(one)
    digest.update(b"tensors\n")
    for line in index_lines:
        digest.update(line.encode() + b"\n")
    return digest.hexdigest()


def identity(
    path: str | os.PathLike[str], *, cache: DigestCache | None = None
) -> tuple[list[tuple[str, bytes]], list[TensorEntry]]:
    """What the fingerprint of the model in ``path`` is a hash of: its identity fields (key, raw
    bytes) in key order, and the model's tensor index (a shard file's copy of its parent's).

    A whole file's tensors are hashed unless ``cache`` (:func:`default_cache` when None) holds
    their digests already, as it does once the file has been inspected.
    """
    gguf = _open(Path(path))
    shard = PARENT_INDEX_KEY in gguf.fields
    return _identity_fields(gguf), _parent_index(Path(path), gguf) if shard else tensor_index(gguf, cache=cache)


def tensor_belongs(name: str, layers: LayerRange, n_layer: int, tied_output: bool) -> bool:
    """Whether a shard of ``layers`` needs tensor ``name`` (the rule the llama.cpp patch applies)."""
    match = _BLOCK_RE.match(name)
    if match:
        return int(match.group(1)) in layers
    if name.startswith("token_embd."):
        return layers.start == 0 or (tied_output and layers.end == n_layer)
    if name.startswith(("output_norm.", "output.")):
        return layers.end == n_layer
    return True  # global tensors every block may use (rope factors)


def inspect(path: str | os.PathLike[str], *, verify: bool = True, cache: DigestCache | None = None) -> ArtifactInfo:
    """Read a GGUF file's identity.

    ``verify``: every tensor's bytes are hashed (once per file: ``cache``, :func:`default_cache`
    when None), which gives the fingerprints, and a shard file is checked against its parent
    index. Without it only the header is read (cheap enough for a loop, and what a sparse
    copy of a header allows): a shard file's ``fingerprint`` is then the parent's as its
    header claims it, a whole file's is ``""`` (unknown), and ``file_fingerprint`` is ``""``.
    """
    return _inspect(Path(path), _open(Path(path)), verify, cache)[0]


def _inspect(
    path: Path, gguf: ggufio.GGUFFile, verify: bool, cache: DigestCache | None
) -> tuple[ArtifactInfo, list[TensorEntry] | None]:
    """The file's info, and its tensor index when ``verify`` (what reading it took)."""
    arch = _scalar(gguf, "general.architecture")
    if not isinstance(arch, str):
        raise ArtifactError(f"{path} has no general.architecture")
    n_layer = _scalar(gguf, f"{arch}.block_count")
    n_embd = _scalar(gguf, f"{arch}.embedding_length")
    if not isinstance(n_layer, int) or not isinstance(n_embd, int) or n_layer <= 0 or n_embd <= 0:
        raise ArtifactError(f"{path} lacks {arch}.block_count or {arch}.embedding_length")
    fields = _identity_fields(gguf)
    index = tensor_index(gguf, cache=cache) if verify else None
    file_fingerprint = _fingerprint(fields, index) if index is not None else ""
    start = _integer(gguf, SHARD_START_KEY, None, path)
    end = _integer(gguf, SHARD_END_KEY, None, path)
    if start is None and end is None:
        layer_range, fingerprint = LayerRange(0, n_layer), file_fingerprint
    else:
        try:
            layer_range = LayerRange(start if start is not None else 0, end if end is not None else n_layer)
            layer_range.check_within(n_layer)
        except ValueError as exc:
            raise ArtifactError(f"{path}: {exc}") from None
        fingerprint = _scalar(gguf, PARENT_FINGERPRINT_KEY, "")
        if index is not None:
            _verify_slice(path, gguf, fields, index, layer_range, n_layer)
    file_type = _integer(gguf, "general.file_type", -1, path)
    types = {t.ggml_type for t in gguf.tensors if _BLOCK_RE.match(t.name) and len(t.shape) >= 2}
    quant = "+".join(sorted(GGMLQuantizationType(t).name for t in types)) if types else "unknown"
    n_head = _integer(gguf, f"{arch}.attention.head_count", 0, path)
    info = ArtifactInfo(
        path=path,
        fingerprint=str(fingerprint),
        file_fingerprint=file_fingerprint,
        architecture=arch,
        name=str(_scalar(gguf, "general.name", path.stem)),
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=_array_len(gguf, "tokenizer.ggml.tokens") or _integer(gguf, f"{arch}.vocab_size", 0, path) or 0,
        n_head=n_head or 0,
        n_head_kv=_integer(gguf, f"{arch}.attention.head_count_kv", n_head, path) or 0,
        context_length=_integer(gguf, f"{arch}.context_length", 0, path) or 0,
        file_type=file_type if file_type is not None else -1,
        quant=quant,
        n_tensors=len(gguf.tensors),
        tensor_bytes=sum(t.n_bytes for t in gguf.tensors),
        file_bytes=path.stat().st_size,
        layer_range=layer_range,
        has_chat_template="tokenizer.chat_template" in gguf.fields,
    )
    return info, index


def _parent_index(path: Path, gguf: ggufio.GGUFFile) -> list[TensorEntry]:
    field = gguf.fields.get(PARENT_INDEX_KEY)
    if field is None or field.type != ggufio.ARRAY or field.array_type != ggufio.STRING:
        raise ArtifactError(f"{path} is a shard file without its parent's tensor index ({PARENT_INDEX_KEY})")
    return [TensorEntry.from_line(line) for line in field.value()]


def _verify_slice(
    path: Path,
    gguf: ggufio.GGUFFile,
    fields: list[tuple[str, bytes]],
    index: list[TensorEntry],
    layers: LayerRange,
    n_layer: int,
) -> None:
    claimed = _scalar(gguf, PARENT_FINGERPRINT_KEY)
    if not isinstance(claimed, str) or not claimed:
        raise ArtifactError(f"{path} is a shard file without a parent fingerprint ({PARENT_FINGERPRINT_KEY})")
    parent = _parent_index(path, gguf)
    if _fingerprint(fields, parent) != claimed:
        raise ArtifactError(
            f"{path}: metadata or parent index does not match the parent fingerprint {claimed[:16]}…; "
            "the file was modified after it was cut"
        )
    parent_lines = {entry.name: entry for entry in parent}
    for entry in index:
        if parent_lines.get(entry.name) != entry:
            raise ArtifactError(f"{path}: tensor {entry.name} differs from the parent model {claimed[:16]}…")
    tied = "output.weight" not in parent_lines
    wanted = {name for name in parent_lines if tensor_belongs(name, layers, n_layer, tied)}
    have = {entry.name for entry in index}
    if have != wanted:
        missing, extra = sorted(wanted - have), sorted(have - wanted)
        raise ArtifactError(f"{path}: tensors do not match range {layers}: missing {missing[:5]}, extra {extra[:5]}")


def verify_parent(info: ArtifactInfo, expected_fingerprint: str) -> None:
    """Refuse a file that is not (a slice of) the artifact ``expected_fingerprint``."""
    if info.fingerprint != expected_fingerprint:
        raise ArtifactError(
            f"{info.path} belongs to artifact {info.fingerprint[:16]}…, not the expected {expected_fingerprint[:16]}…"
        )


def split(
    model: str | os.PathLike[str],
    ranges: Sequence[LayerRange],
    out_dir: str | os.PathLike[str],
    *,
    progress: bool = False,
) -> list[Path]:
    """Write one shard file per range (with a progress bar if asked); returns their paths."""
    from tqdm import tqdm  # here, not at the top: 20 ms of every process start

    model = Path(model)
    gguf = _open(model)
    info, parent = _inspect(model, gguf, True, None)
    assert parent is not None  # verified: its index was read
    if info.is_shard_file:
        raise ArtifactError(f"{model} is already a shard file ({info.layer_range}); split the whole model")
    if info.architecture not in SUPPORTED_ARCHITECTURES:
        raise ArtifactError(f"architecture {info.architecture!r} is not supported for layer ranges")
    if not ranges:
        raise ArtifactError("no ranges given")
    for layers in ranges:
        try:
            layers.check_within(info.n_layer)
        except ValueError as exc:
            raise ArtifactError(str(exc)) from None
    tied = tied_output(parent)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = model_fields(gguf)
    written = []
    for layers in ranges:
        target = out / shard_file_name(model.stem, layers)
        tmp = target.with_suffix(".gguf.partial")
        fields = shard_fields(kept, layers, info.fingerprint, parent)
        tensors = [t for t in gguf.tensors if tensor_belongs(t.name, layers, info.n_layer, tied)]
        try:
            with (
                model.open("rb") as source,
                tqdm(
                    total=sum(t.n_bytes for t in tensors),
                    unit="B",
                    unit_scale=True,
                    desc=f"layers {layers}",
                    disable=not progress,
                ) as bar,
            ):
                ggufio.write(tmp, fields, [(t, source) for t in tensors], alignment=gguf.alignment, progress=bar.update)
        except BaseException:  # a full disk, Ctrl-C: no half-written slice of gigabytes left behind
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, target)
        written.append(target)
    for path in written:
        inspect(path)  # verifies every slice against the parent fingerprint
    return written
