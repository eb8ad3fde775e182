"""What starts and watches ranks: `hvdkit launch` (``cli``), each launcher's argument list
(``commands``), hosts (``hostfile``, ``network``), running and signalling the launcher
(``supervise``), the ranks' output as whole lines (``rank_output``) and ``hvdkit.run``
(``spawn``: a function on every rank)."""
