"""The command line: ``python -m partitioner plan|show|explain|diff``.

Most cases call ``main([...])`` in this process; one test runs the real ``python -m`` end to
end. Planning is shared: one plan of a one-layer GPT on a 2x2 mesh, saved once per module.
"""
from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
import textwrap

import pytest

from partitioner import ShardingPlan
from partitioner.__main__ import main

HEADER = "placement dp×tp"
GPT_1L = ["partitioner.models:gpt_demo", "--kwargs", '{"n_layer": 1}', "--mesh", "2x2", "--axis-names", "dp,tp"]


def run_main(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def assert_usage_error(code, err, *fragments):
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("partita: error:")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """The plan subcommand, run once: (exit code, stdout, stderr, path of the saved plan)."""
    path = tmp_path_factory.mktemp("cli") / "a.json"
    code, out, err = run_main(["plan", *GPT_1L, "--budget", "80GiB", "--json", str(path),
                               "--explain", "h.0.mlp.c_fc"])
    return code, out, err, path


def test_plan_prints_table_and_estimate_and_saves(planned):
    code, out, err, path = planned
    assert code == 0, err
    assert HEADER in out and "h.0.mlp.c_fc.weight" in out
    assert max(len(line) for line in out.splitlines()) <= 120   # fits a 120-column terminal
    assert "estimate per device per training step:" in out
    assert "of 80.00 GiB budget" in out
    assert "explain h.0.mlp.c_fc:" in out and "-> out" in out
    # progress goes to stderr, and only there
    assert "capture:" in err and "plan ready" in err and f"plan written to {path}" in err
    assert "[partita" not in out
    plan = ShardingPlan.load(path)
    assert plan.mesh_shape == (2, 2) and plan.axis_names == ("dp", "tp")
    assert plan.data["budget"] == 80 * 2**30 and plan.data["optimizer"] == "adam"
    assert sum(1 for r in plan.records if r.get("fqn") == "h.0.mlp.c_fc.weight") == 1
    assert not any((r.get("fqn") or "").startswith("h.1.") for r in plan.records)  # --kwargs reached the factory


def test_show_reads_a_saved_plan(planned, capsys):
    *_, path = planned
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert HEADER in out and "estimate per device per training step:" in out
    assert "planned for    inputs idx 8x64, targets 8x64; objective time, optimizer adam" in out
    assert main(["show", str(path), "--verbose-table", "--explain", "lm_head"]) == 0
    verbose = capsys.readouterr().out
    assert len(verbose.splitlines()) > len(out.splitlines())
    assert "getitem" in verbose and "getitem" not in out
    assert "explain lm_head:" in verbose
    assert main(["show", str(path), "--wide"]) == 0
    wide = capsys.readouterr().out
    assert "local shape" in wide and "local shape" not in out     # every column only when asked for
    assert max(len(line) for line in wide.splitlines()) > max(len(line) for line in out.splitlines())


def test_explain_and_unknown_target(planned, capsys):
    *_, path = planned
    plan = ShardingPlan.load(path)
    assert main(["explain", str(path), "h.0.attn.c_attn.weight", "lm_head.weight"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == plan.explain("h.0.attn.c_attn.weight") + "\n\n" + plan.explain("lm_head.weight")
    code = main(["explain", str(path), "h.7.nothing"])
    assert_usage_error(code, capsys.readouterr().err, "nothing in this plan is named 'h.7.nothing'")


def test_pin_quiet_and_diff(planned, tmp_path, capsys):
    *_, path_a = planned
    here = ShardingPlan.load(path_a).placement_of("idx")
    pin = "[R, R]" if here == "[S(0), R]" else "[S(0), R]"
    path_b = tmp_path / "b.json"
    code = main(["plan", *GPT_1L, "--pin", f"idx={pin}", "--objective", "memory", "--optimizer", "sgd",
                 "--json", str(path_b), "--quiet"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err == ""  # --quiet: no progress
    assert HEADER in captured.out
    plan_b = ShardingPlan.load(path_b)
    assert plan_b.placement_of("idx") == pin
    assert plan_b.data["pins"] == {"idx": pin} and plan_b.data["objective"] == "memory"

    assert main(["diff", str(path_a), str(path_b)]) == 0
    out = capsys.readouterr().out
    assert "step time" in out and "placements: identical" not in out
    assert any(line.split()[0] == "idx" and line.rstrip().endswith(pin) for line in out.splitlines()[2:]), out
    assert main(["diff", str(path_a), str(path_b), "--exit-code"]) == 1
    assert main(["diff", str(path_a), str(path_a), "--exit-code"]) == 0
    assert "placements: identical" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragments", [
    (["plan", "no_such_module_xyz:build", "--mesh", "2"], ["no module named 'no_such_module_xyz'", "MODULE:FACTORY"]),
    (["plan", "partitioner.models:no_such_factory", "--mesh", "2"],
     ["'partitioner.models' has no factory 'no_such_factory'", "MODULE:FACTORY", "gpt_demo"]),
    (["plan", "partitioner.models", "--mesh", "2"], ["'partitioner.models'", "expected MODULE:FACTORY"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2by2"], ["cannot read mesh '2by2'", "8x8"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2x2", "--axis-names", "dp"], ["--axis-names", "2 axes"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2", "--budget", "lots"], ["--budget", "'lots'", "80GiB"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2", "--budget", "0"], ["--budget must be positive"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2", "--cluster", "tpu9"], ["unknown cluster 'tpu9'"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2x2", "--pin", "idx=R"], ["--pin 'idx=R'", "2 axes"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2", "--pin", "idx"], ["cannot read --pin 'idx'"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2", "--kwargs", "{n_layer: 1}"],
     ["--kwargs is not valid JSON"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2", "--kwargs", "[1]"], ["--kwargs must be a JSON object"]),
    (["plan", "partitioner.models:gpt_demo", "--mesh", "2", "--kwargs", '{"n_wings": 2}'],
     ["factory partitioner.models:gpt_demo raised TypeError", "n_wings"]),
])
def test_bad_plan_arguments(argv, fragments):
    code, out, err = run_main(argv)
    assert_usage_error(code, err, *fragments)
    assert out == ""


def test_bad_plan_files(tmp_path):
    not_a_plan = tmp_path / "config.json"
    not_a_plan.write_text(json.dumps({"lr": 0.1}))
    code, _, err = run_main(["show", str(not_a_plan)])
    assert_usage_error(code, err, str(not_a_plan), "not a Partita sharding plan")

    text = tmp_path / "notes.json"
    text.write_text("these are notes\n")
    code, _, err = run_main(["explain", str(text), "lm_head"])
    assert_usage_error(code, err, str(text), "not valid JSON")

    code, _, err = run_main(["diff", str(tmp_path / "missing.json"), str(not_a_plan)])
    assert_usage_error(code, err, "cannot read plan file", "missing.json")


def test_factory_file_that_is_not_python(tmp_path):
    notes = tmp_path / "models.txt"
    notes.write_text("def build():\n    pass\n")
    code, out, err = run_main(["plan", f"{notes}:build", "--mesh", "2"])
    assert_usage_error(code, err, str(notes), "ending in .py", "MODULE:FACTORY")
    assert out == ""


def test_argparse_errors_return_2(capsys):
    assert main([]) == 2
    assert main(["plan", "partitioner.models:gpt_demo"]) == 2  # --mesh is required
    assert "--mesh" in capsys.readouterr().err
    assert main(["plan", "partitioner.models:gpt_demo", "--mesh", "2", "--objective", "speed"]) == 2


def test_infeasible_budget_is_reported():
    code, out, err = run_main(["plan", *GPT_1L, "--budget", "1MiB", "--quiet"])
    assert_usage_error(code, err, "no plan fits", "Raise the budget")
    assert out == ""


def test_capture_error_and_factory_forms(tmp_path):
    source = tmp_path / "user_models.py"
    source.write_text(textwrap.dedent("""
        from dataclasses import dataclass

        import torch

        @dataclass
        class Config:  # a dataclass needs its module in sys.modules
            width: int = 4

        class Branchy(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(Config.width, Config.width)

            def forward(self, x):
                if x.sum() > 0:  # depends on the data: export cannot capture it
                    return self.lin(x)
                return x

        def branchy():
            return {"model": Branchy(), "example_inputs": (torch.randn(2, 4),)}

        def no_inputs():
            return {"model": Branchy()}

        def just_a_model():
            return Branchy()

        not_callable = 3
    """))
    code, out, err = run_main(["plan", f"{source}:branchy", "--mesh", "2", "--quiet"])
    assert_usage_error(code, err, "could not capture Branchy", "user_models.py")
    assert out == ""
    code, _, err = run_main(["plan", f"{source}:no_inputs", "--mesh", "2"])
    assert_usage_error(code, err, "without ['example_inputs']")
    code, _, err = run_main(["plan", f"{source}:just_a_model", "--mesh", "2"])
    assert_usage_error(code, err, "returned Branchy", "(model, example_inputs)")
    code, _, err = run_main(["plan", f"{source}:not_callable", "--mesh", "2"])
    assert_usage_error(code, err, "not a callable")
    broken = tmp_path / "broken_models.py"
    broken.write_text("import torch\nraise RuntimeError('no GPU here')\n")
    code, _, err = run_main(["plan", f"{broken}:build", "--mesh", "2"])
    assert_usage_error(code, err, "importing", "broken_models.py", "RuntimeError: no GPU here")
    code, _, err = run_main(["plan", f"{source}:missing", "--mesh", "2"])
    assert_usage_error(code, err, "has no factory 'missing'", "branchy, just_a_model, no_inputs")


def test_python_dash_m_end_to_end(tmp_path):
    path = tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "partitioner", "plan", *GPT_1L, "--cluster", "a100",
                           "--budget", "40GiB", "--json", str(path)],
                          capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert HEADER in proc.stdout and "estimate per device per training step:" in proc.stdout
    assert "capture:" in proc.stderr
    plan = ShardingPlan.load(path)
    assert plan.data["cluster"]["name"] == "a100" and plan.data["budget"] == 40 * 2**30
    assert plan.mesh_shape == (2, 2)


def test_demo_shows_what_h100s_would_give_the_gpt_and_why():
    import partitioner
    from partitioner.cluster import PRESETS
    from partitioner.demo_clusters import axis_roles, cluster_numbers, comparison, meta_gpt

    small = partitioner.plan(*meta_gpt(2, 256, 8, 16, 64), mesh_shape=(2, 2), cluster="h100")
    large = partitioner.plan(*meta_gpt(12, 2048, 16, 8, 1024), mesh_shape=(2, 4), cluster="h100")
    assert axis_roles(small) == "a0 data, a1 data"
    assert axis_roles(large) == "a0 tensor, a1 data"      # Megatron on one axis, the batch on the other
    numbers = cluster_numbers(PRESETS["h100"])
    assert numbers["bandwidth"] == 450e9 and numbers["flops"] == pytest.approx(67e12 * 0.7)
    assert numbers["fixed_s"] == pytest.approx(10e-6 + 2e-6)
    text = comparison(small, n_layer=2, n_embd=256, n_head=8, batch=16, seq=64)
    rows = [line.split() for line in text.splitlines()]
    assert ["GPT,", "12", "layers,", "2048", "wide,", "batch", "8x1024", "h100", "(2,", "4)"] == \
        next(r for r in rows if r[:1] == ["GPT,"] and "h100" in r)[:10]
    assert any(line.endswith("a0 tensor, a1 data") and "h100" in line for line in text.splitlines())
    assert "cpu (measured here)" in text and "h100 (NVLink preset)" in text and "\nWhy: " in text
