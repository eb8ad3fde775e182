"""What only a GPU exercises, run by tests/checks/test_gpu.py under a real launcher on a CUDA machine.

    python tests/programs/gpu_worker.py collectives   # NCCL allreduce (fp32, fp16) and broadcast on the GPU
    python tests/programs/gpu_worker.py loop   # Session: pinned batches, fp16 autocast + GradScaler, join(device)

The loop writes its logs where HVDKIT_LOG_DIR says, as every Session does.

Each prints one JSON record per rank ({"event": "gpu.<check>", ...}) for the test to read.
"""
import json
import sys

import torch
from torch.utils.data import TensorDataset


def collectives() -> dict:
    import horovod.torch as hvd

    hvd.init()
    device = torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(device)
    rank, size = hvd.rank(), hvd.size()
    base = torch.arange(4096, dtype=torch.float32, device=device)
    summed = hvd.allreduce(base * (rank + 1), op=hvd.Sum, name="gpu.sum")
    expected = base * (size * (size + 1) / 2)
    half = hvd.allreduce(torch.ones(1024, dtype=torch.float16, device=device), op=hvd.Sum, name="gpu.half")
    shared = torch.full((64,), float(rank), device=device)
    hvd.broadcast_(shared, root_rank=0, name="gpu.broadcast")
    return {"rank": rank, "size": size, "nccl_built": bool(hvd.nccl_built()),
            "result_device": summed.device.type, "half_dtype": str(half.dtype),
            "allreduce_exact": bool(torch.equal(summed, expected)),
            "half_exact": bool(torch.equal(half, torch.full_like(half, size))),
            "broadcast_exact": bool(torch.equal(shared, torch.zeros_like(shared)))}


def loop() -> dict:
    import hvdkit

    session = hvdkit.Session(seed=0, batch_size=32, amp=True, base_lr=0.05)
    inputs = torch.randn(1024, 16, generator=torch.Generator().manual_seed(0))
    loader = session.loader(TensorDataset(inputs, inputs.sum(dim=1, keepdim=True)))
    net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    model, optimizer = session.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
    pinned, autocast_dtypes, losses = [], set(), []
    for _ in session.epochs(2):
        for batch in loader:
            pinned.append(all(t.is_pinned() for t in batch))
            optimizer.zero_grad()
            for x, y in session.micro_batches(batch):
                with session.autocast():
                    out = model(x)
                    autocast_dtypes.add(str(out.dtype))
                    loss = torch.nn.functional.mse_loss(out.float(), y)
                session.backward(loss)
                losses.append(loss.item())
            session.step()
    session.join()  # every rank at the end after the same steps (hvdkit.rank.agree.lockstep), on a GPU too
    record = {"rank": session.rank, "device": str(session.device), "pin_memory": loader.pin_memory,
              "every_batch_pinned": all(pinned), "autocast_dtypes": sorted(autocast_dtypes),
              "scaler": type(session.scaler).__name__, "scale": session.scaler.get_scale() if session.scaler else None,
              "weights_dtype": str(next(model.parameters()).dtype),
              "first_loss": losses[0], "last_loss": losses[-1], "steps": session.global_step}
    session.finish()
    return record


if __name__ == "__main__":
    check = sys.argv[1]
    result = {"collectives": collectives, "loop": loop}[check]()
    print(json.dumps({"event": f"gpu.{check}", **result}), flush=True)
