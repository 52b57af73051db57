"""The built site as a reader meets it: served on 127.0.0.1 and driven in headless Chromium by Playwright."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import http.server
import re
import shutil
import threading
from urllib.parse import urlparse

import nbformat
import pytest
from conftest import ROOT, TUTORIALS

ARTIFACTS = ROOT / "test-artifacts"  # screenshots, kept after the run (git ignores the folder)
PHONE = {"width": 375, "height": 812}
DESKTOP = {"width": 1280, "height": 900}
# A closed network: without these, Chromium keeps trying Google's hosts in the background.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


# The cell outputs wider than their box (which would scroll sideways), each as its longest line.
OUTPUTS_THAT_SCROLL = """() => [...document.querySelectorAll("div.cell_output pre, div.cell_output table")]
    .filter(box => box.scrollWidth > box.clientWidth + 1)
    .map(box => box.innerText.split("\\n").sort((a, b) => b.length - a.length)[0].slice(0, 80))"""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def base_url(site):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}/"
    server.shutdown()
    server.server_close()


@contextlib.contextmanager
def _chromium():
    """Debian's Chromium, driven by a Playwright of this thread's own (its API is one instance per thread)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    assert chromium, "the browser tests need Chromium: `apt-get install chromium` (nox -s tests installs it as root)"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def browser():
    with _chromium() as browser:
        yield browser


def _pages(site) -> list[str]:
    return sorted(
        p.relative_to(site).as_posix() for p in site.rglob("*.html") if not p.relative_to(site).parts[0].startswith("_")
    )


def _documents_only(page):
    """Load only the HTML documents on ``page``: for checks of what a page's HTML holds (its
    anchors, links and menus), each page in a fraction of the time its scripts, styles,
    fonts and images take."""
    page.route("**/*", lambda route: route.continue_() if route.request.resource_type == "document" else route.abort())
    return page


class _Watch:
    """What went wrong while a page loaded: console errors, failed or missing resources, other hosts."""

    def __init__(self, page):
        self.problems: list[str] = []
        page.on("console", lambda m: m.type == "error" and self.problems.append(f"console error: {m.text}"))
        page.on("requestfailed", self._failed)
        page.on("response", lambda r: r.status >= 400 and self.problems.append(f"HTTP {r.status}: {r.url}"))
        page.on("request", self._host)

    def _failed(self, request):
        # Moving on to the next page aborts a late request of this one (ERR_ABORTED), a race
        # on a busy machine, not a missing file: a missing file is an HTTP 404, caught above.
        if request.failure != "net::ERR_ABORTED":
            self.problems.append(f"failed ({request.failure}): {request.url}")

    def _host(self, request):
        url = urlparse(request.url)
        if url.scheme not in ("data", "blob") and url.hostname != "127.0.0.1":
            self.problems.append(f"request to another host: {request.url}")


@pytest.fixture(scope="module")
def desktop_visits(site, base_url) -> dict[str, dict]:
    """Every page loaded once at desktop width: what went wrong while it loaded, then axe-core's
    serious and critical violations on it. The two tests below read the same visit, instead of
    loading all the pages twice (about 30 s of a CI run).

    axe takes seconds a page (its color-contrast rule most of it), on one core, in the page's
    renderer; tabs of one browser did not audit faster side by side, two browsers did: each
    audits half of the pages."""
    paths = _pages(site)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        halves = pool.map(functools.partial(_visit, base_url), (paths[0::2], paths[1::2]))
        return {path: visit for half in halves for path, visit in half.items()}


def _visit(base_url: str, paths: list[str]) -> dict[str, dict]:
    from axe_playwright_python.sync_playwright import Axe

    visits = {}
    with _chromium() as browser:
        axe, page = Axe(), browser.new_page(viewport=DESKTOP)
        watch = _Watch(page)
        for path in paths:
            watch.problems.clear()
            page.goto(base_url + path, wait_until="networkidle")
            problems = list(watch.problems)  # before axe injects its script
            violations = [
                f"{path}: {v['id']} ({v['impact']}) {v['help']} at {[n['target'] for n in v['nodes'][:3]]}"
                for v in axe.run(page).response["violations"]
                if v["impact"] in ("serious", "critical")
            ]
            visits[path] = {
                "problems": problems,
                "violations": violations,
                "scrolling": page.evaluate(OUTPUTS_THAT_SCROLL),
            }
    return visits


def test_every_page_loads_with_no_console_error_missing_resource_or_other_host(desktop_visits):
    assert len(desktop_visits) >= len(TUTORIALS) + 4
    assert {path: visit["problems"] for path, visit in desktop_visits.items() if visit["problems"]} == {}


def test_no_cell_output_scrolls_sideways_on_a_laptop(desktop_visits):
    """Every line a cell printed is on the screen at 1,280 px (so at 1,400 too): none scrolls in its box."""
    assert {path: visit["scrolling"] for path, visit in desktop_visits.items() if visit["scrolling"]} == {}


def test_no_page_has_a_serious_or_critical_accessibility_violation(desktop_visits):
    """axe-core (the engine of browsers' accessibility audits), run on every page as served."""
    found = [violation for visit in desktop_visits.values() for violation in visit["violations"]]
    assert not found, "\n".join(found)


def test_every_figure_has_alt_text_that_says_what_it_shows(site):
    for path in _pages(site):
        for img in re.findall(r"<img\b[^>]*>", (site / path).read_text()):
            alt = re.search(r'alt="([^"]*)"', img)
            assert alt and len(alt.group(1).split()) >= 5, f"{path}: a figure without a description: {img[:200]}"
            assert not alt.group(1).endswith((".png", ".svg")), f"{path}: alt text is a file name: {img[:200]}"


def test_every_page_fits_a_phone_without_horizontal_scrolling_and_no_cell_output_scrolls(site, base_url, browser):
    page = browser.new_page(viewport=PHONE)  # 375 px: narrower than the 390 of many phones
    too_wide, scrolling = {}, {}
    for path in _pages(site):
        page.goto(base_url + path)  # to its "load" event: styles, scripts and images are in
        page.evaluate("document.fonts.ready.then(() => null)")  # and the fonts its text is laid out in
        overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
        if overflow > 0:
            too_wide[path] = overflow
        if hidden := page.evaluate(OUTPUTS_THAT_SCROLL):
            scrolling[path] = hidden
    page.close()
    assert too_wide == {}  # pixels past the screen's edge, per page
    assert scrolling == {}  # per page, the longest line of each cell output that scrolls in its box


def _search(page, base_url: str, words: str) -> None:
    """Sphinx's search page for ``words``, once it has listed every result (it adds them one by one, then says so)."""
    page.goto(base_url + f"search.html?q={words}")
    page.wait_for_function(
        """() => {
        const status = document.querySelector("#search-results p.search-summary");
        return status && /^(Search finished|Your search did not match)/.test(status.innerText);
    }""",
        timeout=15_000,
    )


def test_search_finds_summon_full_params_in_the_tips_and_the_tutorial(base_url, browser):
    page = browser.new_page(viewport=DESKTOP)
    _search(page, base_url, "summon_full_params")
    found = page.eval_on_selector_all("#search-results li a", "links => links.map(a => a.getAttribute('href'))")
    page.close()
    assert any(link.startswith("docs/fsdp_tips.html") for link in found), found
    assert any(link.startswith("tutorials/summon_full_params.html") for link in found), found


@pytest.mark.parametrize(("viewport", "per_row"), [(DESKTOP, 3), (PHONE, 1)], ids=["laptop", "phone"])
def test_the_landing_page_shows_every_goal_and_every_page_that_executes_one_click_away(
    base_url, browser, viewport, per_row
):
    from conftest import NOTEBOOKS

    page = browser.new_page(viewport=viewport)
    page.goto(base_url + "index.html", wait_until="networkidle")
    cards = page.eval_on_selector_all(".goal-card", "cards => cards.map(c => c.getBoundingClientRect().top)")
    links = page.eval_on_selector_all(
        ".goal-card li > p > a:first-child",
        """links => links.map(a => {
        const box = a.getBoundingClientRect();
        return [new URL(a.href).pathname.split("/").pop(), box.width > 0 && box.right <= window.innerWidth];
    })""",
    )
    page.close()
    assert len(cards) == 6 and len(set(round(top) for top in cards)) == 6 // per_row  # a map, not a column
    shown = {name.removesuffix(".html"): visible for name, visible in links}
    assert all(shown.get(p.stem) for p in NOTEBOOKS), shown  # each a visible link on the first page


def _indexed_errors(site) -> list[tuple[str, set[str]]]:
    """Each message of the errors index (without its class) and the pages that reproduce it."""
    import html

    index = (site / "docs" / "errors.html").read_text()
    listed = index[index.index('<ul class="errors-index') :]
    found = []
    for item in re.findall(r"<li>(.*?)</li>", listed[: listed.index("</ul>")], re.S):
        printed = html.unescape(re.sub(r"<[^>]+>", "", re.search(r"<code.*?</code>", item, re.S).group(0)))
        where = re.search(r'<p class="errors-where">(.*?)</p>', item, re.S).group(1)
        pages = {
            urlparse(href).path.removeprefix("../") if href.startswith("../") else f"docs/{urlparse(href).path}"
            for href in re.findall(r'href="([^"]+)"', where)
        }
        found.append((printed.split(": ", 1)[1], pages))
    return found


def test_searching_the_words_of_each_indexed_error_finds_the_page_that_reproduces_it(site, base_url, browser):
    errors = _indexed_errors(site)
    assert len(errors) >= 20
    page, missed = browser.new_page(viewport=DESKTOP), []
    for message, pages in errors:
        # The words of what a reader pastes, as Sphinx's index splits them (identifiers stay whole)
        words = " ".join(list(dict.fromkeys(re.findall(r"\b[A-Za-z_]\w{3,}", message)))[:8])
        _search(page, base_url, words)
        found = page.eval_on_selector_all("#search-results li a", "links => links.map(a => a.getAttribute('href'))")
        top = [urlparse(link).path for link in found][:5]
        if not pages & set(top):
            missed.append((words, sorted(pages), top))
    page.close()
    assert missed == [], "\n".join(map(str, missed))


def test_links_between_the_reference_tips_and_tutorials_land_on_existing_anchors(base_url, browser):
    page = _documents_only(browser.new_page(viewport=DESKTOP))
    targets = set()
    for source in ("docs/fsdp.html", "docs/fsdp_tips.html"):
        page.goto(base_url + source)
        targets |= set(
            page.eval_on_selector_all("article a.reference.internal[href*='#']", "links => links.map(a => a.href)")
        )
    wanted = re.compile(r"/(docs/fsdp|docs/fsdp_tips|tutorials/\w+)\.html#")
    targets = sorted(t for t in targets if wanted.search(t))
    assert len(targets) >= 20
    missing = []
    by_page = {}  # each page loaded once, for all the anchors linked on it
    for target in targets:
        by_page.setdefault(target.split("#", 1)[0], []).append(target)
    for url, linked in by_page.items():
        page.goto(url, wait_until="domcontentloaded")  # the anchors are in the HTML: no need to wait for images
        for target in linked:
            anchor = urlparse(target).fragment
            if not page.evaluate("id => document.getElementById(decodeURIComponent(id)) !== null", anchor):
                missing.append(target)
    page.close()
    assert missing == []


@pytest.mark.parametrize("tutorial", TUTORIALS, ids=lambda p: p.stem)
def test_each_tutorial_offers_its_executed_notebook_for_download(base_url, browser, tutorial):
    page = _documents_only(browser.new_page(viewport=DESKTOP))
    page.goto(base_url + f"tutorials/{tutorial.stem}.html", wait_until="domcontentloaded")  # the menu is in the HTML
    href = page.eval_on_selector(f"a[href$='{tutorial.stem}.ipynb']", "a => a.href")  # the download menu's link
    response = page.request.get(href)
    assert response.ok, href
    text = response.text()
    page.close()
    notebook = nbformat.reads(text, as_version=4)
    nbformat.validate(notebook)
    assert sum(len(c.get("outputs", [])) for c in notebook.cells if c.cell_type == "code") > 0


@pytest.mark.parametrize("viewport", [DESKTOP, PHONE], ids=["desktop", "phone"])
def test_screenshots_of_the_landing_page_and_a_tutorial(base_url, browser, viewport):
    ARTIFACTS.mkdir(exist_ok=True)
    page = browser.new_page(viewport=viewport)
    for name, path in (("landing", "index.html"), ("tutorial-quickstart", "tutorials/quickstart.html")):
        page.goto(base_url + path, wait_until="networkidle")
        shot = ARTIFACTS / f"{name}-{viewport['width']}px.png"
        page.screenshot(path=str(shot), full_page=False)
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000  # a real picture
    page.close()


def test_next_links_walk_through_the_tutorials_in_the_order_of_the_map(base_url, browser):
    order = re.findall(r"^\s+tutorials/(\w+)$", (ROOT / "index.rst").read_text(), flags=re.M)
    assert sorted(order) == sorted(t.stem for t in TUTORIALS)
    page = _documents_only(browser.new_page(viewport=DESKTOP))
    page.goto(base_url + f"tutorials/{order[0]}.html", wait_until="domcontentloaded")
    walked = [order[0]]
    for _ in order[1:]:
        with page.expect_navigation(wait_until="domcontentloaded"):  # the next link is in the HTML
            page.click("a.right-next")
        walked.append(urlparse(page.url).path.rsplit("/", 1)[-1].removesuffix(".html"))
    back = page.eval_on_selector("a.left-prev", "a => a.getAttribute('href')")
    page.close()
    assert walked == order
    assert back == f"{order[-2]}.html"
