#!/bin/sh
# The chaos soak of docs/rehearse.md#the-chaos-soak: eleven `hvdkit rehearse --chaos` runs, 65
# faults over the whole menu, on 2 and 3 hosts, under hvdkit launch (two with in-job restarts and
# snapshots in host memory), plain horovodrun (Gloo and MPI) and mpirun, with `hvdkit train` and a
# Session loop (tests/programs/chaos_loop.py), one an elastic job. Each run's report and attempts' output go to OUT/<run>/; a line per run, the
# total time and the diagnosis of every ending (hvdkit.rehearse.diagnosis) to OUT/soak.txt.
#
#   sh tests/programs/chaos_soak.sh OUT [SEED]     (as root, from the repository, its venv active)
set -u
OUT=$(realpath -m "${1:?give an output folder}")
SEED=${2:-100}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
LOOP="$(command -v python) $(pwd)/tests/programs/chaos_loop.py 300"
TRAIN="hvdkit train --model mlp --image-size 48 --dataset synthetic --max-steps 300 --checkpoint-steps 20 \
--warmup-epochs 0 --lr-schedule none --log-interval 50"
MPIRUN="mpirun --hostfile \$HVDKIT_HOSTFILE --allow-run-as-root -mca btl ^openib -x PATH -x OMP_NUM_THREADS \
-x HVDKIT_CHECKPOINT_DIR -x HVDKIT_CHECKPOINT_STEPS"

soak() {  # NAME HOSTS FAULTS COMMAND
    name=$1 hosts=$2 faults=$3 command=$4
    ckpt="$OUT/$name/ckpt"
    start=$(date +%s)
    HVDKIT_CHECKPOINT_DIR="$ckpt" HVDKIT_CHECKPOINT_STEPS=20 python -m hvdkit rehearse --hosts "$hosts" \
        --chaos "$faults" --chaos-seed "$SEED" --out "$OUT/$name" --checkpoint-dir "$ckpt" -- sh -c "$command" \
        2> "$OUT/$name.log"
    code=$?
    echo "$name: hosts $hosts, $faults faults, seed $SEED, exit $code, $(( $(date +%s) - start )) s" | tee -a "$OUT/soak.txt"
    SEED=$((SEED + 1))
}

began=$(date +%s)
soak launch-train-2 2 9 "hvdkit launch -np 2 -- $TRAIN --checkpoint-dir \$HVDKIT_CHECKPOINT_DIR"
soak launch-train-3 3 6 "hvdkit launch -np 3 -- $TRAIN --checkpoint-dir \$HVDKIT_CHECKPOINT_DIR"
soak gloo-train-2 2 5 "horovodrun --gloo -np 2 -H \$HVDKIT_HOSTS $TRAIN --checkpoint-dir \$HVDKIT_CHECKPOINT_DIR"
soak mpi-loop-3 3 6 "horovodrun --mpi -np 3 -H \$HVDKIT_HOSTS $LOOP"
soak mpirun-loop-2 2 5 "$MPIRUN -np 2 $LOOP"
soak mpirun-train-3 3 5 "$MPIRUN -np 3 $TRAIN --checkpoint-dir \$HVDKIT_CHECKPOINT_DIR"
soak mpi-train-2 2 5 "horovodrun --mpi -np 2 -H \$HVDKIT_HOSTS $TRAIN --checkpoint-dir \$HVDKIT_CHECKPOINT_DIR"
soak gloo-loop-3 3 5 "horovodrun --gloo -np 3 -H \$HVDKIT_HOSTS $LOOP"
soak elastic-train-3 3 5 "hvdkit launch -np 3 --min-np 1 --max-np 3 --blacklist-cooldown-range 3 5 \
--host-discovery-script hvdkit-discover-hosts -- $TRAIN --elastic --lr 0.005 --checkpoint-dir \$HVDKIT_CHECKPOINT_DIR"
soak restarts-train-2 2 7 "hvdkit launch -np 2 --max-restarts 3 -- $TRAIN --snapshot-steps 1 \
--checkpoint-dir \$HVDKIT_CHECKPOINT_DIR"
soak restarts-train-3 3 7 "hvdkit launch -np 3 --max-restarts 3 -- $TRAIN --snapshot-steps 1 \
--checkpoint-dir \$HVDKIT_CHECKPOINT_DIR"
echo "total: $(( $(date +%s) - began )) s" | tee -a "$OUT/soak.txt"
python -c 'import sys; from pathlib import Path; from hvdkit.rehearse import diagnosis
print(*diagnosis.total(sorted(Path(sys.argv[1]).glob("*/report.json"))), sep="\n")' "$OUT" | tee -a "$OUT/soak.txt"
