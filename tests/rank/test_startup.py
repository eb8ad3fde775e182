"""A rank's start-up (hvdkit.rank.startup): the settings exported before hvd.init()."""


from hvdkit.rank.startup import ALLREDUCE_RULES, performance_settings


def test_cpu_jobs_across_hosts_send_large_allreduces_by_the_ring():
    """The settings a Session exports before hvd.init(); the rules file is read by Open MPI in
    every rank (the multi-host benchmark test runs with it)."""
    one_host = performance_settings(on_gpu=False, spans_hosts=False, environ={})
    assert one_host == {"OMPI_MCA_mpi_yield_when_idle": "1", "HOROVOD_CYCLE_TIME": "0.1"}
    hosts = performance_settings(on_gpu=False, spans_hosts=True, environ={})
    assert hosts["OMPI_MCA_coll_tuned_use_dynamic_rules"] == "1" and hosts["OMPI_MCA_btl_tcp_links"] == "2"
    rules = open(hosts["OMPI_MCA_coll_tuned_dynamic_rules_filename"]).read()
    assert rules == ALLREDUCE_RULES
    # allreduce (2), every communicator, below 1 MiB Open MPI's own choice (0), from 1 MiB the ring (4)
    assert rules.split("\n")[:7] == ["1", "2", "1", "1", "2", "0 0 0 0", "1048576 4 0 0"]
    # your own coll_tuned choice wins; GPUs keep Horovod's defaults
    mine = performance_settings(on_gpu=False, spans_hosts=True,
                                environ={"OMPI_MCA_coll_tuned_allreduce_algorithm": "3"})
    assert not any(name.startswith("OMPI_MCA_coll_tuned_") for name in mine) and "OMPI_MCA_btl_tcp_links" in mine
    assert performance_settings(on_gpu=True, spans_hosts=True, environ={}) == {"HOROVOD_ENABLE_ASYNC_COMPLETION": "1"}
