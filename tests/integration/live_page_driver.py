#!/usr/bin/python3
"""Drives a headless Chromium over the DevTools protocol (--remote-debugging-pipe: JSON
messages ended by NUL on fds 3 and 4) for live_page_test.cc. Standard library only.

Loads --url once, waits until the JS expression --until-1 is truthy, takes a screenshot
(checked to decode), kill -9's --kill PID, waits (no reload) until --until-2 is truthy, then
ends Chromium by its pid. The waits are a MutationObserver inside the page, not polling.
Prints one line per step ("step: value"); exit 0 when every step passed, 1 with
"error: ..." otherwise."""

import argparse
import base64
import ctypes
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
import zlib

PR_SET_PDEATHSIG = 1


def say(step, value=""):
    print(f"{step}: {value}", flush=True)


class Browser:
    def __init__(self, chromium, profile, size):
        cmd_r, self.cmd_w = os.pipe()
        self.resp_r, resp_w = os.pipe()
        libc = ctypes.CDLL(None, use_errno=True)

        def child_setup():
            # Chromium dies with this driver, however it ends.
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            a, b = os.dup(cmd_r), os.dup(resp_w)  # above 4, so dup2 never maps fd onto itself
            os.dup2(a, 3)
            os.dup2(b, 4)

        args = [chromium, "--headless=new", "--disable-gpu", "--remote-debugging-pipe",
                f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
                "--no-first-run", "--no-default-browser-check", "--disable-extensions",
                "--disable-background-networking", "--disable-sync", "--disable-dev-shm-usage",
                "--mute-audio", "--hide-scrollbars", "about:blank"]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")
        self.proc = subprocess.Popen(args, preexec_fn=child_setup, close_fds=False,
                                     start_new_session=True, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(resp_w)
        self.next_id = 0
        self.buf = b""
        self.events = []
        self.session = None

    def _read_message(self, deadline):
        while b"\0" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from chromium in time")
            ready, _, _ = select.select([self.resp_r], [], [], left)
            if ready:
                chunk = os.read(self.resp_r, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium closed its DevTools pipe")
                self.buf += chunk
        raw, self.buf = self.buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method, params=None, timeout=30, session=True):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self.cmd_w, data):]
        deadline = time.monotonic() + timeout
        while True:
            m = self._read_message(deadline)
            if m.get("id") == self.next_id:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            if "method" in m:
                self.events.append(m)

    def wait_event(self, method, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            for i, m in enumerate(self.events):
                if m.get("method") == method:
                    return self.events.pop(i)
            self.events.append(self._read_message(deadline))

    def evaluate(self, expression, timeout=30):
        r = self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                           "awaitPromise": True}, timeout=timeout + 5)
        if "exceptionDetails" in r:
            raise RuntimeError(f"JS exception: {r['exceptionDetails']}")
        return r.get("result", {}).get("value")

    def close(self):
        """Ends Chromium by its pid: a clean Browser.close first, then SIGKILL to its process
        group (its own session: the renderers and helpers it started)."""
        try:
            self.call("Browser.close", session=False, timeout=5)
        except Exception:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def wait_until(browser, condition, timeout):
    """Resolves with the value of `condition` (a JS expression) once it is truthy: checked now
    and after every change of the DOM."""
    script = """new Promise((resolve) => {
      const check = () => { let v = null; try { v = (%s); } catch (e) {}
                            if (v) { obs.disconnect(); resolve(v); } return v; };
      const obs = new MutationObserver(check);
      if (!check()) obs.observe(document, {subtree: true, childList: true, attributes: true,
                                           characterData: true});
    })""" % condition
    try:
        return browser.evaluate(script, timeout=timeout)
    except TimeoutError:
        text = browser.evaluate("document.body ? document.body.innerText : ''", timeout=5)
        raise TimeoutError(f"the page did not show it within {timeout}s; it shows: {text!r}")


def check_png(data):
    """(width, height, distinct byte values) of an 8-bit RGB(A) PNG, its image data inflated
    and its size checked; raises when it does not decode."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            if depth != 8 or color not in (2, 6):
                raise ValueError(f"unexpected PNG format depth {depth} color {color}")
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
        pos += 12 + length
    pixels = zlib.decompress(idat)
    if not width or len(pixels) != height * (1 + width * channels):
        raise ValueError("PNG image data has the wrong size")
    return width, height, len(set(pixels[::97]))


def screenshot(browser, path, step):
    shot = base64.b64decode(browser.call("Page.captureScreenshot", {"format": "png"})["data"])
    with open(path, "wb") as f:
        f.write(shot)
    w, h, distinct = check_png(shot)
    say(step, f"{w}x{h} {len(shot)} bytes {distinct} distinct")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--chromium", required=True)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--until-1", required=True)
    ap.add_argument("--screenshot", required=True)
    ap.add_argument("--kill", type=int, required=True)
    ap.add_argument("--until-2", required=True)
    ap.add_argument("--timeout", type=float, default=30)
    ap.add_argument("--screenshot-2", help="a second screenshot, once --until-2 holds")
    a = ap.parse_args()
    browser = Browser(a.chromium, a.profile, (1280, 900))
    say("chromium", browser.proc.pid)
    try:
        target = browser.call("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = browser.call("Target.attachToTarget",
                                {"targetId": target["targetId"], "flatten": True}, session=False)
        browser.session = attached["sessionId"]
        browser.call("Page.enable")
        browser.call("Page.navigate", {"url": a.url})
        browser.wait_event("Page.loadEventFired", a.timeout)
        say("loaded", a.url)
        say("shown", wait_until(browser, a.until_1, a.timeout))
        screenshot(browser, a.screenshot, "screenshot")
        # A reload would lose this: the second wait must be met by the same document.
        browser.evaluate("window.__mark = 'no reload'; true")
        os.kill(a.kill, signal.SIGKILL)
        say("killed", a.kill)
        say("then", wait_until(browser, a.until_2, a.timeout))
        if a.screenshot_2:
            screenshot(browser, a.screenshot_2, "screenshot 2")
        say("document", browser.evaluate("window.__mark || 'reloaded'"))
    except Exception as e:  # one line for the test's log
        print(f"error: {type(e).__name__}: {e}", flush=True)
        return 1
    finally:
        browser.close()
        say("chromium ended", browser.proc.returncode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
