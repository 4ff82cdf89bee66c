"""The plan explorer: one self-contained HTML file to look at a plan instead of reading it.

``write_report(plan, path)`` (also ``ShardingPlan.report(path)``, ``partita report PLAN.json
-o report.html`` and ``partitioner.dump``) writes one HTML file holding the configuration (mesh
axes with their roles), the estimate (the step split into compute, exposed communication,
optimizer step and bubble; MFU; memory per device as a chart), the configuration search's
runner-ups and why they lost, the plan table (sortable, filterable, repeated blocks folded, a
click on a node showing its ``explain``), the graph coloured by placement with a legend and
collectives on its edges, a pipeline's timeline per rank (simulated, and measured from a trace)
on one time scale, and, given a second plan, a diff folded by block.

The page is assembled from the files shipped with the package (``template.html``,
``report.css``, ``report.js`` and ``report_views.js``) and the data of :func:`partitioner.report.data.report_data`
embedded as JSON: no script, style, font or picture is fetched from anywhere, so the file opens
offline, from an e-mail or a CI artifact. The script only draws; every figure is computed in
Python by the functions ``partita show`` and ``partita explain`` use.
"""

from __future__ import annotations

import json
import logging
import math
from importlib import resources
from pathlib import Path

from partitioner.report.data import report_data

__all__ = ["write_report", "report_html", "report_data"]

logger = logging.getLogger(__name__)


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def _finite(value):
    """``value`` with every infinite or NaN float as None (JSON has neither; a bound the search
    could not compute is saved as ``Infinity``)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _embedded_json(data: dict) -> str:
    """JSON safe inside ``<script>``: no ``</`` (which would end the element) and no ``<!--``."""
    text = json.dumps(_finite(data), separators=(",", ":"), allow_nan=False)
    return text.replace("</", "<\\/").replace("<!--", "<\\!--")


def report_html(plan, *, other=None, trace=None, names=("this plan", "the other plan")) -> str:
    """The report of ``plan`` as one HTML document (see the module docstring)."""
    data = report_data(plan, other=other, trace=trace, names=names)
    page = _asset("template.html")
    for marker, text in (
        ("/*STYLE*/", _asset("report.css")),
        ("/*SCRIPT*/", _asset("report_views.js") + _asset("report.js")),  # report.js ends by drawing the page
        ("/*DATA*/", _embedded_json(data)),
    ):
        head, sep, tail = page.partition(marker)
        assert sep, f"the report template lost its {marker} marker"
        page = head + text + tail
    return page


def write_report(plan, path, *, other=None, trace=None, names=None) -> Path:
    """Write the report of ``plan`` to ``path`` (an ``.html`` file); returns the path.

    ``other``: a second :class:`ShardingPlan` to compare with (the diff view); ``trace``: the
    ``timeline.json`` a pipeline job's ``partitioner.dump`` wrote, drawn as the measured step
    beside the simulated one; ``names``: how the diff calls the two plans.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{path} is a directory: give the report's file name, e.g. {path / 'report.html'}")
    html = report_html(plan, other=other, trace=trace, names=tuple(names or ("this plan", "the other plan")))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html, encoding="utf-8")
    logger.info("report written to %s (%d KiB)", path, len(html) // 1024)
    return path
