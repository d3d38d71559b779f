"""The pages the tracker and the gateway serve themselves: the swarm map and the chat page.

Plain HTML, CSS and JavaScript files beside this module (package data, so that an
installed package serves them), with no build step and no third-party script. They load
nothing from elsewhere: every answer carries a Content-Security-Policy that lets a page
run only its own script files and talk only to the process that served it. The scripts
build the page with ``textContent`` alone, so a model name, a node's drift class or a
reply is shown as text, never read as markup.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Collection
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.responses import Response

CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}
POLICY = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self'",
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'self'",
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "content-security-policy": POLICY,
    "x-content-type-options": "nosniff",
    # a status key typed into the address bar must not travel on in a Referer header
    "referrer-policy": "no-referrer",
    # a new version's files are taken as soon as the process serves them
    "cache-control": "no-cache",
}

# may refuse a request for the page: the answer to send instead, or None to serve it
Guard = Callable[[Request], Awaitable[Response | None]]


@functools.cache
def _read(name: str) -> bytes:
    return (resources.files(__name__) / name).read_bytes()


def file_response(name: str, status_code: int = 200) -> Response:
    """One of this package's files, with its content type and the pages' headers."""
    suffix = name[name.rfind(".") :]
    return Response(_read(name), status_code=status_code, media_type=CONTENT_TYPES[suffix], headers=HEADERS)


def add_pages(app: FastAPI, page: str, assets: Collection[str], *, guard: Guard | None = None) -> None:
    """Serve ``page`` at ``/`` and each of ``assets`` at ``/web/NAME``; ``guard`` may refuse the page.

    Only the files named here are served: any other name is a 404, whatever it holds.
    The assets hold no data, so they need no key.
    """
    known = frozenset(assets)
    missing = [name for name in (page, *known) if name[name.rfind(".") :] not in CONTENT_TYPES]
    if missing:
        raise ValueError(f"not a page's file: {missing}")

    @app.get("/", include_in_schema=False)
    async def index(request: Request) -> Response:
        if guard is not None:
            refusal = await guard(request)
            if refusal is not None:
                return refusal
        return file_response(page)

    @app.get("/web/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in known:
            return Response("not found\n", status_code=404, media_type="text/plain; charset=utf-8", headers=HEADERS)
        return file_response(name)
