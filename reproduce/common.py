"""Shared pieces of the reproduction study: results store, data, probes, training loops, samplers and the metric.

Every run appends one JSON line ``{"table": ..., "key": ..., ...metrics}`` to ``<out>/<table>.jsonl``; a run whose
key is already there is skipped, so an interrupted study resumes where it stopped. Only the public API of
``diffusers_scalelong`` is used, so the study keeps working when internal modules move.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable

import torch
from diffusers import DDIMScheduler, DDPMScheduler

from diffusers_scalelong import EDMHeunScheduler
from diffusers_scalelong.metrics import compute_fd_kid, load_reference_images

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(os.path.dirname(HERE), "benchmarks", "results", "reproduction")


# ---------------------------------------------------------------------------------------------------- results store
class ResultStore:
    """JSON-lines results, one file per table; ``done(table, key)`` tells whether a run already finished."""

    def __init__(self, folder: str):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)

    def path(self, table: str) -> str:
        return os.path.join(self.folder, f"{table}.jsonl")

    def rows(self, table: str) -> list[dict]:
        if not os.path.exists(self.path(table)):
            return []
        with open(self.path(table)) as handle:
            return [json.loads(line) for line in handle if line.strip()]

    def done(self, table: str, key: str) -> bool:
        return any(row["key"] == key for row in self.rows(table))

    def append(self, table: str, key: str, record: dict) -> None:
        """Append one finished run; a single ``write`` of one line, flushed and synced, so a crash loses no row."""
        line = json.dumps({"table": table, "key": key, **record}, allow_nan=True) + "\n"
        with open(self.path(table), "a") as handle:
            handle.write(line)
            handle.flush()
            os.fsync(handle.fileno())


def run_key(config: dict) -> str:
    """Stable key of a run: its configuration, sorted."""
    return json.dumps(config, sort_keys=True)


def run_once(store: ResultStore, table: str, config: dict, train: Callable[[], dict]) -> None:
    """Run ``train()`` unless ``config`` is already in ``table``; append its metrics with the run's CPU seconds
    (training, sampling and metric together) and its finishing time (UTC)."""
    key = run_key(config)
    if store.done(table, key):
        return
    print(f"[{table}] {key}", flush=True)
    start = time.process_time()
    record = train()
    record["run_cpu_s"] = time.process_time() - start
    record["finished_utc"] = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    store.append(table, key, {"config": config, **record})


# ---------------------------------------------------------------------------------------------------- data
_IMAGES: dict[tuple[int, int | None], torch.Tensor] = {}


def training_images(scale: dict) -> torch.Tensor:
    """The embedded Fashion-MNIST test split (``scale["num_images"]`` of it; None: all 10,000) at
    ``scale["resolution"]`` as ``[N, 1, r, r]`` in ``[-1, 1]``, prepared exactly as the metric prepares its
    reference images, so a model that reproduces the data scores ~0."""
    resolution, count = scale["resolution"], scale["num_images"]
    if (resolution, count) not in _IMAGES:
        _IMAGES[resolution, count] = load_reference_images("fashion-mnist-test", count, resolution=resolution)
    return _IMAGES[resolution, count]


# ---------------------------------------------------------------------------------------------------- probes
class ActivationProbe:
    """Forward hooks recording, per named module, the mean per-sample L2 norm and the RMS of its output.

    ``inputs=True`` records the module's tensor inputs instead (e.g. a U-ViT out block's hidden state and long
    skip, ``name/in0`` and ``name/in1``). Records only while ``active`` is set, so most steps pay nothing.
    """

    def __init__(self, model: torch.nn.Module, names: Iterable[str], inputs: Iterable[str] = ()):
        modules = dict(model.named_modules())
        self.active = False
        self.current: dict[str, float] = {}
        self.handles = [modules[n].register_forward_hook(self._output_hook(n)) for n in names]
        self.handles += [modules[n].register_forward_pre_hook(self._input_hook(n)) for n in inputs]

    def _store(self, name: str, tensor: torch.Tensor) -> None:
        flat = tensor.detach().float().flatten(1)
        self.current[f"{name}/norm"] = flat.norm(dim=1).mean().item()
        self.current[f"{name}/rms"] = flat.pow(2).mean().sqrt().item()

    def _output_hook(self, name: str) -> Callable:
        def hook(module, args, output):
            if self.active:
                tensor = output[0] if isinstance(output, tuple) else getattr(output, "sample", output)
                self._store(name, tensor)

        return hook

    def _input_hook(self, name: str) -> Callable:
        def hook(module, args):
            if self.active:
                for index, tensor in enumerate(a for a in args if isinstance(a, torch.Tensor)):
                    self._store(f"{name}/in{index}", tensor)

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def weight_growth(model: torch.nn.Module, initial: dict[str, torch.Tensor], prefixes: Iterable[str]) -> dict:
    """Per prefix: mean over its conv/linear weights of (mean per-output-channel norm / the same at init)."""
    result = {}
    for prefix in prefixes:
        ratios = []
        for name, weight in model.named_parameters():
            if name.startswith(prefix) and name.endswith("weight") and weight.ndim >= 2:
                now = weight.detach().flatten(1).norm(dim=1).mean()
                ratios.append((now / initial[name].flatten(1).norm(dim=1).mean()).item())
        if ratios:
            result[prefix] = statistics.mean(ratios)
    return result


# ---------------------------------------------------------------------------------------------------- training
def global_grad_norm(model: torch.nn.Module) -> float:
    norms = [p.grad.detach().norm() for p in model.parameters() if p.grad is not None]
    return torch.stack(norms).norm().item() if norms else 0.0


def ddpm_loss(model, batch: torch.Tensor, scheduler: DDPMScheduler, generator: torch.Generator) -> torch.Tensor:
    """Epsilon-prediction loss ``||eps - eps_theta(sqrt(a_t) x + sqrt(1 - a_t) eps, t)||^2``, t uniform."""
    noise = torch.randn(batch.shape, generator=generator)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (len(batch),), generator=generator)
    noisy = scheduler.add_noise(batch, noise, timesteps)
    return (model(noisy, timesteps.float()).sample - noise).pow(2).mean()


def spike_statistics(values: list[float], window: int = 50, factor: float = 3.0) -> dict:
    """Spikes (value > ``factor`` x the median of the previous ``window`` values) and divergence.

    Diverged: a non-finite value, or the mean of the last 10% above twice the best 10%-window mean.
    """
    finite = [v for v in values if math.isfinite(v)]
    spikes = sum(
        1
        for i in range(window, len(values))
        if math.isfinite(values[i]) and values[i] > factor * statistics.median(values[i - window : i])
    )
    span = max(1, len(values) // 10)
    means = [statistics.mean(values[i : i + span]) for i in range(0, len(values) - span + 1, span)]
    diverged = len(finite) < len(values) or (bool(means) and means[-1] > 2 * min(means))
    return {"spikes": spikes, "diverged": bool(diverged)}


def stalled(row: dict) -> bool:
    """Training failed without diverging: the last quarter's loss is no better than 0.9, while predicting zero noise
    already scores 1 (the variance of the epsilon target)."""
    return row["loss_tail"] > 0.9


def oscillation(series: list[float], window: int = 10) -> float:
    """Mean over non-overlapping windows of std / mean: the relative oscillation of a recorded series."""
    chunks = [series[i : i + window] for i in range(0, len(series) - window + 1, window)]
    values = [statistics.pstdev(c) / abs(statistics.mean(c)) for c in chunks if statistics.mean(c)]
    return statistics.mean(values) if values else float("nan")


def smoothed(values: list[float], span: int) -> list[float]:
    """Trailing moving average over ``span`` values."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= span:
            total -= values[i - span]
        out.append(total / min(i + 1, span))
    return out


def cpu_seconds() -> float:
    return time.process_time()


# ---------------------------------------------------------------------------------------------------- sampling
@torch.no_grad()
def sample_ddim(model, num: int, resolution: int, steps: int, seed: int, batch: int = 250) -> torch.Tensor:
    """Deterministic DDIM (eta 0) samples of an epsilon-prediction model trained on 1000 DDPM steps."""
    model.eval()
    out = []
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, num, batch):
        scheduler = DDIMScheduler(num_train_timesteps=1000)
        scheduler.set_timesteps(steps)
        x = torch.randn(min(batch, num - start), 1, resolution, resolution, generator=generator)
        for t in scheduler.timesteps:
            x = scheduler.step(model(x, t.float().expand(len(x))).sample, t, x).prev_sample
        out.append(x.clamp(-1, 1))
    model.train()
    return torch.cat(out)


@torch.no_grad()
def sample_edm(unet, num: int, resolution: int, steps: int, seed: int, batch: int = 250) -> torch.Tensor:
    """Deterministic EDM Heun samples (``2 steps - 1`` evaluations) of a raw network F under EDM preconditioning."""
    unet.eval()
    out = []
    generator = torch.Generator().manual_seed(seed)
    for start in range(0, num, batch):
        scheduler = EDMHeunScheduler()
        scheduler.set_timesteps(steps)
        x = torch.randn(min(batch, num - start), 1, resolution, resolution, generator=generator)
        x = x * scheduler.init_noise_sigma
        for t in scheduler.timesteps:
            output = unet(scheduler.scale_model_input(x, t), t.expand(len(x))).sample
            x = scheduler.step(output, t, x).prev_sample
        out.append(x.clamp(-1, 1))
    unet.train()
    return torch.cat(out)


def fd(images: torch.Tensor, scale: dict) -> float:
    """FD-FMNISTNet of ``images`` against the embedded test images at the same resolution (all 10,000, or
    ``scale["num_images"]`` of them: the same images the model trained on)."""
    count = scale["num_images"]
    result = compute_fd_kid(images, num_reference=count, kid_subsets=10, kid_subset_size=min(100, len(images)))
    return float(next(v for k, v in result.items() if k.startswith("FD-")))


def fd_two_sets(sampler: Callable[[int], torch.Tensor], seed: int, scale: dict) -> dict:
    """FD of two independent sample sets from one model: their mean and the half-difference (the noise of the mean
    is about |A - B| / 2; of a single set, |A - B| / sqrt(2))."""
    first, second = fd(sampler(seed), scale), fd(sampler(seed + 7919), scale)
    return {"fd": (first + second) / 2, "fd_a": first, "fd_b": second, "fd_halfdiff": abs(first - second) / 2}
