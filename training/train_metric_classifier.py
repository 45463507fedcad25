"""Train FMNISTNet, the classifier whose features the FD/KID metrics use, on the Fashion-MNIST train split.

Deterministic on CPU (fixed seed, fixed thread count, deterministic algorithms). Writes the weights as
safetensors and a JSON record with the test accuracy, the command and the weights' sha256:

    python training/train_metric_classifier.py --output_dir diffusers_scalelong/assets

The train split is read from the IDX files (``--data_dir``, ``$FASHION_MNIST_DIR`` or the Debian package's folder);
the test accuracy is measured on the test split embedded in the package.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tqdm import tqdm

from diffusers_scalelong.atomic import atomic_path, atomic_write_text
from diffusers_scalelong.data import load_fashion_mnist_arrays
from diffusers_scalelong.metrics.fmnist_net import RECORD_NAME, WEIGHTS_NAME, FMNISTNet, sha256_bytes

HYPERPARAMETERS = ("epochs", "batch_size", "lr", "weight_decay", "seed", "threads")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", type=Path, required=True, help="folder for the weights and the JSON record")
    parser.add_argument("--data_dir", default=None, help="folder with the Fashion-MNIST IDX files (train split)")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the one-cycle schedule")
    parser.add_argument("--weight_decay", type=float, default=5e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (fixed, for reproducible numerics)")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def to_inputs(images) -> torch.Tensor:
    """uint8 ``[N, 28, 28]`` -> float ``[N, 1, 28, 28]`` in ``[-1, 1]``."""
    return torch.from_numpy(images.copy()).float().div(127.5).sub(1).unsqueeze(1)


def augment(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Random left-right flip of half of the images (clothes are nearly mirror-symmetric)."""
    flip = torch.rand(x.shape[0], generator=generator) < 0.5
    return torch.where(flip[:, None, None, None], x.flip(-1), x)


@torch.no_grad()
def accuracy(model: FMNISTNet, x: torch.Tensor, labels: torch.Tensor, batch_size: int = 1000) -> float:
    model.eval()
    correct = sum(
        (model(x[i : i + batch_size]).argmax(1) == labels[i : i + batch_size]).sum().item()
        for i in range(0, len(x), batch_size)
    )
    return correct / len(x)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    generator = torch.Generator().manual_seed(args.seed)

    train_images, train_labels = load_fashion_mnist_arrays(args.data_dir, split="train")
    test_images, test_labels = load_fashion_mnist_arrays(split="test", embedded=True)
    x_train, y_train = to_inputs(train_images), torch.from_numpy(train_labels.astype("int64"))
    x_test, y_test = to_inputs(test_images), torch.from_numpy(test_labels.astype("int64"))

    model = FMNISTNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = len(x_train) // args.batch_size
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch
    )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.randperm(len(x_train), generator=generator)
        progress = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{args.epochs}", file=sys.stdout)
        for step in progress:
            index = order[step * args.batch_size : (step + 1) * args.batch_size]
            loss = F.cross_entropy(model(augment(x_train[index], generator)), y_train[index], label_smoothing=0.05)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            if step % 50 == 0:
                progress.set_postfix(loss=f"{loss.item():.3f}")
        print(f"epoch {epoch + 1}: test accuracy {accuracy(model, x_test, y_test):.4f}")
    train_seconds = time.perf_counter() - start

    test_accuracy = accuracy(model, x_test, y_test)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    with atomic_path(args.output_dir / WEIGHTS_NAME) as temporary:
        save_file(state, str(temporary))
    record = {
        "model": "FMNISTNet",
        "test_accuracy": test_accuracy,
        "test_split": "Fashion-MNIST test (10,000 images)",
        "train_split": "Fashion-MNIST train (60,000 images)",
        "weights_sha256": sha256_bytes((args.output_dir / WEIGHTS_NAME).read_bytes()),
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "command": "python training/train_metric_classifier.py --output_dir diffusers_scalelong/assets "
        + " ".join(f"--{name} {getattr(args, name)}" for name in HYPERPARAMETERS),
        "hyperparameters": {name: getattr(args, name) for name in HYPERPARAMETERS},
        "torch_version": torch.__version__,
        "train_seconds": round(train_seconds, 1),
    }
    atomic_write_text(args.output_dir / RECORD_NAME, json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    main()
