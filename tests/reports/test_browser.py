"""The report in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright):
tabs, a prompt page, a heatmap hover; no console error, no request outside file://, no dialog
from the script-bearing prompts, and the verdict text is the comparisons row's.

Screenshots go to $CAPTURESTORE_TEST_ARTIFACTS (default: test-artifacts/) under reports/.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

import reports
from tests.reports.conftest import REPO
from tests.reports.synthetic import XSS_PROMPTS

CHROMIUM = os.environ.get("CAPTURESTORE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]

sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium; .ci/run installs it)", allow_module_level=True)


@pytest.fixture(scope="module")
def artifacts() -> Path:
    d = Path(os.environ.get("CAPTURESTORE_TEST_ARTIFACTS") or REPO / "test-artifacts") / "reports"
    d.mkdir(parents=True, exist_ok=True)
    return d


class Watched:
    """A fresh Chromium profile and page recording console errors, requests and dialogs."""

    def __init__(self, pw, profile: Path):
        self.ctx = pw.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                         args=FLAGS, viewport={"width": 1400, "height": 1000})
        self.errors, self.requests, self.dialogs = [], [], []
        self.ctx.on("request", lambda r: self.requests.append(r.url))
        self.page = self.ctx.new_page()
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("dialog", lambda d: (self.dialogs.append(d.message), d.dismiss()))

    def outside_file(self) -> list[str]:
        return [u for u in self.requests if not u.startswith("file://")]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    with sync_api.sync_playwright() as pw:
        w = Watched(pw, tmp_path_factory.mktemp("chromium-profile"))
        yield w
        w.ctx.close()


def _hover_heatmap(frame, div_id: str) -> str:
    frame.locator(f"#{div_id}").scroll_into_view_if_needed()  # figures are drawn as they come into view
    frame.wait_for_selector(f"#{div_id} .main-svg", timeout=15000)
    frame.hover(f"#{div_id} .nsewdrag")
    label = frame.wait_for_selector(".hoverlayer .hovertext", timeout=5000)
    return label.text_content()


def test_report_in_headless_chromium(browser, compared, tmp_path_factory, artifacts):
    store, cid = compared["store"], compared["bug"].comparison_id
    row = store.sql(f"SELECT logit_summary, kv_summary FROM comparisons WHERE comparison_id = '{cid}'").to_pylist()[0]
    index = reports.render_comparison(store, cid, tmp_path_factory.mktemp("browser-report"))
    page = browser.page

    t0 = time.perf_counter()
    page.goto(index.as_uri())
    page.wait_for_selector("#verdict-headline")
    usable_s = time.perf_counter() - t0
    assert page.inner_text("#verdict-headline") == "FAIL"
    assert page.inner_text("#verdict-logit") == f"logits: {row['logit_summary']}"
    assert page.inner_text("#verdict-kv") == f"KV: {row['kv_summary']}"
    assert page.get_attribute('nav.tabs button[data-tab="overview"]', "aria-selected") == "true"
    page.screenshot(path=str(artifacts / "overview.png"), full_page=True)

    # the overview has no figure: plotly.min.js is not loaded until a tab with figures opens
    assert page.evaluate("typeof window.Plotly") == "undefined"
    assert not [u for u in browser.requests if u.endswith("/plotly.min.js")]
    page.click('nav.tabs button[data-tab="kv"]')
    assert page.is_visible("#tab-kv") and not page.is_visible("#tab-overview")  # shown by the click itself
    hover = _hover_heatmap(page, "div-agg-k-bc")
    assert "BC" in hover and "generation token" in hover
    page.screenshot(path=str(artifacts / "kv.png"), full_page=True)

    page.click('nav.tabs button[data-tab="prompts"]')
    assert page.get_attribute("#prompt-frame", "src") is None  # prompt pages load on demand only
    for n, text in enumerate(XSS_PROMPTS[:2]):
        page.click(f'.sidebar a[data-page="p{n:04d}"]')
        frame = page.frame_locator("#prompt-frame")
        # retried until the new page replaced the previous one in the frame: shown as text, not markup
        sync_api.expect(frame.locator("#prompt-text")).to_have_text(text)
        assert frame.locator("#prompt-text img").count() == 0 and frame.locator("#prompt-text script").count() == 0
    page.fill("#prompt-filter", "onerror")  # the sidebar filter matches the text, not markup
    assert page.eval_on_selector_all(".sidebar a[data-page]", "as => as.filter(a => !a.hidden).map(a => a.dataset.page)") \
        == ["p0001"]
    page.fill("#prompt-filter", "")
    inner = page.frame(name="prompt-frame")
    assert inner.url.endswith("/prompts/p0001.html"), inner.url
    hover = _hover_heatmap(inner, "div-k-linf")
    assert "L-inf" in hover and "position" in hover
    page.screenshot(path=str(artifacts / "prompt.png"))

    page.click('nav.tabs button[data-tab="queries"]')
    assert "FROM kv_head_metrics" in page.inner_text("#tab-queries")
    page.wait_for_timeout(300)  # a late onerror / console message would land here
    assert browser.dialogs == []
    assert browser.errors == []
    assert browser.outside_file() == []
    assert usable_s < 10, f"first page took {usable_s:.2f} s"
    print(f"first page usable after {usable_s:.2f} s; screenshots in {artifacts}")


def test_passing_report_shows_a_green_banner_and_the_noise_branch(browser, compared, tmp_path_factory, artifacts):
    store, cid = compared["store"], compared["ok"].comparison_id
    index = reports.render_comparison(store, cid, tmp_path_factory.mktemp("browser-ok"))
    browser.page.goto(index.as_uri())
    banner = browser.page.locator("#verdict")
    assert "pass" in banner.get_attribute("class").split() or "warn" in banner.get_attribute("class").split()
    assert browser.page.inner_text("#verdict-headline").startswith("PASS")
    on = browser.page.eval_on_selector_all(".flow .node.on", "ns => ns.map(n => n.dataset.node)")
    assert "logits" in on and "bug" not in on and "prefill" not in on
    browser.page.screenshot(path=str(artifacts / "overview-pass.png"), full_page=True)
    assert browser.dialogs == [] and browser.errors == [] and browser.outside_file() == []
