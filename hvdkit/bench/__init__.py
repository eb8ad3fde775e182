"""`hvdkit bench`: throughput and bandwidth beside the peers, measured in one run.

Each benchmark is a driver that starts its ranks with `hvdkit launch`, the same launcher
for every implementation it compares, and reads the JSON record rank 0 prints. Run under
a launcher instead (`horovodrun -np 2 hvdkit bench synthetic`), `synthetic` is Horovod's
own synthetic benchmark with the same output.

One module a concern, each benchmark (synthetic, allreduce, scaling, zero) with its part in
each: ``cli`` (the command line), ``drivers`` (launching and alternating the runs),
``workers`` (what each rank runs), ``figures`` (the arithmetic, which the tests check on tiny
inputs; no test times anything), ``environment`` (what is printed beside the figures),
``plots`` (CSV and PNG files), ``estimate`` (the ring-allreduce cost model) and ``profile``
(a step under torch's profiler).
"""
