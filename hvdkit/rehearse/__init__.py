"""`hvdkit rehearse` (``cli``): a multi-node job on hosts made of network namespaces
(``namespaces``), with a Slurm cluster on them if asked (``slurm_cluster``, which the tests use too)."""
