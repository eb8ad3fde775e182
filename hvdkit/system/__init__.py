"""The operating system's parts hvdkit uses one way everywhere, on both sides of the job: files
written whole, signal handlers, processes ended by PID, TCP probes. hvdkit.job holds the contract
between a rank and its launcher; these are the helpers both use."""
