"""``cluster="cpu"`` with nothing installed: measured once per rank count, by the job's own ranks
inside a job and by forked ranks outside one, cached, the same spec on every rank.

The measurements run on ``TINY_SIZES`` (milliseconds); what is checked is the mechanism (who
measures, what is cached where, what every rank gets), never a measured figure.
"""

import json
import logging

import pytest

from partitioner import local_cluster
from partitioner.calibration import sizes as calibration_sizes
from partitioner.calibration.measure_compute import host_cores
from partitioner.cluster import ClusterSpec
from runtime.launch import run_on_ranks


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A cache with no installed CPU cluster, and the quick measurement shrunk to TINY_SIZES
    (forked ranks inherit both)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(local_cluster, "QUICK_SIZES", calibration_sizes.TINY_SIZES)
    return tmp_path / "partita"


def _job_rank(rank, world):
    import torch

    torch.manual_seed(5)
    spec = local_cluster.job_cluster("cpu")
    again = local_cluster.job_cluster("cpu")  # cached now: read, not measured
    drawn = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(drawn, torch.rand(3)), "measuring in the job moved its random number generator"
    return spec.to_dict(), again.to_dict()


def test_a_job_measures_cpu_with_its_own_ranks_once_and_every_rank_gets_rank_0s_spec(empty_cache):
    results = run_on_ranks(_job_rank, 2, timeout_s=240)
    (first0, again0), (first1, again1) = results
    assert first0 == first1 == again0 == again1
    cached = empty_cache / "cpu_cluster-2ranks.json"
    assert cached.exists()
    data = json.loads(cached.read_text())
    assert ClusterSpec.from_dict(data["cluster"]).to_dict() == first0
    assert first0["name"] == "cpu" and first0["devices_per_node"] == 2
    kinds = {s["kind"] for s in data["samples"]["collectives"]}
    assert kinds == set(calibration_sizes.COLLECTIVES)  # links measured, not guessed
    assert first0["op_rates"]["float32"], "the ops no roofline reaches are rated"


def test_outside_a_job_cpu_is_measured_on_forked_ranks_of_the_plans_count_and_cached(empty_cache, caplog):
    with caplog.at_level(logging.WARNING, logger="partitioner.local_cluster"):
        spec = local_cluster.get_cluster("cpu", ranks=3)
    assert (empty_cache / "cpu_cluster-3ranks.json").exists()
    assert spec.devices_per_node == 3 and spec.name == "cpu"
    assert spec.cores_per_node == host_cores()  # the cores the ranks share, for the planner to price
    samples = json.loads((empty_cache / "cpu_cluster-3ranks.json").read_text())["samples"]
    assert spec.message_cpu_s > 0  # a pipeline message's CPU at each end, measured
    assert (samples["time_slice"] is not None) == (3 > host_cores()) and spec.time_slice_slowdown >= 1.0
    said = [r.getMessage() for r in caplog.records if "measured this CPU for 3 ranks in" in r.getMessage()]
    assert said and str(empty_cache / "cpu_cluster-3ranks.json") in said[0]  # how long, and where it went
    assert local_cluster.get_cluster("cpu", ranks=3) == spec


def test_an_installed_cpu_cluster_wins_for_every_rank_count(empty_cache):
    empty_cache.mkdir(parents=True)
    installed = local_cluster.get_cluster("a100").to_dict()  # any full description will do
    (empty_cache / "cpu_cluster.json").write_text(json.dumps(installed))
    for ranks in (2, 4, 64):
        assert local_cluster.get_cluster("cpu", ranks=ranks) == ClusterSpec.from_dict(installed)
    assert not list(empty_cache.glob("cpu_cluster-*ranks.json"))


def test_a_broken_cache_file_is_measured_again_with_a_warning(empty_cache, caplog):
    empty_cache.mkdir(parents=True)
    (empty_cache / "cpu_cluster-2ranks.json").write_text("{not json")
    with caplog.at_level("WARNING", logger="partitioner.local_cluster"):
        spec = local_cluster.get_cluster("cpu", ranks=2)
    assert spec.name == "cpu"
    assert any("ignoring the cached CPU cluster" in r.getMessage() for r in caplog.records)
    assert ClusterSpec.from_dict(json.loads((empty_cache / "cpu_cluster-2ranks.json").read_text())["cluster"]) == spec
