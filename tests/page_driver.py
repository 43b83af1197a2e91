"""Shared by the search page's browser tests: the app on uvicorn in a thread, a headless Chromium at a given
viewport, and reading the hits off the page."""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from conftest import FakeEncoder

uvicorn = pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from retrieval.build import BuildOptions, build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.serve.app import create_app  # noqa: E402
from retrieval.serve.service import ServeOptions, Service  # noqa: E402
from retrieval.whitening import TransformSpec  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
# The marks of every module that drives the page: the browser tier, skipped (saying why) without Chromium.
PAGE_TESTS = [
    pytest.mark.browser,
    pytest.mark.skipif(
        CHROMIUM is None or DRIVER is None,
        reason="Chromium or chromedriver is absent: apt-get install chromium chromium-driver "
        "(make test does it as root)",
    ),
]


@contextmanager
def serve_index(
    tmp_path: Path, corpus: Path, options: dict[str, Any], title_column: str | None = None
) -> Iterator[str]:
    """``corpus`` indexed (fake encoder, 8 dims) and served on 127.0.0.1 at a free port; yields the page's URL and
    stops the server at the end whatever happened. ``options``: ServeOptions, and ``api_key``."""
    # dense only: the page's own tests expect no mode switch unless they fake /info's modes
    dense = BuildOptions(lexical=None)
    build_index(
        CorpusSpec(corpus, title_column=title_column),
        FakeEncoder(),
        tmp_path / "idx",
        TransformSpec(dim=8),
        options=dense,
    )
    options = dict(options)
    api_key = options.pop("api_key", None)
    service = Service(tmp_path / "idx", ServeOptions(**{"watch_interval": 0, **options}), encoder=FakeEncoder())
    config = uvicorn.Config(create_app(service, api_key=api_key), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and service.ready):
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def chromium(tmp_path: Path, width: int, height: int, mobile: bool = False) -> Iterator[WebDriver]:
    """A headless Chromium whose viewport is exactly ``width`` x ``height`` CSS pixels at scale 1 (``mobile``: as a
    phone lays out, the page's viewport meta tag obeyed, scrollbars overlaid)."""
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--window-size=1280,1000",
        f"--user-data-dir={tmp_path / f'chromium-profile-{width}'}",
    ):
        options.add_argument(flag)
    # Debian's chromedriver matches Debian's chromium: no driver download (selenium-manager is never asked).
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(DRIVER)))
    driver.set_page_load_timeout(30)
    try:
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile}
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        yield driver
    finally:
        driver.quit()


def wait_for_hits(driver: WebDriver) -> None:
    WebDriverWait(driver, 20).until(expected_conditions.text_to_be_present_in_element((By.ID, "status"), "hits in"))


HITS = """return [...document.querySelectorAll('#hits li')].map(li => ({
  rank: li.querySelector('.rank').textContent, id: li.querySelector('.id').textContent,
  score: li.querySelector('.score').textContent,
  title: li.querySelector('h2') ? li.querySelector('h2').textContent : null,
  snippet: li.querySelector('.snippet').innerText, full: li.querySelector('.full').textContent}))"""


def search(driver: WebDriver, query: str, k: int | str) -> list[dict[str, Any]]:
    """Type ``query`` and ``k``, press Search, wait for the answer: each hit's rank, id, score, title (None without
    one), snippet (as shown) and full text."""
    box = driver.find_element(By.ID, "q")
    box.clear()
    box.send_keys(query)
    k_box = driver.find_element(By.ID, "k")
    k_box.clear()
    k_box.send_keys(str(k))
    driver.execute_script("document.getElementById('status').textContent = ''")  # the previous answer's line
    driver.find_element(By.ID, "go").click()
    wait_for_hits(driver)
    return driver.execute_script(HITS)  # type: ignore[no-any-return]
