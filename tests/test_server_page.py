"""The search page at / in a real headless Chromium (Debian's chromium + chromium-driver, driven by selenium): type
a query, submit, wait for the hits, check the DOM. A document whose text is HTML must show as text, never run; the
controls follow what /info says the index can do; the address holds the whole search. Layout at phone and desktop
widths and the accessibility check are in test_server_page_layout.py. Skipped, saying why, only where Chromium or
its driver is not installed."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import write_corpus

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")

from page_driver import PAGE_TESTS, chromium, search, serve_index, wait_for_hits  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support import expected_conditions  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from retrieval.serve import routes as server  # noqa: E402

pytestmark = PAGE_TESTS
HOSTILE = "<img src=x onerror=\"document.title='pwned'\"><b>bold?</b>"
LONG_ID = "LONGID-" + "x" * 400
# What the page sends to /search, recorded before its own script runs (so the search an address starts is seen too).
RECORD_REQUESTS = """
window.sent = [];
const realFetch = window.fetch;
window.fetch = (url, options) => {
  if (String(url).endsWith("search")) window.sent.push(JSON.parse(options.body));
  return realFetch(url, options);
};
"""


@pytest.fixture
def page_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """120 short documents (one whose text is markup, odd ids) served on 127.0.0.1; serve options from the test's
    ``indirect`` parameter, if any."""
    texts = [f"document number {i} about topic {i % 7}" for i in range(120)]
    texts[7] = HOSTILE
    ids = [f"doc{i}" for i in range(120)]
    ids[11], ids[12], ids[13] = LONG_ID, "rtl\u202eevil", "new\nline\tid"
    corpus = write_corpus(tmp_path / "corpus.parquet", n=120, text=texts, id=ids)
    with serve_index(tmp_path, corpus, getattr(request, "param", {})) as url:
        yield url


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    with chromium(tmp_path, 1200, 900) as driver:
        yield driver


def test_the_page_searches_and_shows_hits_as_text(page_server: str, browser: WebDriver) -> None:
    browser.get(page_server)
    assert browser.title.startswith("retrieval")
    hits = search(browser, "document number 42 about topic 0", 5)
    assert len(hits) == 5 and [h["rank"] for h in hits] == ["#1", "#2", "#3", "#4", "#5"]
    assert hits[0]["id"] == "doc42" and hits[0]["snippet"] == "document number 42 about topic 0"
    assert hits[0]["full"] == "document number 42 about topic 0" and hits[0]["title"] is None
    scores = [float(h["score"].removeprefix("score ")) for h in hits]
    assert scores == sorted(scores, reverse=True)

    hits = search(browser, HOSTILE, 3)  # the document whose text is markup: shown as text, never run
    assert hits[0]["id"] == "doc7" and hits[0]["full"] == HOSTILE
    assert hits[0]["snippet"].replace("\n", "") == HOSTILE
    assert browser.title != "pwned" and not browser.find_elements(By.CSS_SELECTOR, "#hits img, #hits b")

    empty = browser.find_element(By.ID, "q")
    empty.clear()
    empty.send_keys("   ")
    browser.find_element(By.ID, "go").click()
    WebDriverWait(browser, 20).until(expected_conditions.text_to_be_present_in_element((By.ID, "status"), "empty"))
    assert "error" in browser.find_element(By.ID, "status").get_attribute("class")
    # the error replaces the hits: the last query's must not stand under the new one as its answer
    assert browser.find_elements(By.CSS_SELECTOR, "#hits li") == []

    assert len(search(browser, "document number 3", "1e1")) == 10  # what the browser's number box reads as 10


def test_the_query_words_are_marked_as_whole_words(page_server: str, browser: WebDriver) -> None:
    """Every word of the query is marked where it stands as a word, whatever its case ("4" is not marked inside
    "42"), and a function word ("about") is not marked while the query has other words."""
    browser.get(page_server)
    hits = search(browser, "NUMBER 4 About Topic", 100)
    marks = browser.execute_script(
        "return [...document.querySelectorAll('#hits .snippet')].map(s => [...s.querySelectorAll('mark')]"
        ".map(m => m.textContent))"
    )
    for hit, marked in zip(hits, marks, strict=True):
        words = hit["full"].split()
        assert marked == [w for w in words if w in {"number", "4", "topic"}], (hit, marked)
    assert any("4" in marked for marked in marks)  # topic 4, and words holding a 4 left alone:
    assert any(w != "4" and "4" in w for hit in hits for w in hit["full"].split())


def test_a_long_text_shows_a_snippet_and_more_opens_the_whole(page_server: str, browser: WebDriver) -> None:
    """A snippet starts shortly before the first marked word and is cut; "more" (a button saying whether it is
    expanded) shows the whole text in its place, marked too, and works from the keyboard."""
    browser.get(page_server)
    long_text = " ".join(f"filler{i}" for i in range(200)) + " the needle word " + " ".join(["tail"] * 100)
    browser.execute_script(
        "window.fetch = async () => new Response(JSON.stringify({results: [{hits: [{rank: 1, id: 'x', score: 0.5,"
        " text: arguments[0]}]}], generation: 1, took_ms: 1}), {headers: {'Content-Type': 'application/json'}});",
        long_text,
    )  # one canned answer: the snippet's cut is the page's own logic, whatever the index holds
    hit = search(browser, "needle", 1)[0]
    assert hit["snippet"].startswith("\u2026") and "needle" in hit["snippet"] and hit["snippet"].endswith("\u2026")
    assert len(hit["snippet"]) < 400 and hit["full"] == long_text
    more = browser.find_element(By.CSS_SELECTOR, "#hits .more")
    assert more.is_displayed() and more.get_attribute("aria-expanded") == "false"
    more.send_keys(Keys.ENTER)  # a button: Enter (and Space) press it
    full = browser.find_element(By.CSS_SELECTOR, "#hits .full")
    assert full.is_displayed() and full.text == long_text and more.get_attribute("aria-expanded") == "true"
    assert not browser.find_element(By.CSS_SELECTOR, "#hits .snippet").is_displayed()
    assert [m.text for m in full.find_elements(By.TAG_NAME, "mark")] == ["needle"]
    more.send_keys(Keys.SPACE)
    assert not full.is_displayed() and more.text == "more"


def test_a_hit_that_names_its_matched_terms_is_marked_with_those(page_server: str, browser: WebDriver) -> None:
    """A search that knows which words matched (a stemming lexical side) sends them as the hit's `terms`: those are
    marked, not the query's own words."""
    browser.get(page_server)
    browser.execute_script(
        "window.fetch = async () => new Response(JSON.stringify({results: [{hits: [{rank: 1, id: 'x', score: 0.5,"
        " text: 'Run: she was running, he ran, they run.', terms: ['Running', 'ran']}]}], generation: 1,"
        " took_ms: 1}), {headers: {'Content-Type': 'application/json'}});"
    )
    search(browser, "run", 1)
    marks = [m.text for m in browser.find_elements(By.CSS_SELECTOR, "#hits .snippet mark")]
    assert marks == ["running", "ran"]


def test_odd_ids_are_shown_escaped_and_a_long_one_wraps(page_server: str, browser: WebDriver) -> None:
    """A table's id column did not wrap: a 400-character id made the table 3,520 px wide in a 1,265 px window. And an
    unclosed right-to-left override showed the id "rtl\u202eevil" as "rtllive"."""
    browser.get(page_server)
    shown = {i: search(browser, f"document number {i} about topic {i % 7}", 1)[0]["id"] for i in (12, 13, 11)}
    assert shown[12] == "rtl\\u202eevil" and shown[13] == "new\\nline\\tid"
    assert shown[11].replace("\n", "") == LONG_ID  # wrapped over lines, whole
    for width in (1200, 400):  # at a phone's width too
        metrics = {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": width < 600}
        browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
        wide, window = browser.execute_script("return [document.documentElement.scrollWidth, window.innerWidth]")
        assert wide <= window == width, (wide, window)


def test_a_search_lives_in_the_address(page_server: str, browser: WebDriver) -> None:
    """?q=&k=&rescore= searches on load; each search is a history entry (Back shows the previous one again); the
    API key typed into the page never reaches the address."""
    browser.get(page_server + "?q=document+number+42+about+topic+0&k=3&rescore=off")
    wait_for_hits(browser)
    first = [item.text for item in browser.find_elements(By.CSS_SELECTOR, "#hits li")]
    assert len(first) == 3 and "doc42" in first[0]
    assert browser.find_element(By.ID, "q").get_attribute("value") == "document number 42 about topic 0"
    assert not browser.find_element(By.ID, "rescore").is_selected()

    browser.find_element(By.ID, "key").send_keys("s3cret")
    browser.find_element(By.ID, "rescore").click()
    search(browser, "document number 17 about topic 3", 2)
    url = browser.current_url
    assert "q=document+number+17+about+topic+3" in url and "k=2" in url and "rescore=on" in url
    assert "s3cret" not in url

    browser.back()  # to the address first opened: its query, its switch and its three hits again
    WebDriverWait(browser, 20).until(
        lambda driver: driver.find_element(By.ID, "q").get_attribute("value") == "document number 42 about topic 0"
    )
    WebDriverWait(browser, 20).until(
        lambda driver: [item.text for item in driver.find_elements(By.CSS_SELECTOR, "#hits li")] == first
    )
    assert not browser.find_element(By.ID, "rescore").is_selected()
    assert browser.current_url.endswith("/?q=document+number+42+about+topic+0&k=3&rescore=off")


def requests_sent(browser: WebDriver) -> list[dict[str, Any]]:
    return browser.execute_script("return window.sent")  # type: ignore[no-any-return]


def test_rescoring_is_a_switch_set_to_the_index_default(page_server: str, browser: WebDriver) -> None:
    """The index kept its stash and re-scores by default (depth 50): the switch shows, on; on asks for the index's
    default (no `rescore`), off sends `rescore: 0`. No mode switch and no filters: /info names neither."""
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_REQUESTS})
    browser.get(page_server)
    box = browser.find_element(By.ID, "rescore")
    WebDriverWait(browser, 20).until(lambda _: box.is_displayed())
    assert box.is_selected()
    assert not browser.find_element(By.ID, "mode").is_displayed()
    assert not browser.find_element(By.ID, "filters").is_displayed()
    search(browser, "document number 5 about topic 5", 4)
    box.click()
    search(browser, "document number 5 about topic 5", 4)
    sent = requests_sent(browser)
    assert sent == [
        {"query": "document number 5 about topic 5", "k": 4},
        {"query": "document number 5 about topic 5", "k": 4, "rescore": 0},
    ]


def with_index_fields(monkeypatch: pytest.MonkeyPatch, **fields: Any) -> None:
    """/info as the service describes it, with ``fields`` set in its ``index`` section: how the page meets an index
    whose capabilities (modes, kept columns, no stash) this test's index does not have."""
    describe = server.describe

    def described(service: Any) -> dict[str, Any]:
        info = describe(service)
        if info["index"] is not None:
            info["index"].update(fields)
        return info

    monkeypatch.setattr(server, "describe", described)


COLUMNS = [
    {"name": "year", "type": "int64"},
    {"name": "source", "type": "string"},
    {"name": "peer_reviewed", "type": "bool"},
    {"name": "published", "type": "date32[day]"},
]


def test_modes_and_filters_show_when_info_names_them(
    page_server: str, browser: WebDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/info lists modes and kept columns: a mode switch (the default preselected) and one labelled filter box per
    condition; the request carries `mode` and `filter`, the address both, and opening the address again restores
    them and sends the same request. No stash: no re-scoring switch."""
    with_index_fields(
        monkeypatch, modes=["dense", "lexical", "hybrid"], default_mode="hybrid", columns=COLUMNS, stash=False
    )
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_REQUESTS})
    browser.get(page_server)
    mode = browser.find_element(By.ID, "mode")
    WebDriverWait(browser, 20).until(lambda _: mode.is_displayed())
    assert [o.text for o in mode.find_elements(By.TAG_NAME, "option")] == ["dense", "lexical", "hybrid"]
    assert mode.get_attribute("value") == "hybrid" and not browser.find_element(By.ID, "rescore").is_displayed()
    labels = [label.text for label in browser.find_elements(By.CSS_SELECTOR, "#filters label")]
    bool_label = "peer_reviewed is\nany\ntrue\nfalse"  # a label's text holds its select's options
    assert labels == ["year from", "year to", "source is", bool_label, "published from", "published to"]
    found = browser.find_elements(By.CSS_SELECTOR, "#filters input, #filters select")
    boxes = {box.get_attribute("id"): box for box in found}
    assert [box.get_attribute("type") for box in found] == ["number", "number", "text", "select-one", "date", "date"]

    mode.send_keys("lexical")
    boxes["filter-0-ge"].send_keys("2020")
    boxes["filter-1-eq"].send_keys("pubmed")
    boxes["filter-2-eq"].send_keys("true")
    query = browser.find_element(By.ID, "q")
    query.send_keys("vitamin d")
    query.send_keys(Keys.ENTER)  # Enter in the query box searches
    WebDriverWait(browser, 20).until(lambda _: requests_sent(browser))
    expected = {
        "query": "vitamin d",
        "k": 10,
        "mode": "lexical",
        "filter": {
            "and": [
                {"column": "year", "op": ">=", "value": 2020},
                {"column": "source", "op": "=", "value": "pubmed"},
                {"column": "peer_reviewed", "op": "=", "value": True},
            ]
        },
    }
    assert requests_sent(browser) == [expected]
    address = browser.current_url
    assert "mode=lexical" in address and "f.ge.year=2020" in address and "f.eq.source=pubmed" in address
    assert "f.eq.peer_reviewed=true" in address and "rescore" not in address

    browser.get(page_server)  # a fresh page: the defaults again
    WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "mode").is_displayed())
    assert browser.find_element(By.ID, "filter-0-ge").get_attribute("value") == ""
    browser.get(address)  # the shared link: the same controls, the same request
    WebDriverWait(browser, 20).until(lambda _: requests_sent(browser))
    assert requests_sent(browser) == [expected]
    assert browser.find_element(By.ID, "mode").get_attribute("value") == "lexical"
    assert browser.find_element(By.ID, "filter-1-eq").get_attribute("value") == "pubmed"


def test_one_mode_is_no_switch_and_one_filter_is_sent_alone(
    page_server: str, browser: WebDriver, monkeypatch: pytest.MonkeyPatch
) -> None:
    with_index_fields(monkeypatch, modes=["dense"], columns=[{"name": "year", "type": "int32"}])
    browser.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": RECORD_REQUESTS})
    browser.get(page_server + "?q=x&k=2&f.le.year=1999")
    WebDriverWait(browser, 20).until(lambda _: requests_sent(browser))
    assert not browser.find_element(By.ID, "mode").is_displayed()
    assert requests_sent(browser) == [{"query": "x", "k": 2, "filter": {"column": "year", "op": "<=", "value": 1999}}]
    assert browser.find_element(By.ID, "filter-0-le").get_attribute("value") == "1999"


def metrics_of(base: str) -> str:
    with urllib.request.urlopen(base + "metrics", timeout=10) as response:
        return response.read().decode()


@pytest.mark.parametrize("page_server", [{"max_k": 5}], indirect=True)
def test_the_page_takes_its_k_limit_from_the_server(page_server: str, browser: WebDriver) -> None:
    browser.get(page_server)
    k_box = browser.find_element(By.ID, "k")
    WebDriverWait(browser, 20).until(lambda _: k_box.get_attribute("max") == "5")
    assert k_box.get_attribute("value") == "5"  # the default 10 would be refused
    box = browser.find_element(By.ID, "q")
    box.send_keys("document number 42 about topic 0")
    browser.find_element(By.ID, "go").click()
    wait_for_hits(browser)
    assert len(browser.find_elements(By.CSS_SELECTOR, "#hits li")) == 5
    # the page's own requests (the page, /info, the search) are all answered: no favicon 404 counted as an error
    metrics = metrics_of(page_server)
    assert 'route="/",status="200"' in metrics and 'route="/search",status="200"' in metrics
    assert 'route="/info",status="200"' in metrics
    assert 'status="404"' not in metrics and "retrieval_errors_total{" not in metrics


@pytest.mark.parametrize("page_server", [{"api_key": "s3cret"}], indirect=True)
def test_behind_an_api_key_the_controls_come_once_the_key_is_given(page_server: str, browser: WebDriver) -> None:
    """/info needs the key too: the page first shows the plain search, then the index's controls once a search with
    the key has been answered."""
    browser.get(page_server)
    assert not browser.find_element(By.ID, "rescore").is_displayed()
    browser.find_element(By.ID, "key").send_keys("s3cret")
    search(browser, "document number 42 about topic 0", 2)
    assert browser.find_element(By.ID, "rescore").is_displayed()


def test_the_api_docs_render_without_internet(page_server: str, browser: WebDriver) -> None:
    browser.get(page_server + "docs")  # Swagger UI: one block per operation, drawn from /openapi.json
    WebDriverWait(browser, 30).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, ".opblock")) >= 8)
    paths = {e.text for e in browser.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert {"/search", "/embed", "/info", "/health"} <= paths
    browser.get(page_server + "redoc")
    WebDriverWait(browser, 30).until(lambda b: "/embed" in b.find_element(By.TAG_NAME, "body").text)
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("retrieval")  # ReDoc's title: the API's
