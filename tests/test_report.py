"""The plan explorer's data and files, without a browser (tests/test_report_browser.py drives
Chromium): what the report says is what the plan says, the page fetches nothing, the CLI and
``dump`` write it, bad input is refused by name."""

import json
import re

import pytest

import partitioner
from partitioner.__main__ import main
from partitioner.report import report_html
from partitioner.report.data import report_data
from partitioner.report.timeline import read_trace, simulate_plan
from runtime.pipeline_trace import chrome_trace
from tests.report_plans import held_out_plans, searched_pipeline


def _data_of(html: str) -> dict:
    text = re.search(r'<script type="application/json" id="plan-data">(.*?)</script>', html, re.S).group(1)
    return json.loads(text.replace("<\\/", "</"))


def test_report_is_one_file_that_fetches_nothing():
    auto, forced = held_out_plans()
    html = report_html(auto, other=forced)
    assert "http://" not in html and "https://" not in html
    assert not re.search(r'<(script|link|img|iframe)[^>]+(src|href)=', html)   # every script and style inline
    assert "@import" not in html and "url(http" not in html
    data = _data_of(html)
    assert {r["id"] for r in data["rows"]} == {r["name"] for r in auto.records if r["kind"] != "output"}
    r = next(r for r in data["rows"] if r["name"] == "p_model_layers_0_mlp_up_proj_weight")
    assert r["explain"] == auto.explain("p_model_layers_0_mlp_up_proj_weight")    # the explain output itself


def test_estimate_split_adds_up_and_pipeline_timeline_ends_at_the_plans_step():
    auto, _ = held_out_plans()
    est = auto.estimate()
    split = report_data(auto)["estimate"]["split"]
    assert sum(split.values()) == pytest.approx(est.step_time_s, rel=1e-9) and split["bubble_s"] == 0
    pipe = searched_pipeline()
    sim = simulate_plan(pipe)
    assert sim["step_s"] == pytest.approx(pipe.data["pipeline"]["step_time_s"], rel=1e-12)   # the search's own replay
    end = max(e for rows in sim["timeline"].values() for _, _, e in rows)
    assert end == pytest.approx(sim["step_s"], rel=1e-12)
    assert sum(v for k, v in sim["split"].items() if k != "rank") == pytest.approx(sim["step_s"], rel=1e-9)
    data = report_data(pipe)
    assert data["axes"][0] == {"name": "pp", "size": 2, "role": "pipeline", "shares": [["pipeline", 1.0]]}
    assert [b["label"] for b in data["memory"]["bars"]] == ["rank 0, stage 0", "rank 1, stage 1"]
    assert data["search"]["rows"][0]["status"] == "chosen"
    assert any(r["reason"].startswith("slower by") for r in data["search"]["rows"])   # runner-ups say why
    staged = {(r["stage"], r["name"]) for r in data["rows"]}
    assert staged == {(s, r["name"]) for s, p in enumerate(pipe.stage_plans) for r in p.records if r["kind"] != "output"}


def test_diff_folds_a_change_made_in_every_layer_into_one_line():
    auto, forced = held_out_plans()
    stage = report_data(forced, other=auto)["diff"]["stages"][0]
    changed = forced.diff(auto).changed
    assert stage["changed_nodes"] == len(changed)
    assert sorted(n for g in stage["groups"] for n in g["nodes"]) == sorted(c[0] for c in changed)   # each once
    up = next(g for g in stage["groups"] if g["name"] == "mlp.up_proj.weight")
    assert up["layers"] == ["model.layers.0", "model.layers.1"] and up["before"] != up["after"]
    assert len(stage["groups"]) < 0.7 * len(changed)                 # 2 layers: most changes are made in both
    text = str(forced.diff(auto))                                     # partita diff's text is folded the same way
    assert "(the same in 2 layers of model.layers.[0-1])" in text and "views and getitems" in text
    assert len(text.splitlines()) < len(changed) / 2


def test_measured_trace_is_read_from_a_dumps_timeline_json(tmp_path):
    pipe = searched_pipeline()
    simulated = simulate_plan(pipe)["timeline"]
    measured = {r: [(a, 1.0 + 3 * s, 1.0 + 3 * e) for a, s, e in rows] for r, rows in simulated.items()}
    path = tmp_path / "timeline.json"
    path.write_text(chrome_trace({"measured": measured, "simulated (cost model, cluster h100)": simulated}))
    back = read_trace(path)
    assert {r: [a for a, _, _ in rows] for r, rows in back.items()} == {
        r: [a for a, _, _ in rows] for r, rows in measured.items()
    }
    timeline = report_data(pipe, trace=path)["timeline"]
    assert timeline["measured"] and timeline["simulated"]
    only_simulated = tmp_path / "only_simulated.json"
    only_simulated.write_text(chrome_trace({"simulated": simulated}))
    with pytest.raises(ValueError, match="no process named 'measured'"):
        read_trace(only_simulated)
    only_simulated.write_text(chrome_trace({"measured": {}}))
    with pytest.raises(ValueError, match="has no actions"):
        read_trace(only_simulated)


def test_cli_report_and_its_errors(tmp_path, capsys):
    auto, forced = held_out_plans()
    a, b = auto.save(tmp_path / "a.json"), forced.save(tmp_path / "b.json")
    out = tmp_path / "out" / "report.html"
    assert main(["report", str(a), "-o", str(out), "--diff", str(b), "-q"]) == 0
    data = _data_of(out.read_text())
    assert data["diff"]["names"] == ["a.json", "b.json"]
    not_plan = tmp_path / "x.json"
    not_plan.write_text("{}")
    assert main(["report", str(not_plan), "-o", str(out)]) == 2
    assert "not a Partita sharding plan" in capsys.readouterr().err
    assert main(["report", str(a), "-o", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["report", str(a), "-o", str(out), "--trace", str(b)]) == 2     # a plan without a pipeline
    assert "for a pipelined plan" in capsys.readouterr().err


def test_dump_writes_the_report(tmp_path):
    auto, _ = held_out_plans()
    files = partitioner.dump(auto, tmp_path)
    assert tmp_path / "report.html" in files
    assert _data_of((tmp_path / "report.html").read_text())["header"]["model"] == "Qwen2ForCausalLM"


def test_dump_timeline_picture_draws_both_timelines_on_one_scale():
    from runtime.pipeline_trace import timeline_svg

    simulated = {0: [("0F0", 0.0, 1.0), ("0B0", 2.0, 4.0)], 1: [("1F0", 1.0, 2.0), ("1B0", 2.0, 3.0)]}
    measured = {r: [(a, 2 * s, 2 * e) for a, s, e in rows] for r, rows in simulated.items()}
    svg = timeline_svg({"simulated": simulated, "measured": measured})
    widths = [float(w) for w in re.findall(r'<rect x="[\d.]+" y="\d+" width="([\d.]+)" height="22" fill', svg)]
    assert widths[4:] == pytest.approx([2 * w for w in widths[:4]])     # twice as long: twice as wide


def test_embedded_data_cannot_end_its_script_element_and_has_no_infinities():
    from partitioner.report import _embedded_json

    text = _embedded_json({"name": "</script><script>alert(1)", "bound": float("inf"), "x": [float("nan")]})
    assert "</" not in text and json.loads(text.replace("<\\/", "</")) == {
        "name": "</script><script>alert(1)", "bound": None, "x": [None]}
