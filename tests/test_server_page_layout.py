"""The search page's layout at a phone's width (400 px) and a desktop's (1,200 px), its keyboard use, and an
accessibility check by axe-core injected into the page. Chromium renders titled abstracts with 7-digit ids, as
PubMed-like corpora have them; each check is measured in the rendered page (element boxes, the PNG's size).

axe-core comes from npm (``make axe`` puts a pinned copy under .cache/npm; ``RETRIEVAL_AXE_CORE`` names another
axe.min.js). ``RETRIEVAL_PAGE_SHOTS=DIR`` also writes the two screenshots into DIR (the ones under docs/images).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import write_corpus

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install -e '.[dev]')")

from page_driver import PAGE_TESTS, chromium, search, serve_index  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from retrieval.serve import routes as server  # noqa: E402

pytestmark = PAGE_TESTS
ROOT = Path(__file__).resolve().parents[1]
AXE = Path(os.environ.get("RETRIEVAL_AXE_CORE") or ROOT / ".cache/npm/node_modules/axe-core/axe.min.js")
QUERY = "does vitamin D reduce fractures"
WIDTHS = {"phone": (400, 860, True), "desktop": (1200, 900, False)}

SUBJECTS = ["vitamin D", "calcium", "bone density", "hip fractures", "sleep", "blood pressure", "statins", "exercise"]
GROUPS = ["older women", "adults over 65", "postmenopausal women", "nursing-home residents", "young athletes"]
DESIGNS = ["randomised trial", "cohort study", "meta-analysis", "case-control study"]


def abstract(rng: random.Random) -> tuple[str, str]:
    """A title and a ~130-word abstract in the style of a medical paper's."""
    a, b = rng.sample(SUBJECTS, 2)
    group, design, n = rng.choice(GROUPS), rng.choice(DESIGNS), rng.randrange(120, 9000)
    title = f"{a[0].upper() + a[1:]} and {b}: a {design} in {group}"
    text = " ".join(
        [
            f"Background: whether {a} changes {b} in {group} is uncertain, and guidelines differ.",
            f"Methods: a {design} of {n:,} {group} followed for {rng.randrange(2, 12)} years; {a} was measured at",
            f"baseline and every {rng.choice(['six', 'twelve'])} months, falls and fractures were recorded by staff",
            "blind to the exposure, and models were adjusted for age, weight, smoking and treatment.",
            f"Results: the highest quarter of {a} had a {rng.randrange(5, 40)}% lower risk of poor {b} than the",
            f"lowest (hazard ratio 0.{rng.randrange(55, 95)}, 95% CI 0.{rng.randrange(40, 55)} to 0.97); the effect",
            f"was larger in {rng.choice(GROUPS)} and did not depend on the dose of vitamin D supplements.",
            f"Conclusions: {a} is a modest, measurable factor in {b}; trials in {group} should now test whether",
            "changing it reduces fractures and falls.",
        ]
    )
    return title, text


@pytest.fixture
def abstracts_server(tmp_path: Path) -> Iterator[str]:
    """60 titled abstracts with 7-digit ids, indexed with their title column."""
    rng = random.Random(1338)
    pairs = [abstract(rng) for _ in range(60)]
    ids = [str(n) for n in rng.sample(range(1_000_000, 10_000_000), 60)]
    corpus = write_corpus(
        tmp_path / "abstracts.parquet", n=60, id=ids, title=[t for t, _ in pairs], text=[x for _, x in pairs]
    )
    with serve_index(tmp_path, corpus, {}, title_column="title") as url:
        yield url


def every_control(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on /info also lists modes and kept columns (which this index lacks), so the page shows every
    control it has."""
    describe = server.describe

    def described(service: Any) -> dict[str, Any]:
        info = describe(service)
        columns = [{"name": "year", "type": "int64"}, {"name": "journal", "type": "string"}]
        info["index"].update(modes=["dense", "lexical", "hybrid"], default_mode="hybrid", columns=columns)
        return info

    monkeypatch.setattr(server, "describe", described)


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


BOXES = """
const px = (el) => parseFloat(getComputedStyle(el).lineHeight);
const box = (el) => { const r = el.getBoundingClientRect(); return {left: r.left, right: r.right, height: r.height,
                                                                    line: px(el), text: el.textContent}; };
const all = (selector) => [...document.querySelectorAll(selector)].filter(e => e.offsetParent !== null).map(box);
return {width: window.innerWidth, scroll: document.documentElement.scrollWidth, ids: all('#hits .id'),
        snippets: all('#hits .snippet'), titles: all('#hits h2'),
        controls: all('input, select, button, label, fieldset')};
"""


@pytest.mark.parametrize("screen", WIDTHS)
def test_the_page_fits_a_phone_and_a_desktop(abstracts_server: str, tmp_path: Path, screen: str) -> None:
    """No horizontal scroll; every control and title within the window; each 7-digit id on one line, whole; each
    snippet at most three lines (and at least one); a "more" button on each, as every abstract is longer; the
    screenshot is the viewport, rendered."""
    width, height, mobile = WIDTHS[screen]
    with chromium(tmp_path, width, height, mobile) as browser:
        browser.get(abstracts_server)
        hits = search(browser, QUERY, 5)
        assert len(hits) == 5 and all(h["title"] and h["snippet"] for h in hits)
        assert not any(h["full"].startswith(h["title"]) for h in hits)  # the title is shown once, above the text
        shown = browser.execute_script(BOXES)
        assert shown["width"] == width and shown["scroll"] <= width, (shown["scroll"], width)
        for control in shown["controls"] + shown["titles"]:
            assert control["left"] >= 0 and control["right"] <= width, control
        assert len(shown["ids"]) == 5
        for id_box in shown["ids"]:
            assert len(id_box["text"]) == 7 and id_box["height"] < 1.5 * id_box["line"], id_box
        for snippet in shown["snippets"]:
            assert snippet["line"] * 0.9 <= snippet["height"] <= 3 * snippet["line"] + 1, snippet
        assert all(more.is_displayed() for more in browser.find_elements(By.CSS_SELECTOR, "#hits .more"))
        marks = browser.find_elements(By.CSS_SELECTOR, "#hits .snippet mark")
        seen = {m.text.lower() for m in marks} - {""}  # "": a mark below the snippet's third line, clipped
        assert seen and seen <= {"vitamin", "d", "reduce", "fractures"}

        shot = browser.get_screenshot_as_png()
        assert png_size(shot) == (width, height) and len(shot) > 20_000  # a rendered page, not a blank canvas
        (tmp_path / f"page-{width}.png").write_bytes(shot)
        if os.environ.get("RETRIEVAL_PAGE_SHOTS"):
            shutil.copy(tmp_path / f"page-{width}.png", Path(os.environ["RETRIEVAL_PAGE_SHOTS"]) / f"page-{width}.png")

        browser.find_element(By.CSS_SELECTOR, "#hits .more").click()  # the whole text: longer, and still no scroll
        full = browser.find_element(By.CSS_SELECTOR, "#hits .full")
        assert full.is_displayed() and full.size["height"] > 3 * shown["snippets"][0]["line"]
        assert browser.execute_script("return document.documentElement.scrollWidth") <= width


def test_the_keyboard_alone_searches_and_opens_a_hit(abstracts_server: str, tmp_path: Path) -> None:
    """Enter in the query box searches; Tab goes query, Search, Hits, re-scoring, API key, then the hits' "more"
    buttons, in reading order; the focused control shows a visible outline; Enter on "more" opens the text."""
    with chromium(tmp_path, 1200, 900) as browser:
        browser.get(abstracts_server)
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "rescore").is_displayed())
        assert browser.switch_to.active_element.get_attribute("id") == "q"  # autofocus
        browser.switch_to.active_element.send_keys(QUERY + Keys.ENTER)
        WebDriverWait(browser, 20).until(lambda b: len(b.find_elements(By.CSS_SELECTOR, "#hits li")) == 10)
        order = []
        for _ in range(6):
            browser.switch_to.active_element.send_keys(Keys.TAB)
            focused = browser.switch_to.active_element
            order.append(focused.get_attribute("id") or focused.get_attribute("class"))
            style = browser.execute_script(
                "const s = getComputedStyle(document.activeElement); return [s.outlineStyle, s.outlineWidth]"
            )
            assert style[0] == "solid" and float(style[1].removesuffix("px")) >= 2, (order[-1], style)
        assert order == ["go", "k", "rescore", "key", "more", "more"]
        focused = browser.switch_to.active_element  # the second hit's "more"
        focused.send_keys(Keys.ENTER)
        assert focused.get_attribute("aria-expanded") == "true"
        assert browser.find_elements(By.CSS_SELECTOR, "#hits .full")[1].is_displayed()


def test_every_control_has_a_label(abstracts_server: str, tmp_path: Path) -> None:
    with chromium(tmp_path, 1200, 900) as browser:
        browser.get(abstracts_server)
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "rescore").is_displayed())
        unlabelled = browser.execute_script(
            "return [...document.querySelectorAll('input, select')].filter(e => e.labels.length === 0"
            " || ![...e.labels].some(l => l.textContent.trim())).map(e => e.id)"
        )
        assert unlabelled == []


def axe_violations(browser: WebDriver) -> list[dict[str, Any]]:
    browser.execute_script(AXE.read_text(encoding="utf-8"))
    browser.set_script_timeout(60)
    found = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "axe.run(document, {resultTypes: ['violations']}).then("
        "  r => done(r.violations.map(v => ({id: v.id, impact: v.impact, nodes: v.nodes.map(n => n.target)}))),"
        "  e => done({error: String(e)}));"
    )
    assert isinstance(found, list), found
    return found


@pytest.mark.skipif(not AXE.is_file(), reason=f"axe-core is not installed at {AXE}: make axe (npm install)")
@pytest.mark.parametrize("screen", WIDTHS)
def test_axe_finds_no_serious_or_critical_violation(
    abstracts_server: str, tmp_path: Path, screen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """axe-core's rules (WCAG 2.x A and AA, and its best practices) find nothing serious or critical, twice: hits
    listed with the first one opened; then every control shown (modes and filters from /info) and an error in the
    status line (this server refuses `mode`). What it finds is written to axe.json beside the test's files."""
    width, height, mobile = WIDTHS[screen]
    found = {}
    with chromium(tmp_path, width, height, mobile) as browser:
        browser.get(abstracts_server)
        search(browser, QUERY, 5)
        browser.find_element(By.CSS_SELECTOR, "#hits .more").click()
        found["hits"] = axe_violations(browser)

        every_control(monkeypatch)
        browser.get(abstracts_server)
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "filters").is_displayed())
        browser.find_element(By.ID, "q").send_keys(QUERY + Keys.ENTER)
        WebDriverWait(browser, 20).until(lambda b: "error" in b.find_element(By.ID, "status").get_attribute("class"))
        found["controls"] = axe_violations(browser)
    (tmp_path / "axe.json").write_text(json.dumps(found, indent=1))
    for violations in found.values():
        assert [v for v in violations if v["impact"] in ("serious", "critical")] == []
        assert violations == []  # nothing of lesser impact either, as of axe-core's pinned version
