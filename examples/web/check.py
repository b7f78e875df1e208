"""Trains the digits classifier in headless Chromium and prints its test accuracy.

    python examples/web/check.py [--screenshot PATH] [--timeout SECONDS] [--backend wasm|webgpu]
    python examples/web/check.py --serve      # only serve the page, to open it in a browser yourself
    python examples/web/check.py --llm [--size small|full] [--steps N] [--backend auto|wasm|webgpu]

Writes the artifacts and data (prepare.py), serves the repository root on 127.0.0.1 (a free port),
opens examples/web/index.html in headless Chromium driven over the DevTools protocol (on a pipe, no
port), waits for the training to finish, saves a screenshot of the page and prints
``browser: test accuracy X%``. ``--backend webgpu`` trains the artifacts lowered for onnxruntime-web's
WebGPU provider on it (Chromium's WebGPU; SwiftShader's adapter without a GPU). Exit status 0 when X >= 90, 1 when lower or the page failed, 2 when
Chromium or js/node_modules is missing.

``--llm`` opens llm.html instead: LoRA fine-tuning of a Llama-shaped decoder on an int4 base
(prepare_llm.py; ``--size small``, the default: hidden 64, 2 layers; ``--size full``: about 104 M
parameters) to reproduce a sentence, on WebGPU where Chromium offers an adapter, else WebAssembly
(``--backend auto``, its default). It prints the first and last loss, the time per step and
tokens per second, the WebAssembly memory, the generations before and after, and the backend;
exit status 0 when the loss fell to under half and the generation after training reproduces more
of the sentence than the one before. Needs Debian's ``chromium`` and ``npm ci --ignore-scripts
--prefix js``; nothing is downloaded.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import functools
import http.server
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import ClassVar

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
THRESHOLD = 0.90


class PageError(Exception):
    """The page or the browser failed: one line for the user."""


class Handler(http.server.SimpleHTTPRequestHandler):
    # whatever the system's mime.types says: browsers run modules and compile WebAssembly only
    # when served with these types
    extensions_map: ClassVar[dict[str, str]] = {
        **http.server.SimpleHTTPRequestHandler.extensions_map,
        ".mjs": "text/javascript", ".js": "text/javascript", ".wasm": "application/wasm",
    }

    def end_headers(self):
        # cross-origin isolation: the page gets SharedArrayBuffer, so onnxruntime-web's WebAssembly
        # runs on several threads (every resource here is same-origin, as require-corp asks)
        self.send_header("Cross-Origin-Opener-Policy", "same-origin")
        self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def log_message(self, format, *args):
        pass  # quiet: the check prints its own lines


def serve(directory: str = ROOT) -> http.server.ThreadingHTTPServer:
    """``directory`` (default: the repository root) on 127.0.0.1 at a free port (not serving yet)."""
    return http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(directory)))


def _moved_above(fd: int, lowest: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return moved


class Chromium:
    """Headless Chromium with the DevTools protocol on a pipe: JSON messages ended by NUL, the
    browser reading commands on its fd 3 and writing replies and events on its fd 4."""

    def __init__(self, executable: str, profile: str, webgpu: bool = False) -> None:
        to_browser, self._commands = os.pipe()
        self._replies, from_browser = os.pipe()
        # the child's ends above fd 10, so that moving them to 3 and 4 overwrites neither (dup2 onto
        # another fd also makes the copy inheritable)
        to_browser, from_browser = (_moved_above(fd, 10) for fd in (to_browser, from_browser))

        def pipes():  # in the child
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        flags = ["--headless", "--remote-debugging-pipe", f"--user-data-dir={profile}", "--no-first-run",
                 "--no-default-browser-check", "--disable-gpu", "--disable-extensions", "--mute-audio",
                 "--hide-scrollbars"]
        if webgpu:  # headless WebGPU: without a GPU, the adapter is SwiftShader's (Vulkan on the CPU)
            flags[0] = "--headless=new"
            flags.remove("--disable-gpu")
            flags += ["--enable-unsafe-webgpu", "--enable-features=Vulkan", "--use-vulkan=swiftshader",
                      "--use-webgpu-adapter=swiftshader", "--ignore-gpu-blocklist"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        # preexec_fn is safe here: the check starts Chromium before any thread; close_fds=False
        # passes fds 3 and 4 on, and no others: Python's own are not inheritable (PEP 446)
        self.process = subprocess.Popen(
            [executable, *flags, "about:blank"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, preexec_fn=pipes, close_fds=False)  # noqa: PLW1509
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._next = 0
        self.errors: list[str] = []  # exceptions thrown and console errors of the page
        self.console: list[str] = []  # every console message of the page (onnxruntime's log among them)

    def send(self, method: str, params: dict | None = None, session: str | None = None, timeout: float = 30) -> dict:
        self._next += 1
        message = {"id": self._next, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        try:
            os.write(self._commands, json.dumps(message).encode() + b"\0")
        except BrokenPipeError:
            raise PageError(f"Chromium exited (status {self.process.wait()})") from None
        deadline = time.monotonic() + timeout
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise PageError(f"Chromium refused {method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self._note(reply)

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._replies], [], [], left)[0]:
                raise PageError("Chromium did not answer in time")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise PageError(f"Chromium exited (status {self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def _note(self, event: dict) -> None:
        params = event.get("params", {})
        if event.get("method") == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.errors.append(details.get("exception", {}).get("description") or details.get("text", "an exception"))
        elif event.get("method") == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append(text)
            if params.get("type") == "error":
                self.errors.append(text)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=5)
        except (PageError, OSError):
            pass  # it is killed below
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._replies)


def train_in_browser(browser: Chromium, url: str, screenshot: str, timeout: float) -> dict:
    """Opens ``url``, waits for its training and returns window.trainingResult; saves a screenshot."""
    from onnx_autodiff.files import write_atomically

    target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]

    def evaluate(expression: str):
        # the page answers between its tasks: a step of a large model on WebAssembly holds its
        # main thread for seconds, a session's creation longer
        left = max(30.0, deadline - time.monotonic()) if deadline else 30.0
        return browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True},
                            session=session, timeout=left)["result"].get("value")

    deadline = None
    browser.send("Runtime.enable", session=session)
    browser.send("Emulation.setDeviceMetricsOverride",
                 {"width": 900, "height": 520, "deviceScaleFactor": 1, "mobile": False}, session=session)
    browser.send("Page.navigate", {"url": url}, session=session)
    deadline = time.monotonic() + timeout
    state = None
    while state not in ("done", "error"):
        if time.monotonic() > deadline:
            raise PageError(f"the page did not finish training in {timeout:g} s (state {state!r})"
                            + (f": {browser.errors[0]}" if browser.errors else ""))
        time.sleep(0.2)
        state = evaluate("document.body && document.body.dataset.state")
    shot = browser.send("Page.captureScreenshot", {"format": "png"}, session=session)["data"]
    write_atomically(screenshot, base64.b64decode(shot))
    if state == "error":
        raise PageError(f"the page failed: {evaluate('window.trainingError')}")
    return json.loads(evaluate("JSON.stringify(window.trainingResult)"))


def open_page(executable: str, directory: str, page: str, screenshot: str, timeout: float,
              webgpu: bool = False) -> tuple[dict, list[str]]:
    """Serves ``directory``, opens ``page`` (its path and query there) in a headless Chromium
    (``webgpu``: with its WebGPU adapter) and returns the page's window.trainingResult and the
    browser's console lines (:func:`train_in_browser`; raises PageError, or OSError when Chromium
    does not start)."""
    with tempfile.TemporaryDirectory(prefix="onnx-autodiff-chromium-") as profile:
        browser = Chromium(executable, profile, webgpu=webgpu)  # before the server's thread: a pre-exec hook
        server = serve(directory)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            url = f"http://127.0.0.1:{server.server_address[1]}/{page}"
            return train_in_browser(browser, url, screenshot, timeout), browser.console
        finally:
            browser.close()
            server.shutdown()
            server.server_close()


def common_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report_llm(result: dict) -> bool:
    """Prints the LLM page's figures; whether it learned (loss under half, more of the sentence)."""
    sentence = result["sentence"]
    before, after = (common_prefix(result[k], sentence) for k in ("before", "after"))
    where = "WebGPU" if result["backend"] == "webgpu" else f"WebAssembly, {result['threads']} thread(s)"
    print(f"browser: llm {result['size']}: {result['parameters'] / 1e6:.1f} M parameters, {result['quantize']} base, "
          f"{result['steps']} steps of {result['seq']} tokens on {where}")
    print(f"browser: llm loss {result['firstLoss']:.4f} -> {result['lastLoss']:.4f}")
    print(f"browser: llm {result['secondsPerStep']:.3f} s per step after the first ({result['firstStepSeconds']:.2f} s), "
          f"{result['tokensPerSecond']:.0f} tokens/s; sessions {result['sessionSeconds']:.1f} s")
    heap = f", JavaScript heap {result['jsHeapBytes'] / 2**20:.0f} MB" if result.get("jsHeapBytes") else ""
    print(f"browser: llm memory: WebAssembly.Memory {result['wasmMemoryBytes'] / 2**20:.0f} MB{heap}")
    print(f"browser: llm before: {result['before']!r} ({before}/{len(sentence)} characters of the sentence)")
    print(f"browser: llm after: {result['after']!r} ({after}/{len(sentence)} characters of the sentence)")
    print(f"browser: backend {result['backend']} (adapter: {'yes' if result['adapter'] else 'none'})")
    return result["lastLoss"] < result["firstLoss"] / 2 and after > before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshot", help="default: examples/web/screenshot.png (--llm: screenshot-llm.png)")
    parser.add_argument("--timeout", type=float, help="seconds to wait for the training (default 120; --llm --size full: 3600)")
    parser.add_argument("--serve", action="store_true", help="only serve the page (no browser) until interrupted")
    parser.add_argument("--backend", choices=["wasm", "webgpu", "auto"],
                        help="onnxruntime-web's execution provider (default wasm; --llm: auto, WebGPU where there is an adapter)")
    parser.add_argument("--llm", action="store_true", help="the LLM page (llm.html) instead of the digits")
    parser.add_argument("--size", choices=["small", "full"], default="small", help="--llm: the model (default %(default)s)")
    parser.add_argument("--small", action="store_const", dest="size", const="small", help="--size small")
    parser.add_argument("--steps", type=int, help="--llm: training steps (default: 100 small, 30 full)")
    parser.add_argument("--reuse", action="store_true",
                        help="--llm: train the artifacts already in build/ when prepare_llm.py wrote them for this size")
    args = parser.parse_args(argv)
    if args.backend is None:
        args.backend = "auto" if args.llm else "wasm"
    if args.backend == "auto" and not args.llm:
        parser.error("--backend auto goes with --llm")
    if args.timeout is None:
        args.timeout = 3600 if args.llm and args.size == "full" else 120
    if args.screenshot is None:
        args.screenshot = os.path.join(HERE, "screenshot-llm.png" if args.llm else "screenshot.png")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.screenshot))):
        parser.error(f"--screenshot {args.screenshot}: no such directory")
    executable = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not executable and not args.serve:
        print("check.py: error: no chromium on PATH (Debian: apt-get install chromium)", file=sys.stderr)
        return 2
    if not os.path.isfile(os.path.join(ROOT, "js", "node_modules", "onnxruntime-web", "dist", "ort.wasm.min.mjs")):
        print("check.py: error: js/node_modules lacks onnxruntime-web: run npm ci --ignore-scripts --prefix js", file=sys.stderr)
        return 2
    sys.path.insert(0, HERE)
    if args.llm:
        import prepare_llm

        if not (args.reuse and prepare_llm.built(args.size)):
            prepare_llm.main(["--size", args.size])
        page = f"llm.html?size={args.size}" + ("" if args.backend == "auto" else f"&backend={args.backend}")
        page += "" if args.steps is None else f"&steps={args.steps}"
    else:
        import prepare

        prepare.main([])
        page = f"index.html?backend={args.backend}"
    if args.serve:
        server = serve()
        print(f"serving http://127.0.0.1:{server.server_address[1]}/examples/web/{page} (Ctrl-C stops)")
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()
        server.server_close()
        return 0
    start = time.perf_counter()
    try:
        result, _ = open_page(executable, ROOT, f"examples/web/{page}", args.screenshot, args.timeout,
                              webgpu=args.backend in ("webgpu", "auto"))
    except OSError as error:
        print(f"check.py: error: cannot start {executable}: {error}", file=sys.stderr)
        return 2
    except PageError as error:
        print(f"check.py: error: {str(error).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    if args.llm:
        learned = report_llm(result)
        print(f"browser: page and browser {time.perf_counter() - start:.1f} s; saved {args.screenshot}")
        return 0 if learned else 1
    accuracy = result["accuracy"]
    where = "WebGPU" if result.get("backend") == "webgpu" else f"{result['threads']} WebAssembly thread(s)"
    print(f"browser: test accuracy {accuracy * 100:.1f}% ({result['source']} digits, {result['train']} train / "
          f"{result['test']} test, {result['steps']} steps in {result['seconds']:.1f} s on {where}; "
          f"page and browser {time.perf_counter() - start:.1f} s)")
    if result.get("backend") == "webgpu":
        print("browser: backend webgpu")
    else:
        isolated = "cross-origin isolated" if result.get("isolated") else "not cross-origin isolated"
        print(f"browser: backend {result.get('backend')}, {result['threads']} thread(s) of {result.get('cores')} "
              f"core(s), {isolated}")
    print(f"saved {args.screenshot}")
    return 0 if accuracy >= THRESHOLD else 1


if __name__ == "__main__":
    raise SystemExit(main())
