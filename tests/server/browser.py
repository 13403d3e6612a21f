"""Headless Chromium driven over the DevTools protocol on a pipe (--remote-debugging-pipe).

No driver and no websocket library: Chromium reads JSON commands, each ended by
a NUL byte, from its fd 3 and writes answers and events the same way to fd 4.
The browser is Debian's `chromium` package (the Makefile's test target installs it).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # containers often give /dev/shm only 64 MB
    "--hide-scrollbars",
    "--mute-audio",
)


def find_chromium() -> str | None:
    return next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p),
        None,
    )


def _high_fd(fd: int) -> int:
    """A copy of fd numbered 10 or more, so that `3<&N 4>&M` cannot clobber it."""
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class Browser:
    def __init__(self, binary: str, user_data_dir: Path, log_path: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        fd_in, fd_out = _high_fd(to_browser_r), _high_fd(from_browser_w)
        argv = [binary, *FLAGS, f"--user-data-dir={user_data_dir}", "--remote-debugging-pipe"]
        with log_path.open("wb") as log:
            self.process = subprocess.Popen(
                # bash, not sh: dash takes only one-digit descriptors in redirections.
                ["bash", "-c", f'exec "$@" 3<&{fd_in} 4>&{fd_out} {fd_in}<&- {fd_out}>&-']
                + ["bash", *argv],
                pass_fds=(fd_in, fd_out),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        os.close(fd_in)
        os.close(fd_out)
        self._buffer = b""
        self._next_id = 0

    def call(self, method: str, session: str | None = None, timeout: float = 30, **params: Any):
        """Send one command; return its result (events that arrive meanwhile are dropped)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" in self._buffer:
                raw, self._buffer = self._buffer.split(b"\0", 1)
                answer = json.loads(raw)
                if answer.get("id") == self._next_id:
                    if "error" in answer:
                        raise RuntimeError(f"{method}: {answer['error']}")
                    return answer["result"]
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_browser], [], [], left)[0]:
                raise TimeoutError(f"{method}: no answer in {timeout} s")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"{method}: the browser exited ({self.process.poll()})")
            self._buffer += chunk

    def new_page(self, width: int = 1280, height: int = 1000) -> Page:
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        page = Page(self, session)
        page.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip
        return page

    def close(self) -> None:
        with contextlib.suppress(RuntimeError, TimeoutError, OSError):
            self.call("Browser.close", timeout=5)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._to_browser)
        os.close(self._from_browser)


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def call(self, method: str, timeout: float = 30, **params: Any):
        return self.browser.call(method, self.session, timeout, **params)

    def navigate(self, url: str) -> None:
        self.call("Page.navigate", url=url)

    def evaluate(self, expression: str, timeout: float = 30) -> Any:
        """The value of a JS expression (awaited if it is a promise), as JSON."""
        result = self.call(
            "Runtime.evaluate",
            timeout=timeout + 5,
            expression=expression,
            awaitPromise=True,
            returnByValue=True,
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, condition: str, timeout: float = 30) -> Any:
        """Poll a JS expression every 50 ms until it is truthy; return its value."""
        return self.evaluate(
            f"""new Promise((resolve, reject) => {{
                const deadline = Date.now() + {int(timeout * 1000)};
                (function check() {{
                    let value;
                    try {{ value = ({condition}); }} catch (e) {{ value = undefined; }}
                    if (value) resolve(value);
                    else if (Date.now() > deadline) reject(new Error({json.dumps(condition[:80])}));
                    else setTimeout(check, 50);
                }})();
            }})""",
            timeout,
        )

    def screenshot(self, path: Path) -> None:
        """The whole page, however long, as a PNG."""
        height = self.evaluate("document.documentElement.scrollHeight")
        width = self.evaluate("document.documentElement.scrollWidth")
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
