"""Fetching only one shard's layers of a model served over HTTP, checked against a signed manifest.

:func:`pull_layers` reads the GGUF header with ranged GETs, then each contiguous span of
the range's tensors (with the token embedding on the head and the output tensors on the
tail: what :func:`artifacts.split` puts in a shard file) with one single-range request
each, and writes them in place into the shard file ``shard split`` would have written for
that range, byte for byte. A model stored as gguf-split parts (``NAME-00001-of-00003.gguf``
and on) is read the same way, and only the parts that hold the range's tensors are asked for.

Nothing the server says is taken on trust. Every answer must be a 206 for the bytes asked
(or a first part of them, then the rest is asked for) of a file of the manifest's size,
unchanged since the pull began (its ETag); the header must be the one the manifest
signs, and with the manifest's tensor index it must give the artifact's fingerprint;
every tensor must have the manifest's sha256. A dropped connection is resumed where it
broke. The shard is written under a temporary name and takes its own only once every
tensor has been verified again from the disk and the file passes
:func:`artifacts.inspect`; a pull that fails keeps what it verified (a small JSON state
beside the partial file) and the next run goes on from there.

A ranged pull without a manifest is refused: a shard file carries its parent's whole
tensor index, which only the manifest gives without reading every tensor, and nothing
else could tell a damaged or substituted range from the real one. So is one whose
manifest is not signed by the publisher key the operator pins, unless the operator says
to take the manifest's source (a tracker, a URL, a file) at its word
(:class:`UntrustedManifestError`): anyone can sign a manifest of altered weights.

Every size a server states is bounded before anything is allocated for it: a header is
at most :data:`MAX_HEADER_BYTES`, a document (a manifest, a listing) at most
:data:`MAX_DOCUMENT_BYTES`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import attrs
import httpx

from noderuntime.models import artifacts
from noderuntime.models import gguf as ggufio
from noderuntime.models.artifacts import ArtifactError, LayerRange
from noderuntime.models.catalogue import folder_turn
from noderuntime.models.manifest import SPLIT_NAME, Manifest, ManifestError, ManifestTensor

NO_MANIFEST = (
    "a ranged pull is checked against the artifact's signed manifest: give --manifest with a manifest file, "
    "a manifest URL, or the URL of a tracker that serves it (`noderuntime models manifest` makes one)"
)
UNTRUSTED_MANIFEST = (
    "no publisher key is pinned for the manifest of {url}: give --publisher-key KEY (the key the model's "
    "publisher signs its manifests with), or --trust-tracker-manifests to accept a manifest signed by any key "
    "on the word of its source (your tracker, your --manifest)"
)
HEADER_FIRST_READ = 256 << 10  # then doubled until the header parses, when the manifest is not yet known
# the largest GGUF headers (256k-token vocabularies, with their merges) are tens of MB
MAX_HEADER_BYTES = 64 << 20
MAX_DOCUMENT_BYTES = 64 << 20
MERGE_GAP = 64 << 10  # bytes between two wanted tensors worth reading rather than making another request
CHUNK = 1 << 20
SAVE_EVERY = 16 << 20  # what a killed pull may have to fetch again
_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")
_NAME_CHARS = re.compile(r"[^A-Za-z0-9._+-]")

log = logging.getLogger(__name__)


class FetchError(ArtifactError):
    """A ranged pull could not finish; what it verified is kept for the next run."""


class UntrustedManifestError(FetchError):
    """A manifest signed by a key the operator did not pin, and no word to trust its source."""


class HeaderTooLargeError(FetchError):
    """A server's file declares a header over :data:`MAX_HEADER_BYTES`: nothing is allocated for it."""


class _Transient(Exception):
    """A failure worth asking again for: a dropped connection, a busy server."""


@attrs.frozen
class PulledShard:
    """A shard file fetched (or found fetched and verified before) for one layer range."""

    path: Path
    artifact: str  # the fingerprint of the whole model, which the shard file's equals
    layers: LayerRange
    publisher: str  # the key that signed the manifest it was checked against
    fetched_bytes: int  # response bytes this pull received (0 when reused)
    reused: bool


def is_url(text: str) -> bool:
    """Whether ``text`` names a model by an http(s) URL rather than a path or a known name."""
    return text.startswith(("http://", "https://"))


@attrs.frozen
class _Source:
    """Where the model's files are: the first (or only) file's URL and how many parts there are."""

    url: str
    stem: str  # what its shard files are named after
    count: int

    @classmethod
    def of(cls, url: str) -> _Source:
        parts = urllib.parse.urlsplit(url)
        last = parts.path.rsplit("/", 1)[-1]
        if not last:
            raise FetchError(f"{url} names no file")
        name = urllib.parse.unquote(last)
        match = SPLIT_NAME.match(last)
        if match is None:
            return cls(url, _safe_stem(name.removesuffix(".gguf")), 1)
        if int(match["no"]) != 1:
            raise FetchError(f"{url} is part {int(match['no'])} of a split model: give the first part's URL")
        return cls(url, _safe_stem(urllib.parse.unquote(match["stem"])), int(match["count"]))

    def part_url(self, number: int) -> str:
        """The URL of part ``number`` (from 0): beside the first, named as llama.cpp names parts."""
        if number == 0:
            return self.url
        parts = urllib.parse.urlsplit(self.url)
        head, _, last = parts.path.rpartition("/")
        match = SPLIT_NAME.match(last)
        assert match is not None  # only a split model has parts after the first
        name = f"{match['stem']}-{number + 1:05d}-of-{self.count:05d}.gguf"
        return urllib.parse.urlunsplit(parts._replace(path=f"{head}/{name}"))


def _safe_stem(name: str) -> str:
    return _NAME_CHARS.sub("_", name) or "model"


def _validator(headers: httpx.Headers) -> str:
    """What says which version of a file a response came from: its ETag, else its Last-Modified."""
    return headers.get("etag") or headers.get("last-modified") or ""


class _Ranges:
    """Single-range GETs, each answer checked; dropped connections resumed."""

    def __init__(self, client: httpx.Client, *, retries: int, backoff: float) -> None:
        self.client = client
        self.retries = retries
        self.backoff = backoff
        self.sizes: dict[str, int] = {}  # by URL, from the first answer's Content-Range
        self.validators: dict[str, str] = {}  # by URL, from the first answer
        self.received = 0  # response body bytes, all requests together

    def read(self, url: str, start: int, end: int, sink: Callable[[int, bytes], None]) -> None:
        """Feed the bytes ``[start, end)`` of ``url`` (fewer if the file ends first) to ``sink(offset, chunk)``."""
        pos, failures = start, 0
        while pos < min(end, self.sizes.get(url, end)):
            before = pos
            try:
                with contextlib.closing(self._request(url, pos, min(end, self.sizes.get(url, end)))) as chunks:
                    for chunk in chunks:
                        sink(pos, chunk)
                        pos += len(chunk)
            except (_Transient, httpx.TransportError) as exc:
                failures = 1 if pos > before else failures + 1
                if failures > self.retries:
                    raise FetchError(
                        f"{url}: {_describe(exc)} (tried {failures} times); what was verified is kept: "
                        "run the same command again to go on"
                    ) from None
                log.info("%s: %s at byte %d; asking again", url, _describe(exc), pos)
                if pos == before:
                    time.sleep(self.backoff * 2 ** (failures - 1))
                continue
            if pos == before:  # an empty answer: the server has nothing more to give
                raise FetchError(f"{url} answered no bytes for bytes {pos}-{end - 1}")

    def _request(self, url: str, start: int, end: int) -> Generator[bytes]:
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        with self.client.stream("GET", url, headers=headers) as response:
            status = response.status_code
            if status == 200:
                raise FetchError(
                    f"{url} ignores Range requests (it answered 200 with the whole file): "
                    "a ranged pull needs a server that honours Range"
                )
            if status in _TRANSIENT_STATUS:
                raise _Transient(f"HTTP {status}")
            if status == 416:
                raise FetchError(f"{url} has no bytes {start}-{end - 1}: it is shorter than the manifest says")
            if status != 206:
                raise FetchError(f"{url} answered HTTP {status} to a range request")
            encoding = response.headers.get("content-encoding", "identity").lower()
            if encoding != "identity":
                raise FetchError(f"{url} sent its bytes {encoding}-encoded; a range must come as it is stored")
            first, last, total = self._content_range(url, response.headers.get("content-range", ""))
            if first != start or not start <= last <= end - 1:
                raise FetchError(
                    f"{url} answered with bytes {first}-{last} (Content-Range) to a request for bytes {start}-{end - 1}"
                )
            known = self.sizes.setdefault(url, total)
            if total != known:
                raise FetchError(f"{url} changed size during the pull ({known} then {total} bytes)")
            validator = _validator(response.headers)
            seen = self.validators.setdefault(url, validator)
            if validator != seen:
                raise FetchError(
                    f"{url} changed on the server during the pull (ETag {seen or 'none'}, now {validator or 'none'}); "
                    "what was verified is kept: run again to go on against the new file"
                )
            length = last + 1 - first
            declared = response.headers.get("content-length")
            if declared is not None and declared != str(length):
                raise FetchError(f"{url} declared {declared} bytes for a Content-Range of {length}")
            got = 0
            for chunk in response.iter_raw():  # as it arrives: a dropped connection loses no bytes held back
                got += len(chunk)
                if got > length:
                    raise FetchError(f"{url} sent more bytes than its Content-Range says ({length})")
                self.received += len(chunk)
                yield chunk
            if got < length:
                raise _Transient(f"the answer ended after {got} of {length} bytes")

    def _content_range(self, url: str, text: str) -> tuple[int, int, int]:
        match = _CONTENT_RANGE.match(text.strip())
        if match is None:
            raise FetchError(f"{url} answered 206 with an unreadable Content-Range {text[:80]!r}")
        first, last, total = (int(x) for x in match.groups())
        if last < first or last >= total:
            raise FetchError(f"{url} answered with an impossible Content-Range {text[:80]!r}")
        return first, last, total

    def header(self, url: str, exact: int | None) -> tuple[ggufio.GGUFFile, bytes]:
        """The parsed GGUF header of ``url`` and its bytes (to the start of its data).

        ``exact``: the header's length when the manifest is known; otherwise the read grows
        until the header parses.
        """
        buf = bytearray()

        def append(offset: int, chunk: bytes) -> None:
            if offset + len(chunk) > MAX_HEADER_BYTES:  # read asks no more; a server may send it anyway
                raise _too_large(url, offset + len(chunk))
            buf.extend(chunk)

        if exact is not None and exact > MAX_HEADER_BYTES:
            raise _too_large(url, exact)
        want = exact if exact is not None else HEADER_FIRST_READ
        name = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).name
        while True:
            self.read(url, len(buf), want, append)
            try:
                gguf = ggufio.parse(buf, self.sizes[url], name)
            except ggufio.HeaderIncomplete as exc:
                if len(buf) >= self.sizes[url]:
                    raise FetchError(f"{url} is not a GGUF file: {exc}") from None
                if exc.needed > MAX_HEADER_BYTES:  # a string or array the server says is that long
                    raise _too_large(url, exc.needed) from None
                want = min(max(exc.needed, 2 * len(buf)), MAX_HEADER_BYTES)
                continue
            except ggufio.GGUFError as exc:
                raise FetchError(f"{url} is not a GGUF file: {exc}") from None
            if gguf.data_offset > MAX_HEADER_BYTES:
                raise _too_large(url, gguf.data_offset)
            if len(buf) < gguf.data_offset:  # the padding up to the data is part of the header too
                want = gguf.data_offset
                continue
            return gguf, bytes(buf[: gguf.data_offset])

    def document(self, url: str) -> bytes | None:
        """The body of a plain GET of a (manifest) document; ``None`` when the server has none (404)."""
        try:
            with self.client.stream("GET", url) as response:
                if response.status_code == 404:
                    return None
                if response.status_code != 200:
                    raise FetchError(f"{url} answered HTTP {response.status_code}")
                body = bytearray()
                for chunk in response.iter_bytes(CHUNK):
                    body += chunk
                    if len(body) > MAX_DOCUMENT_BYTES:
                        raise FetchError(f"{url} answered with over {MAX_DOCUMENT_BYTES >> 20} MiB: not a manifest")
                return bytes(body)
        except httpx.TransportError as exc:
            raise FetchError(f"cannot read {url}: {_describe(exc)}") from None


def _too_large(url: str, size: int) -> HeaderTooLargeError:
    return HeaderTooLargeError(
        f"{url} declares a GGUF header of at least {size} bytes, over the {MAX_HEADER_BYTES >> 20} MiB "
        "a model's header can need: not read"
    )


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _manifest_url(source: str) -> bool:
    return "/v1/manifests/" in urllib.parse.urlsplit(source).path


def _load_manifest(source: str, ranges: _Ranges) -> Manifest:
    """The manifest in a file or at a URL (not yet checked)."""
    if not is_url(source):
        try:
            text = Path(source).read_bytes()
        except OSError as exc:
            raise ManifestError(f"cannot read the manifest {source}: {exc}") from None
        return Manifest.loads(text, source)
    body = ranges.document(source)
    if body is None:
        raise ManifestError(f"{source} has no manifest (404)")
    return Manifest.loads(body, source)


def _from_tracker(tracker: str, header: bytes, size: int, ranges: _Ranges) -> Manifest:
    """The manifest a tracker serves for the file whose first header is ``header``."""
    listing = ranges.document(f"{tracker}/v1/manifests")
    if listing is None:
        raise ManifestError(f"{tracker} serves no manifests (is it a tracker?)")
    digest = hashlib.sha256(header).hexdigest()
    try:
        entries = json.loads(listing)["manifests"]
        found = [
            e["artifact"] for e in entries if e["parts"][0]["header_sha256"] == digest and e["parts"][0]["size"] == size
        ]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ManifestError(f"{tracker}/v1/manifests is not a list of manifests") from None
    if not found:
        raise ManifestError(f"{tracker} serves no manifest for this file (its header has sha256 {digest[:16]}…)")
    body = ranges.document(f"{tracker}/v1/manifests/{found[0]}")
    if body is None:
        raise ManifestError(f"{tracker} lists the manifest of {found[0][:16]}… but does not serve it")
    return Manifest.loads(body, f"{tracker}/v1/manifests/{found[0]}")


def _check_part(manifest: Manifest, number: int, url: str, gguf: ggufio.GGUFFile, header: bytes, size: int) -> None:
    """Refuse a part file that is not the one the manifest describes."""
    part = manifest.parts[number]
    if size != part.size or hashlib.sha256(header).hexdigest() != part.header_sha256:
        raise FetchError(
            f"{url} is not the file the manifest of {manifest.artifact[:16]}… describes "
            f"({part.file}: {part.size} bytes, header sha256 {part.header_sha256[:16]}…)"
        )
    listed = [(t.name, t.ggml_type, t.shape, t.offset, t.n_bytes) for t in manifest.tensors if t.part == number]
    found = [(t.name, t.ggml_type, t.shape, t.offset, t.n_bytes) for t in gguf.tensors]
    if listed != found:
        raise ManifestError(f"the manifest of {manifest.artifact[:16]}… lists other tensors than {url} holds")


@attrs.frozen
class _Piece:
    """The bytes of one tensor still to fetch."""

    tensor: ManifestTensor
    dest: int  # where the tensor's first byte goes in the shard file
    start: int  # the first byte still wanted, absolute in its part's file

    @property
    def end(self) -> int:
        return self.tensor.offset + self.tensor.n_bytes


@attrs.frozen
class _Span:
    """One range request: contiguous wanted tensors of one part (and the small gaps between them)."""

    part: int
    pieces: tuple[_Piece, ...]

    @property
    def start(self) -> int:
        return self.pieces[0].start

    @property
    def end(self) -> int:
        return self.pieces[-1].end


def _spans(pieces: Sequence[_Piece]) -> list[_Span]:
    spans: list[list[_Piece]] = []
    for piece in sorted(pieces, key=lambda p: (p.tensor.part, p.start)):
        last = spans[-1][-1] if spans else None
        if last is not None and last.tensor.part == piece.tensor.part and piece.start - last.end <= MERGE_GAP:
            spans[-1].append(piece)
        else:
            spans.append([piece])
    return [_Span(group[0].tensor.part, tuple(group)) for group in spans]


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".verified")


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def _require_trust(url: str, publisher: bytes | None, trust_source: bool) -> None:
    """Refuse, before any request, a pull whose manifest nothing vouches for."""
    if publisher is None and not trust_source:
        raise UntrustedManifestError(UNTRUSTED_MANIFEST.format(url=url))
    if publisher is None:
        log.warning("%s: accepting a manifest signed by any key, on the word of its source", url)


def _manifest_and_header(
    url: str, manifest_source: str, publisher: bytes | None, ranges: _Ranges
) -> tuple[Manifest, ggufio.GGUFFile, bytes]:
    """The checked manifest of the model at ``url`` and its first file's header, which the manifest names
    and which, with the manifest's tensor index, gives its artifact."""
    if is_url(manifest_source) and not _manifest_url(manifest_source):
        # a tracker finds the manifest by the file's header, which is read first
        gguf, header = ranges.header(url, None)
        manifest = _from_tracker(manifest_source, header, ranges.sizes[url], ranges).check(publisher)
    else:
        manifest = _load_manifest(manifest_source, ranges).check(publisher)
        gguf, header = ranges.header(url, manifest.parts[0].data_offset)
    _check_part(manifest, 0, url, gguf, header, ranges.sizes[url])
    if artifacts.fingerprint_of(gguf, manifest.index()) != manifest.artifact:
        raise ManifestError(
            f"the metadata of {url} and the manifest's tensor index do not give the manifest's artifact "
            f"{manifest.artifact[:16]}…"
        )
    return manifest, gguf, header


def pull_layers(
    url: str,
    layers: LayerRange,
    manifest_source: str | None,
    out_dir: str | os.PathLike[str],
    *,
    publisher: bytes | None = None,
    trust_source: bool = False,
    progress: bool = False,
    retries: int = 4,
    backoff: float = 1.0,
    timeout: float = 30.0,
) -> PulledShard:
    """Fetch the shard file of ``layers`` of the model at ``url`` into ``out_dir``, verified.

    ``manifest_source``: a manifest file, a manifest's URL, or a tracker's URL (the tracker
    serves the manifest of the file's header). ``publisher``: the only key whose manifest
    is accepted; without it, ``trust_source`` must say to accept any valid signature (on
    the word of the manifest's source), else :class:`UntrustedManifestError` before any
    request. A shard fetched and verified before
    (for the same URL and range, against the same artifact) is reused without a byte read.
    ``retries``: how many times in a row a request that brought nothing is asked again,
    ``backoff`` seconds apart, doubling, before the pull stops (and keeps what it verified).
    """
    if not is_url(url):
        raise FetchError(f"{url!r} is not an http:// or https:// URL")
    if manifest_source is None:
        raise FetchError(NO_MANIFEST)
    _require_trust(url, publisher, trust_source)
    source = _Source.of(url)
    out = Path(out_dir)
    target = out / artifacts.shard_file_name(source.stem, layers)
    with (
        folder_turn(out),
        httpx.Client(follow_redirects=True, timeout=httpx.Timeout(timeout)) as client,
    ):
        ranges = _Ranges(client, retries=retries, backoff=backoff)
        reused = _reuse(target, source, layers, manifest_source, publisher, ranges)
        if reused is not None:
            return reused
        return _Pull(source, layers, target, ranges, progress).run(manifest_source, publisher)


@attrs.frozen
class HeaderCopy:
    """A sparse copy of a model's header (:func:`header_copy`) and the artifact its manifest names."""

    path: Path
    artifact: str


def header_copy(
    url: str,
    out_dir: str | os.PathLike[str],
    manifest_source: str,
    *,
    publisher: bytes | None = None,
    trust_source: bool = False,
    timeout: float = 30.0,
) -> HeaderCopy:
    """A sparse copy of the model at ``url``: its GGUF header read by range, the rest a hole of the file's size.

    What sizing a shard needs (the memory planner's dry run reads the header only), without
    fetching the weights. The header must be the one the manifest (checked as
    :func:`pull_layers` checks it) names: the manifest gives the artifact, which covers
    bytes a header copy does not hold. A model stored as parts is not copied (its layers
    span files).
    """
    if not is_url(url):
        raise FetchError(f"{url!r} is not an http:// or https:// URL")
    _require_trust(url, publisher, trust_source)
    source = _Source.of(url)
    if source.count > 1:
        raise FetchError(f"{url} is part 1 of {source.count}: size a split model's range by hand, with --layers")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"{source.stem}.header.gguf"
    with httpx.Client(follow_redirects=True, timeout=httpx.Timeout(timeout)) as client:
        ranges = _Ranges(client, retries=2, backoff=0.5)
        manifest, _gguf, header = _manifest_and_header(url, manifest_source, publisher, ranges)
    partial = target.with_name(target.name + ".part")
    try:
        with open(partial, "wb") as f:
            f.write(header)
            f.truncate(manifest.parts[0].size)  # a hole: no disk block is allocated for it
    except OSError as exc:
        partial.unlink(missing_ok=True)
        raise FetchError(f"cannot write a header copy of {url} of {manifest.parts[0].size} bytes: {exc}") from None
    partial.replace(target)
    return HeaderCopy(target, manifest.artifact)


def _reuse(
    target: Path, source: _Source, layers: LayerRange, manifest_source: str, publisher: bytes | None, ranges: _Ranges
) -> PulledShard | None:
    """The shard fetched before for this URL and range, if its manifest still names its artifact."""
    marker = _read_json(_marker(target))
    if marker is None or marker.get("url") != source.url or marker.get("layers") != str(layers):
        return None
    try:
        stat = target.stat()
    except OSError:
        return None
    if marker.get("size") != stat.st_size or marker.get("mtime_ns") != stat.st_mtime_ns:
        return None  # changed since it was verified
    artifact = str(marker.get("artifact"))
    if is_url(manifest_source) and not _manifest_url(manifest_source):
        body = ranges.document(f"{manifest_source}/v1/manifests/{artifact}")
        if body is None:
            return None
        manifest = Manifest.loads(body, manifest_source)
    else:
        manifest = _load_manifest(manifest_source, ranges)
    if manifest.artifact != artifact:
        return None
    manifest.check(publisher)
    return PulledShard(target, artifact, layers, manifest.publisher, 0, reused=True)


class _Pull:
    """One pull of one range, from the manifest to the renamed shard file."""

    def __init__(self, source: _Source, layers: LayerRange, target: Path, ranges: _Ranges, progress: bool) -> None:
        self.source = source
        self.layers = layers
        self.target = target
        self.partial = target.with_name(target.name + ".fetch")
        self.state_path = target.with_name(target.name + ".fetch.json")
        self.ranges = ranges
        self.progress = progress
        self.done: dict[str, int] = {}  # tensor name -> bytes of it written (all of it: verified)
        self.hashers: dict[str, Any] = {}
        self.unsaved = 0  # bytes written since the state was last saved

    def run(self, manifest_source: str, publisher: bytes | None) -> PulledShard:
        first = self.source.url
        manifest, gguf, _header = _manifest_and_header(first, manifest_source, publisher, self.ranges)
        if len(manifest.parts) != self.source.count:
            raise FetchError(
                f"{first} names a model in {self.source.count} file(s); its manifest lists {len(manifest.parts)}"
            )
        wanted = self._wanted(manifest, gguf)
        for number in sorted({t.part for t in wanted} - {0}):
            url = self.source.part_url(number)
            part, part_header = self.ranges.header(url, manifest.parts[number].data_offset)
            _check_part(manifest, number, url, part, part_header, self.ranges.sizes[url])
        fields = artifacts.shard_fields(artifacts.model_fields(gguf), self.layers, manifest.artifact, manifest.index())
        infos = [ggufio.TensorInfo(t.name, t.shape, t.ggml_type, t.offset, t.n_bytes) for t in wanted]
        planned = ggufio.layout(fields, infos, alignment=gguf.alignment)
        validators = [self.ranges.validators.get(self.source.part_url(n), "") for n in range(self.source.count)]
        self._open(manifest, planned, wanted, validators)
        try:
            self._fetch(manifest, planned, wanted)
        finally:
            self._save(manifest, planned, validators)
        self._verify(manifest, planned, wanted)
        return PulledShard(self.target, manifest.artifact, self.layers, manifest.publisher, self.ranges.received, False)

    def _wanted(self, manifest: Manifest, gguf: ggufio.GGUFFile) -> list[ManifestTensor]:
        if manifest.architecture not in artifacts.SUPPORTED_ARCHITECTURES:
            raise FetchError(f"architecture {manifest.architecture!r} is not supported for layer ranges")
        if gguf.get(f"{manifest.architecture}.block_count") != manifest.n_layer:
            raise ManifestError(f"the manifest's layer count {manifest.n_layer} is not the file's")
        try:
            self.layers.check_within(manifest.n_layer)
        except ValueError as exc:
            raise FetchError(str(exc)) from None
        tied = artifacts.tied_output(manifest.index())
        return [t for t in manifest.tensors if artifacts.tensor_belongs(t.name, self.layers, manifest.n_layer, tied)]

    def _open(
        self, manifest: Manifest, planned: ggufio.Layout, wanted: list[ManifestTensor], validators: list[str]
    ) -> None:
        """Go on from a partial file of this very shard, or start one: its header written, the rest zeros."""
        state = _read_json(self.state_path)
        same = (
            state is not None
            and state.get("url") == self.source.url
            and state.get("artifact") == manifest.artifact
            and state.get("layers") == str(self.layers)
            and state.get("layout_sha256") == hashlib.sha256(planned.header).hexdigest()
            and self.partial.is_file()
            and self.partial.stat().st_size == planned.size
        )
        if state is not None and same:
            sizes = {t.name: t.n_bytes for t in wanted}
            parts = {t.name: t.part for t in wanted}
            before = state.get("validators", [])
            for name, count in dict(state.get("done", {})).items():
                if name not in sizes or type(count) is not int or not 0 < count <= sizes[name]:
                    continue
                unchanged = parts[name] < len(before) and before[parts[name]] == validators[parts[name]]
                if count < sizes[name] and not unchanged:
                    continue  # the file changed since: the bytes of a tensor not yet verified may be the old file's
                self.done[name] = count
            log.info("%s: going on from %d verified or begun tensors", self.partial, len(self.done))
            return
        self.partial.parent.mkdir(parents=True, exist_ok=True)
        with self.partial.open("wb") as f:
            f.write(planned.header)
            f.truncate(planned.size)  # padding and tensors not yet fetched read as zeros

    def _fetch(self, manifest: Manifest, planned: ggufio.Layout, wanted: list[ManifestTensor]) -> None:
        from tqdm import tqdm  # here, not at the top: 20 ms of every process start

        dests = {t.name: offset for t, offset in zip(wanted, planned.offsets, strict=True)}
        pieces = [
            _Piece(t, dests[t.name], t.offset + self.done.get(t.name, 0))
            for t in wanted
            if self.done.get(t.name, 0) < t.n_bytes
        ]
        with (
            open(self.partial, "r+b") as out,
            tqdm(
                total=sum(t.n_bytes for t in wanted),
                initial=sum(self.done.values()),
                unit="B",
                unit_scale=True,
                desc=f"fetch layers {self.layers}",
                disable=not self.progress,
            ) as bar,
        ):
            fd = out.fileno()
            for piece in pieces:  # a tensor begun by an earlier run: its hash goes on from its bytes on disk
                begun = self.done.get(piece.tensor.name, 0)
                if begun:
                    self.hashers[piece.tensor.name] = hashlib.sha256(os.pread(fd, begun, piece.dest))
            for span in _spans(pieces):
                self._fetch_span(span, fd, bar.update, lambda: self._save(manifest, planned, None, fd))

    def _fetch_span(self, span: _Span, fd: int, advance: Callable[[int], object], save: Callable[[], None]) -> None:
        """Fetch one span into the partial file, checking each tensor as its last byte comes."""
        url = self.source.part_url(span.part)
        cursor = 0  # the first piece of the span not yet complete

        def sink(offset: int, chunk: bytes) -> None:
            nonlocal cursor
            end = offset + len(chunk)
            view = memoryview(chunk)
            while cursor < len(span.pieces):
                piece = span.pieces[cursor]
                tensor = piece.tensor
                # bytes before what it holds: a gap between tensors, or a tensor's bytes a retry sends again
                a, b = max(offset, tensor.offset + self.done.get(tensor.name, 0)), min(end, piece.end)
                if a >= end:
                    break
                if a < b:
                    os.pwrite(fd, view[a - offset : b - offset], piece.dest + (a - tensor.offset))
                    self.hashers.setdefault(tensor.name, hashlib.sha256()).update(view[a - offset : b - offset])
                    self.done[tensor.name] = b - tensor.offset
                    advance(b - a)
                    self.unsaved += b - a
                if b < piece.end:
                    break
                self._finish(tensor, url)
                cursor += 1
            if self.unsaved >= SAVE_EVERY:
                save()
                self.unsaved = 0

        self.ranges.read(url, span.start, span.end, sink)
        if cursor < len(span.pieces):
            raise FetchError(f"{url} ended before the tensor {span.pieces[cursor].tensor.name}")

    def _finish(self, tensor: ManifestTensor, url: str) -> None:
        digest = self.hashers.pop(tensor.name).hexdigest()
        if digest != tensor.sha256:
            self.done.pop(tensor.name, None)
            raise FetchError(
                f"tensor {tensor.name} from {url} does not have the sha256 the manifest of "
                f"{self.target.name} names: the served file is damaged or another model; it was not kept"
            )

    def _save(self, manifest: Manifest, planned: ggufio.Layout, validators: list[str] | None, fd: int = -1) -> None:
        """Record what was fetched, once it is on the disk: the next run goes on from there."""
        if fd >= 0:
            os.fsync(fd)
        elif self.partial.exists():
            with open(self.partial, "r+b") as f:
                os.fsync(f.fileno())
        if validators is None:
            validators = [self.ranges.validators.get(self.source.part_url(n), "") for n in range(self.source.count)]
        _write_json(
            self.state_path,
            {
                "url": self.source.url,
                "artifact": manifest.artifact,
                "layers": str(self.layers),
                "layout_sha256": hashlib.sha256(planned.header).hexdigest(),
                "validators": validators,
                "done": self.done,
            },
        )

    def _verify(self, manifest: Manifest, planned: ggufio.Layout, wanted: list[ManifestTensor]) -> None:
        """Check every tensor again from the disk and the whole file as a shard, then give it its name."""
        with open(self.partial, "rb") as f:
            for tensor, dest in zip(wanted, planned.offsets, strict=True):
                digest = hashlib.sha256()
                for at in range(dest, dest + tensor.n_bytes, CHUNK):
                    digest.update(os.pread(f.fileno(), min(CHUNK, dest + tensor.n_bytes - at), at))
                if digest.hexdigest() != tensor.sha256:
                    self.done.pop(tensor.name, None)
                    self._save(manifest, planned, None)
                    raise FetchError(f"{self.partial}: tensor {tensor.name} changed on the disk; run again to fetch it")
        info = artifacts.inspect(self.partial)
        if info.fingerprint != manifest.artifact or info.layer_range != self.layers:
            raise FetchError(f"{self.partial} is not the shard {self.layers} of {manifest.artifact[:16]}…")
        os.replace(self.partial, self.target)
        stat = self.target.stat()
        _write_json(
            _marker(self.target),
            {
                "url": self.source.url,
                "layers": str(self.layers),
                "artifact": manifest.artifact,
                "publisher": manifest.publisher,
                "size": stat.st_size,
                "mtime_ns": stat.st_mtime_ns,
            },
        )
        self.state_path.unlink(missing_ok=True)


__all__ = [
    "MAX_HEADER_BYTES",
    "NO_MANIFEST",
    "FetchError",
    "HeaderCopy",
    "HeaderTooLargeError",
    "PulledShard",
    "UntrustedManifestError",
    "header_copy",
    "is_url",
    "pull_layers",
]
