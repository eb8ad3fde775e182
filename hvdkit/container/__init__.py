"""hvdkit in containers: the container engine's argument lists (engine), the image and its local
base (image), the `hvdkit image` command (cli), the multi-container job shaped as a Kubeflow
MPIJob (podjob) and that MPIJob's manifest (mpijob)."""
