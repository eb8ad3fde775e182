"""Real 2-process Horovod runs under each launcher on this machine: no mocks of Horovod or MPI.

The worker (hvdkit.checks.selftest) prints each rank's raw results; these tests check the values
themselves, then that `selftest.check` (what `hvdkit doctor --selftest` relies on) agrees.
"""

import pytest

from conftest import run
from hvdkit.checks import selftest
from hvdkit.launch import planner

pytestmark = pytest.mark.slow

LAUNCHES = {
    "horovodrun --gloo": ("gloo", "horovodrun"),
    "horovodrun --mpi": ("mpi", "mpirun (Open MPI)"),
    "mpirun": ("mpi", "mpirun (Open MPI)"),
}


@pytest.mark.fast  # make test-fast's horovodrun (Gloo and MPI) and mpirun runs
@pytest.mark.parametrize("name", list(LAUNCHES))
def test_two_ranks_agree(name, hvd_built):
    controller, launcher = LAUNCHES[name]
    assert hvd_built[controller], f"Horovod was built without {controller}"
    proc = run(planner.local_command(name, 2, selftest.worker_command()), timeout=240)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    results = selftest.parse_results(proc.stdout)
    assert [r["rank"] for r in results] == [0, 1], proc.stdout[-2000:]
    for r in results:
        assert r["size"] == 2 and r["controller"] == controller
        assert r["launcher"] == launcher and r["launcher_rank"] == r["rank"] and r["launcher_size"] == 2
        # sum over ranks of arange(4) + rank = 2 * arange(4) + 1
        assert r["allreduce_sum"] == [1.0, 3.0, 5.0, 7.0]
        assert r["broadcast"] == [1.0, 1.0, 1.0]  # from root rank 1
        assert r["allgather"] == [0, 1]
        assert r["weights_sha256"] != r["initial_weights_sha256"], "training did not move the weights"
    assert results[0]["initial_weights_sha256"] == results[1]["initial_weights_sha256"]
    assert results[0]["weights_sha256"] == results[1]["weights_sha256"], "weights differ bitwise after 5 steps"
    assert selftest.check(results) == []


def test_check_catches_disagreeing_ranks():
    good = {"rank": 0, "size": 2, "launcher": "horovodrun", "launcher_rank": 0, "launcher_size": 2,
            "allreduce_sum": [1.0, 3.0, 5.0, 7.0], "broadcast": [1.0] * 3, "allgather": [0, 1],
            "initial_weights_sha256": "a", "weights_sha256": "b"}
    other = dict(good, rank=1, launcher_rank=1, weights_sha256="c", broadcast=[0.0] * 3)
    problems = selftest.check([good, other])
    assert any("broadcast gave" in p for p in problems)
    assert any("weights differ" in p for p in problems)
    assert selftest.check([good]) == ["expected results from ranks 0..1, got ranks [0]"]


def test_parse_results_survives_launcher_prefixes_and_glued_lines():
    rank0 = '{"event": "selftest", "rank": 0}'
    rank1 = '{"event": "selftest", "rank": 1}'
    output = f"noise\n[1,1]<stdout>:{rank1}[1,0]<stdout>:{rank0}\n[0]<stdout>:{{\"event\": \"other\"}}\n"
    assert selftest.parse_results(output) == [{"event": "selftest", "rank": 0}, {"event": "selftest", "rank": 1}]
