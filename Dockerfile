# hvdkit's image: the pinned torch, Open MPI, an sshd for multi-node jobs, Horovod from hvdkit's
# builder and hvdkit, run as the non-root user `hvdkit`; runs and checkpoints go to /workspace,
# where a volume is mounted. Plain Dockerfile syntax: docker, podman and buildah build it.
#
#   hvdkit image build                  CPU image on debian:bookworm (`--base` for another)
#   hvdkit image build --gpu            GPU image on a CUDA development image, Horovod with NCCL
#   hvdkit image build --target jupyter the same with JupyterLab on port 8888
#
# `hvdkit image build` also hands the build a copy of this machine's Horovod build cache
# (build/hvdkit-cache: the wheels it built before, the sdist) so that a rebuild installs a wheel
# instead of compiling, and the machine's pip settings (docs/containers.md). `docker build .`
# works without either.

ARG BASE=debian:bookworm

FROM ${BASE} AS system
# Python, Open MPI, ssh, and the compilers Horovod's build needs (mpi4py and Horovod compile
# against Open MPI here, as Horovod's own images do).
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev openmpi-bin libopenmpi-dev \
      openssh-server openssh-client g++ make cmake patch ca-certificates procps \
 && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/hvdkit PATH=/opt/hvdkit/bin:$PATH PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# The building machine's pip settings (hvdkit image build passes them; each stage declares them).
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST PIP_DEFAULT_TIMEOUT PIP_CERT
RUN python3 -m venv /opt/hvdkit && pip install --upgrade pip

FROM system AS torch
# Only the pins: this layer, the largest, is rebuilt when constraints.txt changes, not hvdkit.
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST PIP_DEFAULT_TIMEOUT PIP_CERT
COPY constraints.txt /opt/hvdkit/constraints.txt
RUN pip install -c /opt/hvdkit/constraints.txt torch torchvision

FROM torch AS hvdkit
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST PIP_DEFAULT_TIMEOUT PIP_CERT
# HVDKIT_GPU=1 (hvdkit image build --gpu): Horovod with NCCL or no image, the reason in one line.
ARG HVDKIT_GPU=
COPY . /opt/hvdkit/src
# hvdkit, then Horovod: a cached wheel when one has this image's build key, else compiled (about
# 5 min on 2 cores); hvdkit image build takes it back from /opt/hvdkit/cache/wheels. On a GPU
# base, CUDA's stub libcuda stands in for the driver while Horovod links.
RUN pip install /opt/hvdkit/src \
 && mkdir -p /opt/hvdkit/cache && cp -r /opt/hvdkit/src/build/hvdkit-cache/. /opt/hvdkit/cache/ \
 && stubs=$(ls -d /usr/local/cuda/lib64/stubs 2>/dev/null || true) \
 && if [ -n "$stubs" ]; then ln -sf "$stubs/libcuda.so" "$stubs/libcuda.so.1" && export LD_LIBRARY_PATH="$stubs"; fi \
 && python -m hvdkit.build --cache-dir /opt/hvdkit/cache ${HVDKIT_GPU:+--gpu} \
 && rm -rf /opt/hvdkit/cache/logs
# Non-root: the user that runs training, and its own sshd on port 2222 (no privilege separation
# needed) for multi-node jobs, as Kubeflow's MPIJob runs non-root workers; the launcher's keys are
# mounted at /home/hvdkit/.ssh (sshAuthMountPath).
RUN useradd --create-home --uid 1000 --shell /bin/bash hvdkit \
 && mkdir -p /workspace /home/hvdkit/.sshd && chown hvdkit:hvdkit /workspace \
 && ssh-keygen -q -t ed25519 -N '' -f /home/hvdkit/.sshd/host_ed25519_key \
 && printf '%s\n' 'Port 2222' 'HostKey /home/hvdkit/.sshd/host_ed25519_key' \
      'PidFile /home/hvdkit/.sshd/sshd.pid' 'AuthorizedKeysFile /home/hvdkit/.ssh/authorized_keys' \
      'PasswordAuthentication no' 'KbdInteractiveAuthentication no' 'UsePAM no' 'StrictModes no' \
      'AcceptEnv HVDKIT_* HOROVOD_* OMPI_*' > /home/hvdkit/.sshd/sshd_config \
 && chown -R hvdkit:hvdkit /home/hvdkit/.sshd \
 && printf '%s\n' 'Host *' '    Port 2222' '    StrictHostKeyChecking no' '    UserKnownHostsFile /dev/null' \
      '    LogLevel ERROR' >> /etc/ssh/ssh_config
USER hvdkit
WORKDIR /workspace
# The build ends by checking what it built: two real ranks per controller (MPI and Gloo).
RUN hvdkit doctor --selftest
CMD ["bash"]

FROM hvdkit AS jupyter
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_FIND_LINKS PIP_TRUSTED_HOST PIP_DEFAULT_TIMEOUT PIP_CERT
USER root
RUN pip install jupyterlab ipykernel
USER hvdkit
EXPOSE 8888
CMD ["jupyter", "lab", "--ip=0.0.0.0", "--port=8888", "--no-browser", "--notebook-dir=/workspace"]

# The default target is the training image, not JupyterLab.
FROM hvdkit
