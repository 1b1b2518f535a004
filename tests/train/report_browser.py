#!/usr/bin/env python3
"""Opens an HTML page in headless Chromium and reports what a browser saw, as one JSON object.

Drives Chromium through the DevTools protocol over --remote-debugging-pipe (fd 3: commands in,
fd 4: messages out, each a JSON text ended by NUL), so nothing but the standard library is needed.
Reported:
  requests    every URL the page asked for (Network.requestWillBeSent, blocked ones included)
  console     console.* calls as {type, text}
  exceptions  uncaught exceptions' texts
  log         browser log entries (CSP violations, failed loads) as {level, source, text}
  status      the page's data-report-status attribute on <body>, parsed (null when absent)
  plots       each [data-plot] element: {id, series (its data-series, parsed), canvas (bool)}
With --screenshot PNG it also saves a full-page screenshot.
Usage: report_browser.py --browser /usr/bin/chromium PAGE.html [--screenshot out.png]
"""
import argparse
import base64
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile

PROBE = """JSON.stringify({
  status: document.body ? document.body.getAttribute('data-report-status') : null,
  plots: Array.from(document.querySelectorAll('[data-plot]')).map(e => ({
    id: e.getAttribute('data-plot'),
    series: e.getAttribute('data-series'),
    canvas: e.querySelector('canvas') !== null,
  })),
})"""


class Browser:
    def __init__(self, binary, profile):
        cmd_r, self.cmd_w = os.pipe()
        self.msg_r, msg_w = os.pipe()

        def child_fds():
            a, b = os.dup(cmd_r), os.dup(msg_w)  # may already sit at 3 or 4: move them first
            os.dup2(a, 3, inheritable=True)
            os.dup2(b, 4, inheritable=True)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--no-default-browser-check", "--disable-extensions", "--disable-background-networking",
             "--remote-debugging-pipe", "--user-data-dir=" + profile, "about:blank"],
            preexec_fn=child_fds, close_fds=False, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(cmd_r)
        os.close(msg_w)
        self.buf = b""
        self.next_id = 0
        self.events = []

    def send(self, method, params=None, session=None):
        self.next_id += 1
        msg = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.cmd_w, json.dumps(msg).encode() + b"\0")
        return self.next_id

    def recv(self):
        while b"\0" not in self.buf:
            chunk = os.read(self.msg_r, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self.buf += chunk
        msg, self.buf = self.buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method, params=None, session=None):
        want = self.send(method, params, session)
        while True:
            m = self.recv()
            if m.get("id") == want:
                if "error" in m:
                    raise RuntimeError(f"{method}: {m['error']}")
                return m.get("result", {})
            self.events.append(m)

    def wait_for(self, method):
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self.recv())

    def close(self):
        try:
            self.send("Browser.close")
            self.proc.wait(timeout=10)
        except Exception:
            self.proc.kill()
            self.proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("page")
    ap.add_argument("--browser", default=shutil.which("chromium") or "chromium")
    ap.add_argument("--screenshot")
    ap.add_argument("--width", type=int, default=1280)
    ap.add_argument("--timeout", type=int, default=90)
    args = ap.parse_args()

    def on_alarm(*_):
        raise TimeoutError(f"the browser did not finish within {args.timeout} s")

    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(args.timeout)
    url = pathlib.Path(args.page).resolve().as_uri()
    profile = tempfile.mkdtemp(prefix="blu-chromium-")
    b = Browser(args.browser, profile)
    try:
        target = b.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        s = b.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            b.call(domain + ".enable", session=s)
        b.call("Emulation.setDeviceMetricsOverride",
               {"width": args.width, "height": 900, "deviceScaleFactor": 1, "mobile": False}, session=s)
        b.call("Page.navigate", {"url": url}, session=s)
        b.wait_for("Page.loadEventFired")
        probe = json.loads(b.call("Runtime.evaluate", {"expression": PROBE, "returnByValue": True},
                                  session=s)["result"]["value"])
        if args.screenshot:
            shot = b.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True}, session=s)
            pathlib.Path(args.screenshot).write_bytes(base64.b64decode(shot["data"]))
    finally:
        b.close()
        shutil.rmtree(profile, ignore_errors=True)

    def arg_text(a):
        return str(a.get("value", a.get("description", a.get("type"))))

    out = {"requests": [], "console": [], "exceptions": [], "log": []}
    for e in b.events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Network.requestWillBeSent":
            out["requests"].append(p["request"]["url"])
        elif m == "Runtime.consoleAPICalled":
            out["console"].append({"type": p["type"], "text": " ".join(arg_text(a) for a in p.get("args", []))})
        elif m == "Runtime.exceptionThrown":
            d = p["exceptionDetails"]
            out["exceptions"].append(d.get("exception", {}).get("description", d.get("text", "")))
        elif m == "Log.entryAdded":
            en = p["entry"]
            out["log"].append({"level": en["level"], "source": en["source"], "text": en["text"]})
    out["page_url"] = url
    out["status"] = json.loads(probe["status"]) if probe["status"] else None
    out["plots"] = [{"id": pl["id"], "series": json.loads(pl["series"]) if pl["series"] else None,
                     "canvas": pl["canvas"]} for pl in probe["plots"]]
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
