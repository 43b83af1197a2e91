"""The search page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven by selenium): type
a query, submit, wait for the hits, check the DOM and a screenshot. A document whose text is HTML must show as
text, never run. Skipped, saying why, only where Chromium or its driver is not installed."""

from __future__ import annotations

import shutil
import struct
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FakeEncoder, write_corpus

pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from retrieval.build import build_index  # noqa: E402
from retrieval.corpus import CorpusSpec  # noqa: E402
from retrieval.serve.app import create_app  # noqa: E402
from retrieval.serve.service import ServeOptions, Service  # noqa: E402
from retrieval.whitening import TransformSpec  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or DRIVER is None,
    reason="Chromium or chromedriver is absent: apt-get install chromium chromium-driver (make test does it as root)",
)
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"><b>bold?</b>"
LONG_ID = "LONGID-" + "x" * 400


@pytest.fixture
def page_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """The app on uvicorn in a thread, 127.0.0.1, a free port; stopped at the end whatever happened. Serve options
    come from the test's ``indirect`` parameter, if any."""
    texts = [f"document number {i} about topic {i % 7}" for i in range(120)]
    texts[7] = HOSTILE
    ids = [f"doc{i}" for i in range(120)]
    ids[11], ids[12], ids[13] = LONG_ID, "rtl\u202eevil", "new\nline\tid"
    corpus = write_corpus(tmp_path / "corpus.parquet", n=120, text=texts, id=ids)
    build_index(CorpusSpec(corpus), FakeEncoder(), tmp_path / "idx", TransformSpec(dim=8))
    options = ServeOptions(**{"watch_interval": 0, **getattr(request, "param", {})})
    service = Service(tmp_path / "idx", options, encoder=FakeEncoder())
    config = uvicorn.Config(create_app(service), host="127.0.0.1", port=0, log_level="warning")
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


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
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
        "--window-size=1200,900",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ):
        options.add_argument(flag)
    # Debian's chromedriver matches Debian's chromium: no driver download (selenium-manager is never asked).
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=str(DRIVER)))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def search(driver: webdriver.Chrome, query: str, k: int | str) -> list[list[str]]:
    box = driver.find_element(By.ID, "q")
    box.clear()
    box.send_keys(query)
    k_box = driver.find_element(By.ID, "k")
    k_box.clear()
    k_box.send_keys(str(k))
    driver.find_element(By.ID, "go").click()
    WebDriverWait(driver, 20).until(expected_conditions.text_to_be_present_in_element((By.ID, "status"), "hits in"))
    rows = driver.find_elements(By.CSS_SELECTOR, "#hits tbody tr")
    return [[cell.text for cell in row.find_elements(By.TAG_NAME, "td")] for row in rows]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_page_searches_and_shows_hits_as_text(page_server: str, browser: webdriver.Chrome, tmp_path: Path) -> None:
    browser.get(page_server)
    assert browser.title.startswith("retrieval")
    rows = search(browser, "document number 42 about topic 0", 5)
    assert len(rows) == 5
    assert rows[0][0] == "1" and rows[0][2] == "doc42" and rows[0][3] == "document number 42 about topic 0"
    assert float(rows[0][1]) >= float(rows[1][1])

    rows = search(browser, HOSTILE, 3)  # the document whose text is markup: shown as text, never run
    assert rows[0][2] == "doc7" and rows[0][3] == HOSTILE
    assert browser.title != "pwned" and not browser.find_elements(By.CSS_SELECTOR, "#hits img, #hits b")

    shot = browser.get_screenshot_as_png()
    (tmp_path / "page.png").write_bytes(shot)
    width, height = png_size(shot)
    assert width >= 800 and height >= 600 and len(shot) > 10_000  # a rendered page, not a blank canvas

    empty = browser.find_element(By.ID, "q")
    empty.clear()
    empty.send_keys("   ")
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 20).until(expected_conditions.text_to_be_present_in_element((By.ID, "status"), "empty"))
    assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    # the error replaces the hits: the last query's rows must not stand under the new one as its answer
    assert not browser.find_element(By.ID, "hits").is_displayed()
    assert browser.find_elements(By.CSS_SELECTOR, "#hits tbody tr") == []

    assert len(search(browser, "document number 3", "1e1")) == 10  # what the browser's number box reads as 10


def test_odd_ids_are_shown_escaped_and_a_long_one_wraps(page_server: str, browser: webdriver.Chrome) -> None:
    """The id column did not wrap: a 400-character id made the table 3,520 px wide in a 1,265 px window, the texts
    off screen. And an unclosed right-to-left override showed the id "rtl\u202eevil" as "rtllive"."""
    browser.get(page_server)
    shown = {i: search(browser, f"document number {i} about topic {i % 7}", 1)[0][2] for i in (12, 13, 11)}
    assert shown[12] == "rtl\\u202eevil" and shown[13] == "new\\nline\\tid"
    assert shown[11].replace("\n", "") == LONG_ID  # wrapped over lines, whole
    wide, window = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
    assert wide <= window, (wide, window)


def test_a_search_lives_in_the_address(page_server: str, browser: webdriver.Chrome) -> None:
    """?q=&k= searches on load; each search is a history entry (Back shows the previous one again); the API key
    typed into the page never reaches the address."""
    browser.get(page_server + "?q=document+number+42+about+topic+0&k=3")
    WebDriverWait(browser, 20).until(expected_conditions.text_to_be_present_in_element((By.ID, "status"), "hits in"))
    first = [row.text for row in browser.find_elements(By.CSS_SELECTOR, "#hits tbody tr")]
    assert len(first) == 3 and "doc42" in first[0]
    assert browser.find_element(By.ID, "q").get_attribute("value") == "document number 42 about topic 0"

    browser.find_element(By.ID, "key").send_keys("s3cret")
    search(browser, "document number 17 about topic 3", 2)
    assert "q=document+number+17+about+topic+3" in browser.current_url and "k=2" in browser.current_url
    assert "s3cret" not in browser.current_url

    browser.back()  # to the address first opened: its query and its three hits again
    WebDriverWait(browser, 20).until(
        lambda driver: driver.find_element(By.ID, "q").get_attribute("value") == "document number 42 about topic 0"
    )
    WebDriverWait(browser, 20).until(
        lambda driver: [row.text for row in driver.find_elements(By.CSS_SELECTOR, "#hits tbody tr")] == first
    )
    assert browser.current_url.endswith("/?q=document+number+42+about+topic+0&k=3")  # the address first opened


def metrics_of(base: str) -> str:
    with urllib.request.urlopen(base + "metrics", timeout=10) as response:
        return response.read().decode()


@pytest.mark.parametrize("page_server", [{"max_k": 5}], indirect=True)
def test_the_page_takes_its_k_limit_from_the_server(page_server: str, browser: webdriver.Chrome) -> None:
    browser.get(page_server)
    k_box = browser.find_element(By.ID, "k")
    WebDriverWait(browser, 20).until(lambda _: k_box.get_attribute("max") == "5")
    assert k_box.get_attribute("value") == "5"  # the default 10 would be refused
    box = browser.find_element(By.ID, "q")
    box.send_keys("document number 42 about topic 0")
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 20).until(expected_conditions.text_to_be_present_in_element((By.ID, "status"), "hits in"))
    assert len(browser.find_elements(By.CSS_SELECTOR, "#hits tbody tr")) == 5
    # the page's own requests (the page, the search) are all answered: no favicon 404 counted as an error
    metrics = metrics_of(page_server)
    assert 'route="/",status="200"' in metrics and 'route="/search",status="200"' in metrics
    assert 'status="404"' not in metrics and "retrieval_errors_total{" not in metrics


def test_the_api_docs_render_without_internet(page_server: str, browser: webdriver.Chrome) -> None:
    browser.get(page_server + "docs")  # Swagger UI: one block per operation, drawn from /openapi.json
    WebDriverWait(browser, 30).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".opblock")) >= 8)
    paths = {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert {"/search", "/embed", "/info", "/health"} <= paths
    browser.get(page_server + "redoc")
    WebDriverWait(browser, 30).until(lambda b: "/embed" in b.find_element(By.TAG_NAME, "body").text)
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("retrieval")  # ReDoc's title: the API's
