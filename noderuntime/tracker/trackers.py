"""Several trackers: a node links to each, a client asks the first that answers.

A tracker's state is soft: what the nodes tell it in their registrations and heartbeats,
and the keys it signs tickets with. So a swarm may run more than one, and none is a single
point of failure:

- a node registers and heartbeats with every tracker it is given (``--tracker``,
  repeatable; :class:`TrackerLinks`), trusts the session tickets of each (under the key
  pinned for it: :mod:`noderuntime.access.known_trackers`), and tells each when it leaves;
- a gateway asks the trackers in the order given (:class:`Trackers`): each request goes to
  the first that answers. One that does not (unreachable, timed out, a server error) is
  passed over and rests for a back-off (1 s, doubling to 30 s) before it is asked first
  again, so a dead tracker does not add its timeout to every request. When its rest ends,
  one request alone tries it while the others still pass it over.

A tracker's refusal is its answer, not a failure: a 429 (every route full) is returned
as it is, as the other trackers count the same nodes' slots. A 503 (no route) is passed
on to the next tracker, which may know nodes the first does not (it restarted, and the
nodes have not registered with it again yet); when none has a route the first refusal is
the answer. Everything that names a session (a repair of its route, an audit and the
audit's report) goes to the tracker that issued its ticket, the only one that can read it
(see :mod:`noderuntime.gateway.app` for what a repair does when that one is gone).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import attrs
import httpx
import trio

from noderuntime.access.identity import Identity
from noderuntime.access.known_trackers import KnownTrackers, TrackerKeyChanged
from noderuntime.access.tickets import TicketVerifier
from noderuntime.tracker.client import NodeLoad, TrackerError, TrackerLink, fetch_info
from noderuntime.tracker.messages import Registration

log = logging.getLogger(__name__)

BACKOFF_SECONDS = 1.0  # the first rest of a tracker that did not answer
MAX_BACKOFF_SECONDS = 30.0  # the rest doubles with each failure up to this
KEY_RETRY_SECONDS = 1.0  # between tries for the issuer key of a tracker that does not answer

T = TypeVar("T")


def unanswered(exc: TrackerError) -> bool:
    """Whether ``exc`` says the tracker did not answer (unreachable, a server error, a malformed answer).

    Its refusals are answers: 4xx, and 503, which a tracker sends when it knows no route.
    """
    return exc.status == 0 or (200 <= exc.status < 300) or (exc.status >= 500 and exc.status != 503)


def tracker_urls(urls: str | Sequence[str]) -> tuple[str, ...]:
    """``urls`` (one, or several in order of preference) without trailing slashes or repeats.

    :class:`ValueError` when there is none.
    """
    given = (urls,) if isinstance(urls, str) else tuple(urls)
    cleaned = tuple(dict.fromkeys(url.rstrip("/") for url in given))
    if not cleaned or not all(cleaned):
        raise ValueError("give at least one tracker URL, and no empty one")
    return cleaned


@attrs.frozen
class TrackerStanding:
    """One tracker as a client sees it now."""

    url: str
    failures: int  # in a row; 0 once it answers
    resting_seconds: float  # until it is asked first again (0: it is)
    answered: int
    failed: int


class Trackers:
    """The trackers a client was given, in order of preference; :meth:`ask` asks the first that answers."""

    def __init__(self, urls: str | Sequence[str], *, clock: Callable[[], float] = time.monotonic) -> None:
        """``urls``: one tracker's URL, or several, the preferred first."""
        self.urls = tracker_urls(urls)
        self._clock = clock
        self._failures: dict[str, int] = {}  # in a row, of the trackers that failed last time
        self._rest_until: dict[str, float] = {}
        self._trying: set[str] = set()  # resting trackers whose rest ended, being tried by one request
        self._answered = dict.fromkeys(self.urls, 0)
        self._failed = dict.fromkeys(self.urls, 0)

    @property
    def first(self) -> str:
        """The preferred tracker."""
        return self.urls[0]

    def order(self, among: Sequence[str] | None = None) -> list[str]:
        """The trackers (of ``among``, default all) in the order to ask them now.

        Those that answered last time, or whose rest is over and nobody is trying yet, in the
        order given; then the others, the soonest rested first (asked only when none of the
        first answers).
        """
        now = self._clock()
        candidates = self.urls if among is None else [url.rstrip("/") for url in among]
        ready = [
            url
            for url in candidates
            if url not in self._failures or (self._rest_until[url] <= now and url not in self._trying)
        ]
        resting = sorted((url for url in candidates if url not in ready), key=lambda url: self._rest_until[url])
        return ready + resting

    def answered(self, url: str) -> None:
        """``url`` answered: it is asked first again (in its place in the order)."""
        url = url.rstrip("/")
        self._answered[url] = self._answered.get(url, 0) + 1
        if self._failures.pop(url, None) is not None:
            log.info("the tracker %s answers again", url)
        self._rest_until.pop(url, None)

    def failed(self, url: str, why: object = "") -> None:
        """``url`` did not answer: it rests, longer with each failure in a row."""
        url = url.rstrip("/")
        self._failed[url] = self._failed.get(url, 0) + 1
        failures = self._failures.get(url, 0) + 1
        self._failures[url] = failures
        rest = min(MAX_BACKOFF_SECONDS, BACKOFF_SECONDS * 2 ** (failures - 1))
        self._rest_until[url] = self._clock() + rest
        if failures == 1 and len(self.urls) > 1:
            log.warning("the tracker %s does not answer (%s): asking the others for %g s", url, why, rest)

    async def ask(
        self, call: Callable[[str], Awaitable[T]], *, among: Sequence[str] | None = None, past_no_route: bool = True
    ) -> T:
        """``call(url)`` on the first tracker (of ``among``, default all) that answers it.

        ``call`` raises :class:`TrackerError` for a refusal or no answer. A tracker that does
        not answer (:func:`unanswered`) is passed over and rests; with ``past_no_route`` a 503
        (it knows no route) is passed over too, without rest. When none answers otherwise,
        the first refusal is raised, else the last failure.
        """
        refusal: TrackerError | None = None
        failure: TrackerError | None = None
        for url in self.order(among):
            trying = url in self._failures
            if trying:
                self._trying.add(url)
            try:
                result = await call(url)
            except TrackerError as exc:
                if unanswered(exc):
                    self.failed(url, exc)
                    failure = exc
                    continue
                self.answered(url)
                if past_no_route and exc.status == 503:
                    refusal = refusal or exc
                    continue
                raise
            finally:
                if trying:
                    self._trying.discard(url)
            self.answered(url)
            return result
        if refusal is not None:
            raise refusal
        assert failure is not None  # order() names every tracker of among, and there is one at least
        raise failure

    def statistics(self) -> tuple[TrackerStanding, ...]:
        """Each tracker's standing now, in the order given."""
        now = self._clock()
        return tuple(
            TrackerStanding(
                url,
                self._failures.get(url, 0),
                round(max(0.0, self._rest_until.get(url, now) - now), 3),
                self._answered.get(url, 0),
                self._failed.get(url, 0),
            )
            for url in self.urls
        )


async def issuer_key(client: httpx.AsyncClient, url: str, pins: KnownTrackers) -> bytes:
    """The ticket-issuer key of the tracker at ``url`` (its ``/v1/info``), checked against ``pins``
    (pinned there at first contact).

    :class:`TrackerError` if it does not answer with one; :class:`TrackerKeyChanged` if it shows
    another key than the one pinned for it.
    """
    info = await fetch_info(client, url)
    try:
        key = bytes.fromhex(info["issuer_key"])
    except (KeyError, TypeError, ValueError):
        raise TrackerError(f"{url}/v1/info names no issuer key", 200) from None
    if len(key) != 32:
        raise TrackerError(f"{url}/v1/info names no issuer key", 200)
    pins.accept(url, key)
    return key


async def wait_issuer_key(client: httpx.AsyncClient, url: str, pins: KnownTrackers) -> bytes:
    """The ticket-issuer key of the tracker at ``url``, waiting as long as it does not answer
    (:class:`TrackerKeyChanged` at once if it shows another key than the one pinned)."""
    level = logging.WARNING
    while True:
        try:
            return await issuer_key(client, url, pins)
        except TrackerError as exc:
            # said once: a tracker that stays down must not fill the node's log, a line a second
            log.log(level, "waiting for the tracker at %s: %s", url, exc)
            level = logging.DEBUG
            await trio.sleep(KEY_RETRY_SECONDS)


async def first_issuer_keys(urls: Sequence[str], pins: KnownTrackers) -> dict[str, bytes]:
    """The ticket-issuer keys of the trackers at ``urls`` that answer, by URL, each checked against
    ``pins`` (:class:`TrackerKeyChanged` for one that shows another key than the one pinned).

    Waits for one at least, as long as none answers; the others have until each one's
    first try ended (a tracker that is down costs the node no more than a refused
    connection or one timeout). Those not in the answer are waited for by
    :class:`TrackerLinks`, in the background.
    """
    urls = tracker_urls(urls)
    keys: dict[str, bytes] = {}
    tried: set[str] = set()
    changed = trio.Event()
    refused: list[TrackerKeyChanged] = []

    async def fetch(client: httpx.AsyncClient, url: str) -> None:
        nonlocal changed
        while True:
            try:
                keys[url] = await issuer_key(client, url, pins)
            except TrackerError as exc:
                log.warning("waiting for the tracker at %s: %s", url, exc)
            except TrackerKeyChanged as exc:
                refused.append(exc)  # raised as it is, out of the nursery, for the node's start to fail with
            tried.add(url)
            changed.set()
            if url in keys:
                return
            await trio.sleep(KEY_RETRY_SECONDS)

    async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:
        for url in urls:
            nursery.start_soon(fetch, client, url)
        while not (refused or (keys and len(tried) == len(urls))):
            await changed.wait()
            changed = trio.Event()
        nursery.cancel_scope.cancel()
    if refused:
        raise refused[0]
    for url, key in keys.items():
        log.info("trusting session tickets from the tracker %s: key %s", url, key.hex())
    return keys


class IssuerKeys:
    """The ticket-issuer key of each tracker a client is granted routes by, as the client checks them.

    Asked the first time a tracker's grant is checked (:meth:`key_of`), then kept: a tracker
    that does not answer at the client's start costs nothing until it grants a route.
    """

    def __init__(
        self, http: httpx.AsyncClient | None, pins: KnownTrackers, *, known: Mapping[str, bytes] | None = None
    ) -> None:
        """``http``: the client trackers are asked with; ``pins``: what each must show;
        ``known``: keys given by URL, asked of no tracker (a swarm whose tickets one key signs)."""
        self._http = http
        self._pins = pins
        self._keys = {url.rstrip("/"): key for url, key in (known or {}).items()}

    async def key_of(self, url: str) -> bytes:
        """The key the tracker at ``url`` signs tickets with: :class:`TrackerError` if it does not
        say, :class:`TrackerKeyChanged` if it shows another key than the one pinned for it."""
        url = url.rstrip("/")
        key = self._keys.get(url)
        if key is not None:
            return key
        if self._http is None:
            raise TrackerError(f"no key is known for the tracker {url or '(none named)'}", 200)
        key = await issuer_key(self._http, url, self._pins)
        self._keys[url] = key
        return key


class TrackerLinks:
    """A node's links to each of its trackers, one :class:`TrackerLink` each, run together (:meth:`run`)."""

    def __init__(
        self,
        urls: Sequence[str],
        identity: Identity,
        registration: Registration,
        load: Callable[[], NodeLoad],
        *,
        on_probe: Callable[[int], Awaitable[dict[str, Any]]] | None = None,
        verifier: TicketVerifier | None = None,
        trusted: Mapping[str, bytes] | None = None,
        pins: KnownTrackers | None = None,
    ) -> None:
        """``verifier``: where the node checks tickets; given, the node trusts each tracker's key
        before it registers there (so that no tracker routes to it with tickets it refuses),
        taking it from ``trusted`` (by URL) or, for those not in it, from the tracker when it
        answers, checked against ``pins`` (in memory only when None). None: the node's keys
        were given (``--issuer-key``), and it takes none."""
        self.links = [TrackerLink(url, identity, registration, load, on_probe=on_probe) for url in tracker_urls(urls)]
        self._verifier = verifier
        self._trusted = dict(trusted or {})
        self._pins = pins or KnownTrackers(None)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every link until cancelled; ``started`` once the node registered with one tracker.

        A tracker that does not answer does not hold the others up: its link keeps trying.
        Cancelled, each link tells its tracker the node leaves (:meth:`TrackerLink.run`).
        """
        registered = trio.Event()
        async with trio.open_nursery() as nursery:
            for link in self.links:
                nursery.start_soon(self._run_link, nursery, link, registered)
            await registered.wait()
            task_status.started()

    async def _run_link(self, nursery: trio.Nursery, link: TrackerLink, registered: trio.Event) -> None:
        if self._verifier is not None:
            key = self._trusted.get(link.url)
            if key is None:
                try:
                    async with httpx.AsyncClient() as client:
                        key = await wait_issuer_key(client, link.url, self._pins)
                except TrackerKeyChanged as exc:
                    # refused: neither trusted nor registered with; the node goes on with the others
                    log.error("not joining the tracker %s: %s", link.url, exc)
                    return
                log.info("trusting session tickets from the tracker %s: key %s", link.url, key.hex())
            self._verifier.trust(key)
        await nursery.start(link.run)
        registered.set()

    def slot_freed(self) -> None:
        """A sequence slot of the node freed (see :meth:`TrackerLink.slot_freed`), for each tracker."""
        for link in self.links:
            link.slot_freed()

    def slot_refused(self) -> None:
        """The node refused a session for want of a slot (see :meth:`TrackerLink.slot_refused`), for each tracker."""
        for link in self.links:
            link.slot_refused()

    async def leave(self) -> None:
        """Tell every tracker the node leaves, all at once (each bounded; see :meth:`TrackerLink.leave`)."""
        async with trio.open_nursery() as nursery:
            for link in self.links:
                nursery.start_soon(link.leave)


__all__ = [
    "IssuerKeys",
    "TrackerLinks",
    "TrackerStanding",
    "Trackers",
    "first_issuer_keys",
    "issuer_key",
    "tracker_urls",
    "unanswered",
    "wait_issuer_key",
]
