"""Is this machine ready: `hvdkit doctor` (``doctor``), its two-process self-test
(``selftest``) and `make gpu-check` on a CUDA machine (``gpucheck``)."""
