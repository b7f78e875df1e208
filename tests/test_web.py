"""The browser demo (examples/web) trains the digits classifier in headless Chromium to >= 90 %.

Skipped without Chromium or js/node_modules (CI installs both: apt-get install chromium, npm ci).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_browser_page_trains_to_90_percent(tmp_path):
    if not (os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium is not installed (Debian: apt-get install chromium)")
    if not (ROOT / "js" / "node_modules" / "onnxruntime-web").is_dir():
        pytest.skip("js/node_modules is missing: run npm ci --ignore-scripts --prefix js")
    pytest.importorskip("safetensors", reason="prepare.py writes safetensors with the safetensors package")
    screenshot = tmp_path / "page.png"
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "web" / "check.py"), "--screenshot", str(screenshot)],
                            capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    accuracy = re.search(r"^browser: test accuracy ([0-9.]+)%", result.stdout, re.MULTILINE)
    assert accuracy and float(accuracy.group(1)) >= 90, result.stdout
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
