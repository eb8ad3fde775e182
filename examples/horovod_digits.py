"""A typical Horovod script, shaped like Horovod's MNIST example, on the UCI digits that
scikit-learn ships. examples/hvdkit_digits.py is the same script ported to hvdkit.Session.

    horovodrun -np 2 -H localhost:2 python examples/horovod_digits.py
"""
import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

parser = argparse.ArgumentParser(description="UCI digits with Horovod")
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--epochs", type=int, default=5)
parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one rank")
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 compression for the allreduce")


def digits():
    raw = load_digits()
    images = torch.tensor(raw.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(raw.target)
    return TensorDataset(images[:1437], labels[:1437]), TensorDataset(images[1437:], labels[1437:])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(16 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def main():
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    device = torch.device("cuda", hvd.local_rank()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)

    train_set, test_set = digits()
    train_sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = DataLoader(test_set, batch_size=args.batch_size, sampler=test_sampler)

    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)

    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % 10 == 0 and hvd.rank() == 0:
                print(f"epoch {epoch} batch {batch_idx} loss {loss.item():.4f}", flush=True)

        model.eval()
        test_loss, correct = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                correct += (output.argmax(1) == target).sum().item()
        test_loss = hvd.allreduce(torch.tensor(test_loss / len(test_sampler)), name="avg_loss").item()
        accuracy = hvd.allreduce(torch.tensor(correct / len(test_sampler)), name="avg_accuracy").item()
        if hvd.rank() == 0:
            print(f"epoch {epoch} test loss {test_loss:.4f} accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    main()
