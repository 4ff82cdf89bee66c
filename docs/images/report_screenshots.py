"""Redraw the report screenshots in docs/images (``python docs/images/report_screenshots.py``).

Plans a 12-layer GPT (width 2048) on a 2x4 mesh of H100s (built on ``meta``: nothing is
allocated), and the same model with Megatron tensor parallelism forced to compare with,
writes the report with its diff, and photographs three of its views with Debian's Chromium
(headless, through Playwright, as tests/test_report_browser.py drives it).
"""

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

import partitioner  # noqa: E402
from partitioner.demo_clusters import meta_gpt  # noqa: E402


def main() -> None:
    model, inputs = meta_gpt(12, 2048, 16, 8, 1024)
    plan = partitioner.plan(model, inputs, mesh=(2, 4), mesh_axis_names=("a0", "a1"), cluster="h100")
    data_only = partitioner.plan(model, inputs, mesh=(2, 4), mesh_axis_names=("a0", "a1"), cluster="h100",
                                 pins={"idx": "[S(0), S(0)]", "h.0.mlp.c_fc.weight": "[R, R]"})
    folder = Path(tempfile.mkdtemp())
    path = plan.report(folder / "report.html", other=data_only, names=("solver's plan", "pinned data parallel"))
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"),
                                    args=["--headless", "--no-sandbox", "--disable-background-networking"])
        page = browser.new_page(viewport={"width": 1400, "height": 860})
        page.goto(path.as_uri())
        page.wait_for_selector("body[data-ready='1']")
        page.screenshot(path=HERE / "report.png")
        page.click("#tab-button-table")
        page.click("tr.node[data-node='linear_2']")
        page.screenshot(path=HERE / "report_table.png")
        page.click("#detail-close")
        page.click("#tab-button-graph")
        page.screenshot(path=HERE / "report_graph.png")
        browser.close()
    print(f"report: {path}; screenshots in {HERE}")


if __name__ == "__main__":
    main()
