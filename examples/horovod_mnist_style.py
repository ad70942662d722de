"""A Horovod PyTorch training script in the shape of Horovod's examples/pytorch/pytorch_mnist.py.

The only plait-specific line is the import of `plait.horovod.torch as hvd`; with
`import horovod.torch as hvd` instead, this is a Horovod script. The data is MNIST-shaped
(1x28x28 images, 10 classes) but made in memory, so nothing is downloaded: each class has
a fixed random pattern and an image is its class's pattern plus noise, so the loss falls.

    plait run -n 2 examples/horovod_mnist_style.py --epochs 1
    plait run -n 2 examples/horovod_mnist_style.py --epochs 1 --use-adasum
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import plait.horovod.torch as hvd

parser = argparse.ArgumentParser(description="Horovod-style MNIST example (synthetic data)")
parser.add_argument("--batch-size", type=int, default=64, help="input batch size per rank")
parser.add_argument("--test-batch-size", type=int, default=500, help="test batch size per rank")
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate (per rank)")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=5, help="batches between log lines")
parser.add_argument("--fp16-allreduce", action="store_true", help="fp16 gradient compression")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--use-adasum", action="store_true", help="combine updates with hvd.Adasum")
parser.add_argument("--train-size", type=int, default=3072, help="synthetic training images")
parser.add_argument("--test-size", type=int, default=1000, help="synthetic test images")


def synthetic_mnist(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """n MNIST-shaped images: a fixed pattern per class (the same on every rank) plus noise."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = patterns[labels] + 0.8 * torch.randn(n, 1, 28, 28, generator=g)
    return torch.utils.data.TensorDataset(images, labels)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(F.max_pool2d(self.conv1(x), 2))  # (batch, 10, 12, 12)
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # (batch, 20, 4, 4)
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(value: float, name: str) -> float:
    """The average of `value` over all ranks."""
    return hvd.allreduce(torch.tensor(value), name=name).item()


def train(epoch: int) -> None:
    model.train()
    train_sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
    for batch_idx, (data, target) in enumerate(train_loader):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            loss = metric_average(loss.item(), "train_loss")
            if hvd.rank() == 0:
                seen = batch_idx * len(data)
                print(
                    f"Train Epoch: {epoch} [{seen}/{len(train_sampler)} "
                    f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss:.6f}",
                    flush=True,
                )


def test() -> None:
    model.eval()
    test_loss, correct = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            correct += output.argmax(dim=1).eq(target).sum().item()
    # each rank saw its share of the test set: average the per-rank figures
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    accuracy = metric_average(100.0 * correct / len(test_sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {accuracy:.2f}%\n", flush=True)


if __name__ == "__main__":
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per rank

    train_dataset = synthetic_mnist(args.train_size, seed=args.seed)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(
        train_dataset, batch_size=args.batch_size, sampler=train_sampler
    )
    test_dataset = synthetic_mnist(args.test_size, seed=args.seed + 1)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(
        test_dataset, batch_size=args.test_batch_size, sampler=test_sampler
    )

    model = Net()
    # linear learning-rate scaling: the global batch is size() times the per-rank batch;
    # Adasum adapts the combined step itself and needs no scaling (Horovod's advice)
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # start every rank from rank 0's weights and optimizer state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test()
