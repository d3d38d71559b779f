"""Headless Chromium, driven over the W3C WebDriver protocol that ``chromedriver`` speaks, with httpx.

The page tests need a handful of commands (open a URL, run a script, find, click and type
into elements, take a screenshot); they are a few HTTP requests each, so no WebDriver
client library is needed. Debian's ``chromium`` and ``chromium-driver`` packages provide
the two programs (``.ci/run`` installs them).
"""

from __future__ import annotations

import base64
import contextlib
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the key of an element reference, by the standard
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
DRIVERS = ("chromedriver",)


class WebDriverError(RuntimeError):
    """A WebDriver command failed: its error code and message."""

    def __init__(self, error: str, message: str) -> None:
        super().__init__(f"{error}: {message}")
        self.error = error


def locate() -> tuple[str, str] | str:
    """The paths of Chromium and chromedriver, or why they cannot be used here."""
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    driver = next((path for name in DRIVERS if (path := shutil.which(name))), None)
    missing = [what for what, path in (("chromium", browser), ("chromedriver", driver)) if path is None]
    if browser is None or driver is None:
        return f"no {' and no '.join(missing)} on PATH (Debian: apt-get install chromium chromium-driver)"
    return browser, driver


class Browser:
    """One WebDriver session: a headless Chromium window."""

    def __init__(self, http: httpx.Client, session: str) -> None:
        self.http = http
        self.session = session

    def _command(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = self.http.request(method, f"/session/{self.session}{path}", json=body)
        value = response.json().get("value")
        if response.status_code >= 400 or (isinstance(value, dict) and "error" in value):
            raise WebDriverError(str(value.get("error")), str(value.get("message", ""))[:2000])
        return value

    def go(self, url: str) -> None:
        """Open ``url`` and wait for its document to load."""
        self._command("POST", "/url", {"url": url})

    def run(self, script: str, *args: Any) -> Any:
        """The value of ``script``, a function body run in the page (``return`` what is wanted)."""
        return self._command("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, script: str, *args: Any, timeout: float = 15.0, what: str = "") -> Any:
        """Run ``script`` until it returns something truthy, and return that; fail after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.run(script, *args)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"the page did not show {what or script!r} within {timeout} s")
            time.sleep(0.1)

    def element(self, css: str) -> str:
        """The reference of the first element ``css`` selects."""
        found = self._command("POST", "/element", {"using": "css selector", "value": css})
        return str(found[ELEMENT])

    def click(self, css: str) -> None:
        """Click the element ``css`` selects, as a user's pointer does."""
        self._command("POST", f"/element/{self.element(css)}/click", {})

    def type(self, css: str, text: str, *, clear: bool = False) -> None:
        """Type ``text`` into the element ``css`` selects, key by key (``\\ue007`` is Enter)."""
        element = self.element(css)
        if clear:
            self._command("POST", f"/element/{element}/clear", {})
        self._command("POST", f"/element/{element}/value", {"text": text})

    def alert(self) -> str | None:
        """The text of an open alert, or None when there is none."""
        try:
            return str(self._command("GET", "/alert/text"))
        except WebDriverError as exc:
            if exc.error == "no such alert":
                return None
            raise

    def screenshot(self, path: Path) -> None:
        """Save the window as a PNG file."""
        path.write_bytes(base64.b64decode(self._command("GET", "/screenshot")))


@contextlib.contextmanager
def open_browser(
    programs: tuple[str, str], profile: Path, *, width: int = 1280, height: int = 900
) -> Iterator[Browser]:
    """A headless Chromium with a fresh ``profile``, closed (with its driver) on leaving."""
    chromium, chromedriver = programs
    driver = subprocess.Popen([chromedriver, "--port=0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert driver.stdout is not None
        port = None
        for line in driver.stdout:
            found = re.search(r"started successfully on port (\d+)", line)
            if found:
                port = int(found.group(1))
                break
        if port is None:
            raise WebDriverError("session not created", f"chromedriver exited ({driver.wait()}) without a port")
        # what it writes later is read and dropped: a full pipe would stall it
        threading.Thread(target=driver.stdout.read, daemon=True).start()
        options = {
            "binary": chromium,
            "args": [
                "--headless=new",
                "--no-sandbox",  # as root (CI) Chromium starts only without its sandbox
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--force-device-scale-factor=1",
                f"--window-size={width},{height}",
                f"--user-data-dir={profile}",
                "--no-first-run",
                "--no-default-browser-check",
                # a test machine reaches nothing outside: nor should the browser try
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--disable-extensions",
            ],
        }
        capabilities = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as http:
            created = http.post("/session", json=capabilities).json()["value"]
            if "sessionId" not in created:
                raise WebDriverError(str(created.get("error")), str(created.get("message", ""))[:2000])
            browser = Browser(http, created["sessionId"])
            try:
                yield browser
            finally:
                with contextlib.suppress(httpx.HTTPError):
                    http.delete(f"/session/{browser.session}")
    finally:
        driver.terminate()
        try:
            driver.wait(10)
        except subprocess.TimeoutExpired:
            driver.kill()
            driver.wait()
        if driver.stdout is not None:
            driver.stdout.close()
