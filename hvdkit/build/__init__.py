"""Horovod built on the installed torch: ``python -m hvdkit.build`` (``builder``: plan, cache,
build), what the machine offers (``toolchain``) and hvdkit's fixes to Horovod (``patches``)."""
