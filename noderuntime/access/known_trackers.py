"""The trackers' keys a node or gateway has met, pinned on first use, as SSH's ``known_hosts``.

A tracker's key signs the session tickets that decide who serves whom, so whoever could
answer for a tracker URL (anyone between a node or gateway and an ``http://`` tracker)
could hand out routes of their own. So the key a tracker shows at first contact is kept
in the data directory (``known_trackers``: one line ``URL KEY`` per tracker, URLs
normalised) and every later contact must show the same: a changed key is refused with
:class:`TrackerKeyChanged`, whose message says how to accept it on purpose
(``--tracker-key URL=KEY``, which also pins a key without any first contact). An
``https://`` tracker is further checked by its certificate, as a browser checks it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from noderuntime.access.identity import IdentityError, load_public_key

FILE = "known_trackers"
_DEFAULT_PORTS = {"http": 80, "https": 443}

log = logging.getLogger(__name__)


class KnownTrackersError(ValueError):
    """A ``known_trackers`` file or a ``--tracker-key`` that cannot be read."""


class TrackerKeyChanged(ValueError):
    """A tracker showed another key than the one pinned for its URL (refused input: the command exits with it)."""

    def __init__(self, url: str, pinned: bytes, shown: bytes, where: str) -> None:
        super().__init__(
            f"the tracker at {url} shows the key {shown.hex()}, not the key {pinned.hex()} {where}: someone may be "
            f"answering in its place. If its operator changed its key on purpose, accept the new one with "
            f"--tracker-key {url}={shown.hex()}"
        )
        self.url = url
        self.pinned = pinned
        self.shown = shown


def normalise(url: str) -> str:
    """``url`` as pins name it: scheme and host in lower case, no default port, no trailing slash."""
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError:
        raise KnownTrackersError(f"{url!r:.100} is not a tracker URL") from None
    if parts.scheme.lower() not in _DEFAULT_PORTS or not parts.hostname:
        raise KnownTrackersError(f"{url!r:.100} is not an http:// or https:// URL with a host")
    scheme = parts.scheme.lower()
    host = parts.hostname.lower()
    host = f"[{host}]" if ":" in host else host
    netloc = host if port is None or port == _DEFAULT_PORTS[scheme] else f"{host}:{port}"
    return urlunsplit((scheme, netloc, parts.path.rstrip("/"), parts.query, ""))


def parse_given(values: Sequence[str], trackers: Sequence[str]) -> dict[str, bytes]:
    """``--tracker-key`` values (``URL=KEY``, or a bare ``KEY`` when one tracker is given) by normalised URL.

    KEY is 64 hex digits or a file holding them. :class:`KnownTrackersError` for one that is not.
    """
    given: dict[str, bytes] = {}
    for value in values:
        url, sep, key = value.rpartition("=")
        if not sep:
            if len(trackers) != 1:
                raise KnownTrackersError(
                    f"--tracker-key {value!r:.80}: with {len(trackers)} --tracker URLs, name the tracker: URL=KEY"
                )
            url, key = trackers[0], value
        try:
            given[normalise(url)] = load_public_key(key)
        except IdentityError as exc:
            raise KnownTrackersError(f"--tracker-key {value!r:.120}: {exc}") from None
    return given


class KnownTrackers:
    """The keys pinned for tracker URLs, kept in a file (or, without one, in memory for this process)."""

    def __init__(self, path: Path | None, given: Mapping[str, bytes] | None = None) -> None:
        """``path``: the ``known_trackers`` file (made on first pin); ``given``: keys from ``--tracker-key``
        by URL, pinned now in place of any other (no contact needed)."""
        self.path = path
        self._given = {normalise(url): key for url, key in (given or {}).items()}
        self._pins = self._load() if path is not None else {}
        if self._given and any(self._pins.get(url) != key for url, key in self._given.items()):
            for url, key in self._given.items():
                if self._pins.get(url) not in (None, key):
                    log.warning("the tracker %s: its pinned key is replaced by --tracker-key %s", url, key.hex())
            self._pins.update(self._given)
            self._save()

    @classmethod
    def in_data_dir(cls, data_dir: str | os.PathLike[str], given: Mapping[str, bytes] | None = None) -> KnownTrackers:
        """The pins kept in ``data_dir``'s ``known_trackers``."""
        return cls(Path(data_dir) / FILE, given)

    def pinned(self, url: str) -> bytes | None:
        """The key pinned for ``url``, if any."""
        return self._pins.get(normalise(url))

    def accept(self, url: str, key: bytes) -> None:
        """Check that the tracker at ``url`` showed ``key``: the pinned key, or at first contact pin it.

        :class:`TrackerKeyChanged` when another key is pinned for ``url``.
        """
        name = normalise(url)
        pinned = self._pins.get(name)
        if pinned is None:
            self._pins[name] = key
            self._save()
            # said once per tracker, as ssh says it adds a host: a key pinned by mistake is found here
            level = logging.WARNING if self.path is not None else logging.INFO
            log.log(level, "the tracker %s: pinned its key %s at first contact (in %s)", name, key.hex(), self._where())
            return
        if pinned != key:
            where = "given by --tracker-key" if name in self._given else f"pinned at first contact in {self._where()}"
            raise TrackerKeyChanged(name, pinned, key, where)

    def _where(self) -> str:
        return str(self.path) if self.path is not None else "this process's memory"

    def _load(self) -> dict[str, bytes]:
        assert self.path is not None
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as exc:
            raise KnownTrackersError(f"cannot read {self.path}: {exc}") from None
        pins: dict[str, bytes] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            try:
                url, key = line.split()
                pins[normalise(url)] = load_public_key(key)
            except (ValueError, IdentityError):
                raise KnownTrackersError(f"{self.path}:{number}: expected 'URL KEY', got {line!r:.120}") from None
        return pins

    def _save(self) -> None:
        """Write the pins beside the file and rename it into place (a crash never leaves half a file)."""
        if self.path is None:
            return
        lines = ["# tracker URL, and the ticket-issuer key it showed first (or --tracker-key gave)"]
        lines += [f"{url} {key.hex()}" for url, key in sorted(self._pins.items())]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            raise KnownTrackersError(f"cannot keep the trackers' keys in {self.path}: {exc}") from None


__all__ = ["FILE", "KnownTrackers", "KnownTrackersError", "TrackerKeyChanged", "normalise", "parse_given"]
