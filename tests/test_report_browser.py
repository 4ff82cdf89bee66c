"""The plan explorer in a real browser: Debian's Chromium, headless, driven by Playwright.

One browser for the module (``browser`` fixture), launched from the system's ``chromium``
(``executable_path``; Playwright never downloads a browser here) with networking in the
background off. The page is opened from a file: it must load with no console error, hold every
node of the plan in its DOM, filter its table as one types, show a node's ``explain`` when
clicked, draw a non-blank picture, and render the diff and the pipeline timeline. Without
Chromium the tests are skipped, except under ``PARTITA_REQUIRE_BROWSER=1`` (``.ci/run``),
where that is a failure: CI must run them.
"""

import base64
import os
import shutil

import pytest

from partitioner.plan_graph import plan_graph
from runtime.pipeline_trace import chrome_trace
from tests.report_plans import held_out_plans, searched_pipeline

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def _need_browser():
    problem = None
    if CHROMIUM is None:
        problem = "no chromium on PATH (apt-get install chromium)"
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            problem = "the Python package playwright is not installed (pip install -c constraints.txt playwright)"
    if problem is None:
        return
    if os.environ.get("PARTITA_REQUIRE_BROWSER") == "1":
        pytest.fail(problem + " (PARTITA_REQUIRE_BROWSER=1: CI must run the browser tests)")
    pytest.skip(problem + "; CI (.ci/run) installs it")


@pytest.fixture(scope="module")
def browser():
    _need_browser()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM,
            args=["--headless", "--no-sandbox", "--disable-background-networking", "--disable-dev-shm-usage"],
        )
        yield b
        b.close()


def open_report(browser, path):
    """(page, errors): the report loaded from its file; errors collects console errors and
    uncaught exceptions, and any request that leaves the file."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: errors.append(f"fetched {r.url}") if not r.url.startswith("file:") else None)
    page.goto(path.as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=20_000)
    return page, errors


def _pixel_spread(browser, png: bytes) -> float:
    """The standard deviation of a screenshot's grey levels (0 for a blank page), computed by
    the browser itself on a blank page of its own (a canvas reads the PNG back)."""
    page = browser.new_page()
    spread = page.evaluate(
        """async (src) => {
        const img = new Image(); img.src = src; await img.decode();
        const canvas = document.createElement('canvas'); canvas.width = img.width; canvas.height = img.height;
        const ctx = canvas.getContext('2d'); ctx.drawImage(img, 0, 0);
        const d = ctx.getImageData(0, 0, img.width, img.height).data;
        let n = 0, sum = 0, squares = 0;
        for (let i = 0; i < d.length; i += 4) { const g = (d[i] + d[i + 1] + d[i + 2]) / 3; n++; sum += g; squares += g * g; }
        const mean = sum / n; return Math.sqrt(squares / n - mean * mean);
    }""",
        "data:image/png;base64," + base64.b64encode(png).decode(),
    )
    page.close()
    return spread


@pytest.fixture(scope="module")
def held_out_report(tmp_path_factory):
    """``partita report`` of the held-out model's plan, with the diff against the forced plan."""
    from partitioner.__main__ import main

    auto, forced = held_out_plans()
    folder = tmp_path_factory.mktemp("report")
    a, b = auto.save(folder / "auto.json"), forced.save(folder / "forced.json")
    out = folder / "report.html"
    assert main(["report", str(b), "-o", str(out), "--diff", str(a), "-q"]) == 0
    return out, forced


def test_held_out_model_report_renders_every_node_without_errors(browser, held_out_report):
    path, plan = held_out_report
    text = path.read_text()
    assert "http://" not in text and "https://" not in text
    page, errors = open_report(browser, path)
    names = [r["name"] for r in plan.records if r["kind"] != "output"]
    missing = page.evaluate("names => names.filter(n => !document.querySelector(`tr.node[data-node=\"${n}\"]`))", names)
    assert missing == []
    assert page.locator("#config .axis-row").count() == 2 and page.locator("#memory .memory-row").count() == 1
    assert _pixel_spread(browser, page.screenshot()) > 10, "the report's screenshot is blank"
    blank = browser.new_page()
    assert _pixel_spread(browser, blank.screenshot()) < 1          # the measure tells a blank page apart
    blank.close()
    assert errors == []
    page.close()


def test_table_filters_sorts_unfolds_and_explains(browser, held_out_report):
    path, plan = held_out_report
    page, errors = open_report(browser, path)
    page.click("#tab-button-table")
    visible = "() => [...document.querySelectorAll('tr.node')].filter(r => r.style.display !== 'none')"
    folded = page.evaluate(f"({visible})().length")
    assert 0 < folded < len(plan.records) - 1                       # later layers, views, masks folded
    page.click("tr.block-head")                                     # unfold the block: every layer
    assert page.evaluate(f"({visible})().length") > folded
    page.fill("#filter", "down_proj weight")
    rows = page.evaluate(f"({visible})().map(r => r.dataset.name)")
    assert sorted(rows) == sorted(f"p_model_layers_{i}_mlp_down_proj_weight" for i in range(2))
    page.fill("#filter", "")
    page.click("th[data-sort='memory_b']")
    page.click("th[data-sort='memory_b']")                          # descending
    first = page.evaluate(f"({visible})()[0].dataset.name")
    assert first == max(plan.records, key=lambda r: r.get("memory", 0.0))["name"]
    page.click("tr.node[data-node='p_model_layers_0_mlp_up_proj_weight']")
    assert page.locator("#detail.open").count() == 1
    assert page.inner_text("#explain") == plan.explain("p_model_layers_0_mlp_up_proj_weight")
    assert "ZeRO-3" in page.inner_text("#explain") or "->" in page.inner_text("#explain")
    assert errors == []
    page.close()


def test_graph_and_diff_render(browser, held_out_report):
    path, plan = held_out_report
    page, errors = open_report(browser, path)
    page.click("#tab-button-graph")
    assert page.locator(".gnode").count() > 10 and page.locator(".comm-edge").count() > 0   # collectives drawn
    items = page.evaluate("[...document.querySelectorAll('.graph-legend .item')].map(i => i.textContent)")
    assert items == [*plan_graph(plan).legend, "collective on an edge"]          # one swatch per placement drawn
    assert page.locator(".graph-legend .swatch").count() == len(items)
    page.locator(".gnode[data-id='linear']").first.click()
    assert page.inner_text("#explain") == plan.explain("linear")
    page.click("#tab-button-diff")
    assert page.locator("table.diff-table tr.diff-row").count() > 0
    assert "forced.json" in page.inner_text("#diff-summary") and "auto.json" in page.inner_text("#diff-summary")
    assert errors == []
    page.close()


def test_pipeline_timeline_draws_simulated_and_measured_on_one_scale(browser, tmp_path):
    from partitioner.report.timeline import simulate_plan

    plan = searched_pipeline()
    simulated = simulate_plan(plan)["timeline"]
    # a measured step twice as long as the simulation (the trace format partitioner.dump writes)
    measured = {r: [(a, 5.0 + 2 * s, 5.0 + 2 * e) for a, s, e in rows] for r, rows in simulated.items()}
    trace = tmp_path / "timeline.json"
    trace.write_text(chrome_trace({"measured": measured}))
    path = plan.report(tmp_path / "pipeline.html", trace=trace)
    page, errors = open_report(browser, path)
    page.click("#tab-button-timeline")
    widths = page.evaluate(
        """() => {
        const boxes = [...document.querySelectorAll('#timeline-svg rect.action')];
        const half = boxes.length / 2;
        const span = bs => Math.max(...bs.map(b => +b.getAttribute('x') + +b.getAttribute('width'))) - Math.min(...bs.map(b => +b.getAttribute('x')));
        return [span(boxes.slice(0, half)), span(boxes.slice(half))];
    }"""
    )
    assert widths[1] == pytest.approx(2 * widths[0], rel=0.02)     # one time scale: twice as long, twice as wide
    page.click("#tab-button-overview")
    assert page.locator("#search .search-row").count() == len(plan.data["search"]["rows"])
    assert errors == []
    page.close()
