"""A real HTTP file server on loopback for tests and benchmarks of ranged pulls, and a gguf-split part writer.

The server answers single-range requests (``Range: bytes=A-B``) with 206, a
``Content-Range`` and an ETag, as a web server or a CDN does; it counts every body byte it
sends, and can be told to misbehave: ignore Range, answer other or fewer bytes than asked,
change the file's ETag after a number of requests, or drop connections mid-body.
"""

from __future__ import annotations

import http.server
import re
import socket
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO

import attrs

from noderuntime.models import gguf as ggufio

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@attrs.define
class Faults:
    """How the server misbehaves (all off by default)."""

    ignore_range: bool = False  # answer 200 with the whole file
    shift: int = 0  # answer the bytes this much further on, and say so in Content-Range
    cap: int | None = None  # answer at most this many bytes, and say so (a legal partial answer)
    change_etag_after: int | None = None  # ranged requests after which the file's ETag changes
    drop_after: int | None = None  # body bytes after which a response's connection is cut
    drops: int = 0  # how many responses are cut so


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: socket.socket | tuple[bytes, socket.socket], client_address: Any) -> None:
        # a client that hangs up on an answer (as a pull does on one it refuses) is no fault here
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class RangeServer:
    """Serves the files of one folder at ``http://127.0.0.1:PORT/NAME``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.faults = Faults()
        self.sent = 0  # body bytes, every response together
        self.sent_by_file: dict[str, int] = {}
        self.requests: list[tuple[str, str]] = []  # (file name, Range header)
        self._ranged = 0
        self._lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                server._answer(self)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def url(self, name: str) -> str:
        """The URL of the file ``name``."""
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{urllib.parse.quote(name)}"

    def reset(self) -> None:
        """Count from zero, and behave."""
        with self._lock:
            self.faults = Faults()
            self.sent = 0
            self.sent_by_file = {}
            self.requests = []
            self._ranged = 0

    def close(self) -> None:
        """Stop serving."""
        self.httpd.shutdown()
        self.httpd.server_close()

    def __enter__(self) -> RangeServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _answer(self, request: http.server.BaseHTTPRequestHandler) -> None:
        name = urllib.parse.unquote(urllib.parse.urlsplit(request.path).path.lstrip("/"))
        path = self.root / name
        if "/" in name or name.startswith(".") or not path.is_file():
            request.send_error(404)
            return
        data_size = path.stat().st_size
        wanted = request.headers.get("Range", "")
        match = _RANGE.match(wanted)
        with self._lock:
            self.requests.append((name, wanted))
            faults = attrs.evolve(self.faults)
            if wanted:
                self._ranged += 1
            generation = int(faults.change_etag_after is not None and self._ranged > faults.change_etag_after)
        etag = f'"{data_size:x}-{path.stat().st_mtime_ns:x}-{generation}"'
        if not wanted or faults.ignore_range or match is None:
            self._send(request, path, name, 200, 0, data_size, {}, etag)
            return
        first = int(match[1])
        last = min(int(match[2]) if match[2] else data_size - 1, data_size - 1)
        if first >= data_size:
            request.send_response(416)
            request.send_header("Content-Range", f"bytes */{data_size}")
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        if faults.cap is not None:
            last = min(last, first + faults.cap - 1)
        first, last = min(first + faults.shift, data_size - 1), min(last + faults.shift, data_size - 1)
        headers = {"Content-Range": f"bytes {first}-{last}/{data_size}"}
        self._send(request, path, name, 206, first, last + 1 - first, headers, etag)

    def _send(
        self,
        request: http.server.BaseHTTPRequestHandler,
        path: Path,
        name: str,
        status: int,
        start: int,
        length: int,
        headers: dict[str, str],
        etag: str,
    ) -> None:
        with self._lock:
            cut = self.faults.drop_after if self.faults.drops > 0 else None
            if cut is not None and cut < length:
                self.faults.drops -= 1
            else:
                cut = None
        request.send_response(status)
        for key, value in {**headers, "Content-Length": str(length), "ETag": etag, "Accept-Ranges": "bytes"}.items():
            request.send_header(key, value)
        request.end_headers()
        budget = length if cut is None else min(length, cut)
        with path.open("rb") as f:
            f.seek(start)
            for chunk in _chunks(f, budget):
                try:
                    request.wfile.write(chunk)
                except OSError:  # the client hung up (it stopped reading a 200, say)
                    request.close_connection = True
                    return
                with self._lock:
                    self.sent += len(chunk)
                    self.sent_by_file[name] = self.sent_by_file.get(name, 0) + len(chunk)
        if cut is not None and cut < length:
            request.wfile.flush()
            request.connection.shutdown(socket.SHUT_RDWR)
            request.close_connection = True


def _chunks(f: BinaryIO, budget: int) -> Iterator[bytes]:
    while budget > 0:
        chunk = f.read(min(budget, 256 << 10))
        if not chunk:
            return
        budget -= len(chunk)
        yield chunk


def write_split_parts(model: Path, out_dir: Path, cuts: list[int]) -> list[Path]:
    """Store ``model`` as gguf-split does: parts holding its tensors in order, cut before each index in ``cuts``.

    The first part carries all the metadata, every part ``split.no`` (uint16, from 0),
    ``split.count`` (uint16) and ``split.tensors.count`` (int32); parts are named
    ``STEM-0000K-of-0000N.gguf``.
    """
    gguf = ggufio.read(model)
    bounds = [0, *cuts, len(gguf.tensors)]
    count = len(bounds) - 1
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    with model.open("rb") as source:
        for number in range(count):
            split_keys = [
                ggufio.scalar_field("split.no", ggufio.UINT16, number),
                ggufio.scalar_field("split.count", ggufio.UINT16, count),
                ggufio.scalar_field("split.tensors.count", ggufio.INT32, len(gguf.tensors)),
            ]
            fields = [f.raw for f in gguf.fields.values()] if number == 0 else []
            tensors = [(t, source) for t in gguf.tensors[bounds[number] : bounds[number + 1]]]
            path = out_dir / f"{model.stem}-{number + 1:05d}-of-{count:05d}.gguf"
            ggufio.write(path, fields + split_keys, tensors, alignment=gguf.alignment if number == 0 else 32)
            paths.append(path)
    return paths
