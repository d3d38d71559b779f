"""The swarm map and the chat page in a real browser: headless Chromium over WebDriver, on a real local system.

The local system's tracker has a status key, its gateway an API key, and the gateway
serves the demo model under a second name that is markup: what the pages show of a
node, a model or a reply must stay text. Without Chromium and chromedriver the browser
tests skip with the reason, unless ``NODERUNTIME_REQUIRE_BROWSER=1`` (``.ci/run`` sets it),
where they fail. ``NODERUNTIME_SCREENSHOTS=DIR`` saves the two pages as PNG files in DIR
(the README shows the ones in ``docs/``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from noderuntime.access.identity import Identity
from noderuntime.access.signing import sign
from noderuntime.control.admission import Capability, capability_record
from noderuntime.engine.llama import Vocab
from noderuntime.services import localsystem
from noderuntime.services.ready import NodeReady, expect
from tests import browser
from tests.conftest import local_system

pytestmark = pytest.mark.slow

WEB = Path(__file__).resolve().parents[1] / "noderuntime" / "web"
STATUS_KEY = "map-key-for-tests"
API_KEY = "sk-chat-page-test"
MARKUP = "<script>alert(1)</script>"  # a model name: `--model NAME=PATH` takes no "=" in NAME
NODE_MARKUP = '<script>alert(2)</script><img src=x onerror="alert(3)">'  # what a node may call its model
SCREENSHOTS = os.environ.get("NODERUNTIME_SCREENSHOTS")


def test_the_pages_scripts_never_read_data_as_markup_and_run_nothing_inline() -> None:
    """What the Content-Security-Policy promises holds in the files: no inline script or style to
    allow, and no call that parses a string as HTML or code."""
    for path in WEB.glob("*.js"):
        text = path.read_text()
        found = re.findall(r"innerHTML|outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function|srcdoc", text)
        assert not found, (path.name, found)
    for path in WEB.glob("*.html"):
        text = path.read_text()
        assert not re.search(r"<script(?![^>]*\bsrc=)|<style|\sstyle=|\son[a-z]+=", text), path.name
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", text), path.name  # nothing from elsewhere


@pytest.fixture(scope="module")
def chromium() -> tuple[str, str]:
    found = browser.locate()
    if isinstance(found, str):
        # .ci/run installs Chromium and sets this: there a page that goes untested is a failure
        if os.environ.get("NODERUNTIME_REQUIRE_BROWSER") == "1":
            pytest.fail(f"{found}; NODERUNTIME_REQUIRE_BROWSER=1 says this machine must run the browser tests")
        pytest.skip(found)
    return found


@pytest.fixture(scope="module")
def system(
    chromium: tuple[str, str], smollm2: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[localsystem.LocalSystem]:
    yield from local_system(
        tmp_path_factory.mktemp("pages"),
        slots=4,
        ctx=1024,
        # nodes beat every second and are dropped after 4 s of silence: the killed node's test waits that long
        tracker_options=("--status-key", STATUS_KEY, "--expire-after", "4", "--heartbeat-seconds", "1"),
        gateway_options=("--api-key", API_KEY, "--model", f"{MARKUP}={smollm2}"),
    )


@pytest.fixture(scope="module")
def page(chromium: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[browser.Browser]:
    with browser.open_browser(chromium, tmp_path_factory.mktemp("chromium")) as opened:
        yield opened


@pytest.fixture(scope="module")
def endless(smollm2: Path) -> dict[str, float]:
    """A ``logit_bias`` that bans every end-of-generation token: a reply runs until stopped."""
    return {str(token): -100.0 for token in Vocab(smollm2).eog_tokens}


def _nodes(system: localsystem.LocalSystem) -> list[NodeReady]:
    return [expect(p.info, NodeReady) for p in system.processes if p.name.startswith("node")]


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as response:
        answer: dict[str, Any] = json.loads(response.read())
        return answer


def _wait_idle(system: localsystem.LocalSystem, within: float) -> None:
    deadline = time.monotonic() + within
    while True:
        states = [_get(node.http + "/status") for node in _nodes(system)]
        if all(s["active_sessions"] == 0 and s["slots_leased"] == 0 and s["kv_cells"] == 0 for s in states):
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.1)


def _screenshot(page: browser.Browser, name: str) -> None:
    if SCREENSHOTS:
        page.screenshot(Path(SCREENSHOTS) / name)


def _nothing_ran(page: browser.Browser) -> None:
    """No markup from the data became an element, and no script of it ran."""
    assert page.alert() is None
    assert page.run("return document.scripts.length") == 1  # the page's own module
    assert page.run("return document.querySelectorAll('body img, body b, body iframe, body object').length") == 0


# what the map shows of one model, read back from the page (None until its card is there)
MAP = """
const artifact = arguments[0];
const card = [...document.querySelectorAll('article.model')].find(a => a.dataset.artifact === artifact);
if (!card) return null;
const numbers = (node, ...keys) => keys.map(k => Number(node.dataset[k]));
return {
  name: card.querySelector('.model-name').textContent,
  strip: [...card.querySelectorAll('.strip .segment')].map(s => numbers(s, 'start', 'end', 'nodes', 'admitted')),
  bare: [...card.querySelectorAll('.strip .segment.level-0')].map(s => numbers(s, 'start', 'end')),
  bands: [...card.querySelectorAll('.bands .band')].map(b => numbers(b, 'start', 'end', 'nodes')),
  routes: [...card.querySelectorAll('.routes .route')].map(r => r.dataset.nodes.split(' ')),
  note: card.querySelector('.strip-note').textContent,
  rows: [...document.querySelectorAll('#nodes tbody tr[data-node-id]')]
    .filter(r => r.dataset.artifact === artifact)
    .map(r => [r.dataset.nodeId, r.dataset.layers, r.cells[1].textContent, r.cells[5].textContent,
               r.cells[9].textContent]),
  departed: [...document.querySelectorAll('#departed li[data-node-id]')].map(li => [li.dataset.nodeId, li.dataset.why]),
};
"""


def _map(page: browser.Browser, artifact: str, ready: str, timeout: float = 15.0) -> dict[str, Any]:
    """The map of ``artifact`` once the JavaScript condition ``ready`` holds of it (``shown``)."""
    script = MAP.replace("return {", "const shown = {", 1) + f"\nreturn ({ready}) ? shown : null;"
    shown: dict[str, Any] = page.wait_for(script, artifact, timeout=timeout, what=ready)
    return shown


def test_the_swarm_map_shows_the_layer_strip_and_each_node_over_its_range(
    page: browser.Browser, system: localsystem.LocalSystem
) -> None:
    head, tail = _nodes(system)
    locked = httpx.get(system.tracker_url + "/")
    assert locked.status_code == 401 and "status key" in locked.text
    page.go(f"{system.tracker_url}/?key={STATUS_KEY}")
    shown = _map(page, head.artifact, "shown.rows.length === 2")
    assert shown["strip"] == [[0, 15, 1, 1], [15, 30, 1, 1]] and shown["bare"] == []
    assert shown["bands"] == [[0, 15, 1], [15, 30, 1]]
    assert shown["rows"] == [
        [head.node_id, "0:15", shown["name"], "direct", "passed"],
        [tail.node_id, "15:30", shown["name"], "relay", "passed"],
    ]
    assert shown["routes"] == [[head.node_id, tail.node_id]]
    assert page.run("return location.search") == ""  # the key left the address bar, kept in memory
    _nothing_ran(page)
    _screenshot(page, "swarm-map.png")


def _register(tracker_url: str, model_name: str) -> str:
    """A node of another model that registers and says no more: its probe stays pending."""
    me = Identity.generate()
    artifact = os.urandom(32).hex()
    body = {
        "node_id": me.node_id.hex(),
        "artifact": artifact,
        "model_name": model_name,
        "n_layer": 8,
        "layers": [0, 8],
        "recipe": "0123456789abcdef",
        "address": "127.0.0.1:9",
        "slots": 2,
        "ctx_per_session": 512,
        "kernel_class": "<i>avx2</i>",
        "capability": capability_record(
            me,
            artifact=artifact,
            layers=(0, 8),
            recipe="0123456789abcdef",
            capability=Capability(2.0, ((1, 10.0), (2, 12.0)), 1, 1, 1, 2),
        ),
    }
    data = json.dumps(body).encode()
    headers = {
        **sign(me, "POST", "/v1/nodes/register", data, int(time.time() * 1000)),
        "content-type": "application/json",
    }
    answer = httpx.post(tracker_url + "/v1/nodes/register", content=data, headers=headers, timeout=10)
    assert answer.status_code == 200, answer.text
    return artifact


def test_what_a_node_calls_its_model_is_text_on_the_map(page: browser.Browser, system: localsystem.LocalSystem) -> None:
    artifact = _register(system.tracker_url, NODE_MARKUP)
    page.go(f"{system.tracker_url}/?key={STATUS_KEY}")
    shown = _map(page, artifact, "shown.rows.length === 1")
    assert shown["name"] == NODE_MARKUP and shown["rows"][0][2] == NODE_MARKUP
    assert shown["rows"][0][4] == "pending"  # the tracker holds no probe for it: it stays out of routes
    assert (
        page.run(
            "return document.querySelector('#nodes tr[data-artifact=\"' + arguments[0] + '\"] .drift').textContent",
            artifact,
        )
        == "<i>avx2</i>"
    )
    _nothing_ran(page)
    assert page.run("return document.querySelectorAll('body i').length") == 0


def _open_chat(page: browser.Browser, system: localsystem.LocalSystem, model: str, **settings: str) -> None:
    """The chat page with the key typed in, ``model`` chosen and ``settings`` (by field id) filled in."""
    page.go(system.gateway_url + "/")
    page.wait_for("return document.getElementById('notice').textContent.includes('needs an API key')")
    page.type("#key", API_KEY + "\ue007")  # Enter
    listed = page.wait_for(
        "const o = [...document.querySelectorAll('#model option')]; return o.length && o.map(x => x.textContent)"
    )
    assert sorted(listed) == sorted([system.model_id, MARKUP])
    page.click(f"#model option[value='{model}']")
    page.click("#settings summary")
    for field, value in settings.items():
        page.type(f"#{field}", value, clear=True)


# every change to the reply's text, with the reply's state then: evidence that it streamed in
WATCH = """
window.seen = [];
new MutationObserver(() => {
  const reply = document.querySelector('.message.assistant');
  if (reply) window.seen.push([reply.querySelector('.text').textContent.length, reply.dataset.state]);
}).observe(document.getElementById('conversation'), {subtree: true, childList: true, characterData: true});
"""
REPLY = """
const reply = document.querySelector('.message.assistant');
if (!reply || reply.dataset.state === arguments[0]) return null;
return {
  state: reply.dataset.state,
  who: reply.querySelector('.who').textContent,
  text: reply.querySelector('.text').textContent,
  meta: reply.querySelector('.meta').textContent,
  hops: [...reply.querySelectorAll('.meta .hop')].map(h => h.dataset.nodeId),
  rate: reply.querySelector('.meta .rate') && Number(reply.querySelector('.meta .rate').dataset.tokensPerS),
};
"""


def _reply(page: browser.Browser, timeout: float = 60.0) -> dict[str, Any]:
    """The last reply, once it is no longer streaming."""
    found: dict[str, Any] = page.wait_for(REPLY, "streaming", timeout=timeout, what="the reply's end")
    return found


def test_the_chat_page_streams_a_reply_and_names_the_nodes_that_served_it(
    page: browser.Browser, system: localsystem.LocalSystem
) -> None:
    _open_chat(page, system, system.model_id, **{"max-tokens": "24", "temperature": "0"})
    page.run(WATCH)
    page.type("#message", "Name three colours.")
    page.click("#send")
    reply = _reply(page)
    assert reply["state"] == "done", reply
    # the same request through the API, as the page sent it: the page showed every piece of it
    body = {
        "model": system.model_id,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 24,
        "temperature": 0,
    }
    whole = httpx.post(
        system.gateway_url + "/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=60,
    ).json()
    assert reply["text"] == whole["choices"][0]["message"]["content"] and reply["text"]
    seen = page.run("return window.seen")
    streaming = [length for length, state in seen if state == "streaming" and length]
    assert streaming and min(streaming) < len(reply["text"]), seen  # text appeared before the end
    assert reply["hops"] == [n.node_id[:16] for n in _nodes(system)]
    assert reply["rate"] > 0 and "tokens/s" in reply["meta"]
    # the key was typed into the page and kept in its memory only
    assert page.run("return [localStorage.length, sessionStorage.length, document.cookie]") == [0, 0, ""]
    _nothing_ran(page)
    page.click("#settings summary")  # folded again: the conversation is what a reader looks at
    _screenshot(page, "chat-page.png")


def test_stop_ends_the_route_session_on_every_node(
    page: browser.Browser, system: localsystem.LocalSystem, endless: dict[str, float]
) -> None:
    _wait_idle(system, within=10)
    cancelled = _get(system.gateway_url + "/status")["counters"]["cancelled"]
    _open_chat(page, system, system.model_id, **{"max-tokens": "900", "extra": json.dumps({"logit_bias": endless})})
    page.type("#message", "Tell me about the sea.")
    page.click("#send")
    page.wait_for("return document.querySelector('.message.assistant .text').textContent.length > 20")
    assert all(_get(node.http + "/status")["active_sessions"] == 1 for node in _nodes(system))
    page.click("#stop")
    assert _reply(page, timeout=10)["state"] == "stopped"
    _wait_idle(system, within=10)  # every node released the session's slot and its KV
    assert _get(system.gateway_url + "/status")["counters"]["cancelled"] == cancelled + 1
    assert page.run("return [document.getElementById('send').disabled, document.getElementById('stop').disabled]") == [
        False,
        True,
    ]


def test_markup_in_a_model_name_or_a_reply_is_text(page: browser.Browser, system: localsystem.LocalSystem) -> None:
    forced = f"{MARKUP} & <b>bold</b>"
    _open_chat(page, system, MARKUP, extra=json.dumps({"guided_choice": [forced]}))
    page.type("#message", "<b>Say</b> it")
    page.click("#send")
    reply = _reply(page)
    assert reply["state"] == "done" and reply["who"] == MARKUP and reply["text"] == forced, reply
    assert page.run("return document.querySelector('.message.user .text').textContent") == "<b>Say</b> it"
    _nothing_ran(page)


def test_the_map_follows_a_killed_node_without_a_reload(page: browser.Browser, system: localsystem.LocalSystem) -> None:
    """Last: the system has lost a node for good after it."""
    head, tail = _nodes(system)
    page.go(f"{system.tracker_url}/?key={STATUS_KEY}")
    _map(page, head.artifact, "shown.rows.length === 2")
    page.run("window.sameDocument = true")
    victim = next(p for p in system.processes if p.name == "node1")
    victim.signal(signal.SIGKILL)
    # the tracker drops it once it has missed its heartbeats (4 s), and the page polls; the
    # strip comes from the swarm's status, which the tracker computes at most once a second,
    # so it may follow the node list by a poll
    shown = _map(page, head.artifact, "shown.rows.length === 1 && shown.bare.length === 1", timeout=40)
    assert shown["strip"] == [[0, 15, 1, 1], [15, 30, 0, 0]] and shown["bare"] == [[15, 30]]
    assert "Not served" in shown["note"] and shown["routes"] == []
    assert [tail.node_id, "expired"] in shown["departed"]
    assert page.run("return window.sameDocument") is True
