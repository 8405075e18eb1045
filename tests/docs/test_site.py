"""The documentation site, built in strict mode and read in headless Chromium.

The site is built from `mkdocs.yml` as `make docs` builds it, served over HTTP, and driven
through the DevTools protocol (the search index is built by a web worker, and Material draws
diagrams into closed shadow roots, so a DOM dump is not enough). Chromium is Debian's
`chromium` package; without it the browser test is skipped and the strict build still runs.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import pytest

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = ROOT / ".venv" / "bin" / "mkdocs"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MERMAID_JS = ROOT / "docs" / "assets" / "javascripts" / "mermaid.min.js"
TABS = [
    "Home",
    "Getting started",
    "IDE plugin authors",
    "Operators",
    "Analysts",
    "ML engineers",
    "Results",
    "Reference",
]
# One page per audience: its path, its tab, its title and a page its section's navigation lists.
AUDIENCE_PAGES = [
    ("getting-started/", "Getting started", "Getting started", "The agent demo"),
    ("plugin-authors/", "IDE plugin authors", "rtrl for IDE clients", "The gateway API"),
    ("operators/", "Operators", "Deploying: the production topology", "Configuration"),
    ("analysts/", "Analysts", "A/B results", "Guardrails"),
    ("ml-engineers/", "ML engineers", "Rewards", "Evaluation gates"),
    ("results/", "Results", "Results", "Benchmarks"),
    ("reference/settings/", "Reference", "Settings", "HTTP API"),
]

# Pages with diagrams, and how many: the loop, the package map, an agent run, the A/B ramp.
DIAGRAMS = {
    "": 1,
    "getting-started/architecture/": 2,
    "plugin-authors/agent-sessions/": 1,
    "analysts/": 2,
}


def build_site(site_dir: Path) -> subprocess.CompletedProcess[str]:
    mkdocs = str(MKDOCS) if MKDOCS.exists() else shutil.which("mkdocs") or "mkdocs"
    return subprocess.run(
        [mkdocs, "build", "--strict", "--site-dir", str(site_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    site_dir = tmp_path_factory.mktemp("site")
    result = build_site(site_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return site_dir


@pytest.fixture(scope="module")
def site_url(site: Path) -> Iterator[str]:
    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_the_site_builds_in_strict_mode_with_a_page_per_audience(site: Path) -> None:
    for path, *_ in AUDIENCE_PAGES:
        assert (site / path / "index.html").exists(), path
    assert (site / "search" / "search_index.json").exists()


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\nSee [the runbook](operators/runbook.md).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text(
        "site_name: t\ntheme:\n  name: material\nvalidation:\n  unrecognized_links: warn\n"
    )
    mkdocs = str(MKDOCS) if MKDOCS.exists() else "mkdocs"
    result = subprocess.run(
        [mkdocs, "build", "--strict", "-f", str(config), "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode != 0
    assert "operators/runbook.md" in result.stderr


class Browser:
    """One headless Chromium tab, driven through the DevTools protocol."""

    def __init__(self, profile: Path) -> None:
        self.process = subprocess.Popen(
            [
                str(CHROMIUM),
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",
                "--window-size=1400,1000",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and "\n" in port_file.read_text()):
            assert time.monotonic() < deadline, "Chromium did not open its DevTools port"
            time.sleep(0.1)
        self.port = int(port_file.read_text().split("\n")[0])
        self.ids = itertools.count(1)

    async def __aenter__(self) -> Browser:
        self.http = aiohttp.ClientSession()
        async with self.http.put(f"http://127.0.0.1:{self.port}/json/new?about:blank") as reply:
            target = await reply.json()
        self.ws = await self.http.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.ws.close()
        await self.http.close()
        self.process.terminate()
        self.process.wait(timeout=30)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        message_id = next(self.ids)
        await self.ws.send_json({"id": message_id, "method": method, "params": params})
        while True:
            message = await self.ws.receive_json()
            if message.get("id") == message_id:
                assert "error" not in message, message
                return dict(message["result"])

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60) -> Any:
        """The expression's value once it is truthy; None after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = await self.evaluate(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        return None

    async def open(self, url: str) -> dict[str, Any]:
        """Load a page; what a reader sees of it: title, tabs, the active tab, navigation."""
        await self.call("Page.navigate", url=url)
        page = await self.wait_for(
            """document.readyState === 'complete' && document.querySelector('.md-content h1')
            && location.href !== 'about:blank' && JSON.stringify({
              h1: document.querySelector('.md-content h1').textContent.replace('¶', '').trim(),
              tabs: [...document.querySelectorAll('.md-tabs__link')].map(a => a.textContent.trim()),
              active: document.querySelector('.md-tabs__item--active')?.textContent.trim(),
              nav: [...document.querySelectorAll('.md-nav--primary .md-nav__link')]
                .map(a => a.textContent.trim()),
            })"""
        )
        assert page, f"{url} did not render"
        return dict(json.loads(page))


@pytest.mark.skipif(CHROMIUM is None, reason="Chromium is not installed (apt-get install chromium)")
def test_every_audience_reads_its_pages_with_navigation_search_and_diagrams(
    site_url: str, tmp_path: Path
) -> None:
    async def read() -> None:
        async with Browser(tmp_path / "profile") as browser:
            home = await browser.open(site_url)
            assert home["h1"].startswith("rtrl")
            assert home["tabs"] == TABS

            if MERMAID_JS.exists():
                # Material swaps each <pre class="mermaid"> for a drawn <div> once mermaid has
                # rendered it (a diagram mermaid cannot parse stays a <pre>); the script is the
                # site's own copy, not a CDN's.
                for path, diagrams in DIAGRAMS.items():
                    if path:
                        await browser.open(site_url + path)
                    drawn = await browser.wait_for(
                        f"document.querySelectorAll('div.mermaid').length === {diagrams}"
                        " && !document.querySelector('pre.mermaid')"
                    )
                    assert drawn, f"the diagrams of /{path} were not drawn"
                    scripts = await browser.evaluate(
                        "performance.getEntriesByType('resource').map(e => e.name)"
                        ".filter(n => n.includes('mermaid'))"
                    )
                    assert scripts == [f"{site_url}assets/javascripts/mermaid.min.js"]

            for path, tab, title, listed in AUDIENCE_PAGES:
                page = await browser.open(site_url + path)
                assert page["h1"].startswith(title), (path, page["h1"])
                assert page["tabs"] == TABS, path
                assert page["active"] == tab, (path, page["active"])
                assert listed in page["nav"], (path, page["nav"])

            await browser.call("Page.navigate", url=f"{site_url}analysts/?q=cuped")
            count = await browser.wait_for(
                "document.querySelectorAll('.md-search-result__item').length"
            )
            assert count, "search for 'cuped' returned nothing"
            titles = await browser.evaluate(
                "[...document.querySelectorAll('.md-search-result__item')].map(e => e.textContent)"
            )
            assert any("A/B results" in title for title in titles), titles

    asyncio.run(read())
