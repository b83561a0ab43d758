"""A real headless Chromium (Debian's chromium + chromedriver, via selenium) for report tests.

Also a command: ``python tests/browser.py REPORT.html OUT.png [HEIGHT] [ELEMENT_ID]``
screenshots a report, from the top or from the element with that id, in a 1280-px window (how
docs/report-example.png and docs/report-llm.png were made).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# No background networking: this machine's closed network refuses Chromium's own connections.
FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
]


def ensure_chromium() -> str | None:
    """Install Debian's chromium and chromium-driver when absent; None if ready, else why not."""
    if Path(CHROMIUM).exists() and Path(CHROMEDRIVER).exists():
        return None
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return "chromium/chromedriver missing and cannot apt-get install them (not root or no apt)"
    for cmd in (["apt-get", "update"], ["apt-get", "install", "-y", "chromium", "chromium-driver"]):
        proc = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=900,
            env={"DEBIAN_FRONTEND": "noninteractive", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
        if proc.returncode != 0:
            return f"{' '.join(cmd)} failed: {proc.stderr[-500:]}"
    return None


def driver():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in FLAGS:
        options.add_argument(flag)
    options.binary_location = CHROMIUM
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def screenshot(drv, out: Path, height: int | None = None, at: str | None = None) -> None:
    """The page at full height (or ``height`` pixels from the top, or from the element ``at``)."""
    full = drv.execute_script("return document.documentElement.scrollHeight")
    drv.set_window_size(1280 if at else 1400, min(full, height) if height else full)
    if at:
        drv.execute_script(f"document.getElementById({at!r}).scrollIntoView()")
    drv.save_screenshot(str(out))


if __name__ == "__main__":
    html, out = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    why = ensure_chromium()
    if why:
        sys.exit(why)
    d = driver()
    try:
        d.get(html.as_uri())
        screenshot(
            d,
            out,
            int(sys.argv[3]) if len(sys.argv) > 3 else None,
            sys.argv[4] if len(sys.argv) > 4 else None,
        )
    finally:
        d.quit()
    print(out)
