"""hvdkit: a Horovod/MPI training toolkit for PyTorch."""

__version__ = "0.1.0"
