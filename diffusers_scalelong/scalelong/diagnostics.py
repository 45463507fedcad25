"""Training-stability diagnostics suggested by ScaleLong's analysis (arXiv 2310.13545).

``StabilityDiagnostics`` attaches removable hooks to any model with a long-skip layout
(:mod:`diffusers_scalelong.scalelong.skips`: the package's ScaleLong UNets, ``UViT2DModel`` and ``EDM2UNet2DModel``,
and vanilla diffusers ``UNet2DModel`` / ``UNet2DConditionModel``) and, on every ``every_n_steps``-th step only,
records:

- per long skip ``i`` (1 = outermost): the L2 norm of the (scaled) skip and of the decoder feature it is
  concatenated with, taken at the concatenation itself (``skip/<i>/scaled``, ``skip/<i>/decoder``; for EDM2 these
  are the two weighted parts of ``mp_cat``'s output, as the decoder block receives them);
- the L2 norm of every block's output (``block/<name>``), the global and per-block gradient norms
  (``grad/global``, ``grad/<name>``), the LS gate values (``gate/<g>/mean``, ``gate/<g>/std``);
- the loss per noise-level bin (``loss/bin<b>``) and the robustness ``||f(x + d) - f(x)|| / ||d||`` for small
  Gaussian ``d`` per bin (``robustness/bin<b>``).

Norms are per-sample L2 norms averaged over the batch. Oscillation of each series is summarised over the last
``window`` records as the standard deviation and the range (max - min). Hooks do nothing on other steps, apart
from one flag test. Attach to the model you call (not a ``torch.compile`` wrapper: the hooks add guards).
"""

import math
import os
from collections.abc import Sequence

import torch
from torch import nn

from ..atomic import atomic_path
from .skips import LongSkip, long_skip_layout


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, list | tuple) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return getattr(value, "sample", None)


def _mean_norm(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float().flatten(1).norm(dim=1).mean()


class StabilityDiagnostics:
    """Record feature/gradient norms, LS gates, binned loss and robustness every ``every_n_steps`` steps.

    Typical loop::

        diagnostics = StabilityDiagnostics(unet, every_n_steps=10)
        for step, batch in enumerate(loader):
            diagnostics.begin_step(step)
            pred = unet(noisy, timesteps).sample
            losses = (pred - noise).pow(2).flatten(1).mean(1)
            diagnostics.record_loss(losses, timesteps)
            losses.mean().backward()
            diagnostics.record_gradients()
            if diagnostics.recording:
                diagnostics.probe_robustness(noisy, timesteps)
            optimizer.step(); optimizer.zero_grad()
            accelerator.log(diagnostics.end_step(), step=step)
        diagnostics.plot("stability.png")
    """

    def __init__(
        self,
        model: nn.Module,
        every_n_steps: int = 10,
        window: int = 20,
        noise_level_edges: Sequence[float] | None = None,
        num_train_timesteps: int = 1000,
        num_noise_bins: int = 4,
        probe_scale: float = 1e-3,
        seed: int = 0,
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self.model = model
        self.every_n_steps = every_n_steps
        self.window = window
        if noise_level_edges is None:
            noise_level_edges = [num_train_timesteps * b / num_noise_bins for b in range(1, num_noise_bins)]
        self.noise_level_edges = torch.tensor(sorted(float(e) for e in noise_level_edges))
        self.probe_scale = probe_scale
        self.generator = torch.Generator().manual_seed(seed)
        self.recording = False
        self.step: int | None = None
        self.history: list[tuple[int, dict[str, float]]] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._gate_values: dict[str, list[torch.Tensor]] = {}
        self._handles: list = []
        self.attach()

    # ----------------------------------------------------------------------------------------------- hooks
    def attach(self) -> "StabilityDiagnostics":
        """Register the hooks (done by the constructor); ``detach`` removes them."""
        if self._handles:
            return self
        try:
            layout = long_skip_layout(self.model)
        except ValueError as error:
            raise ValueError(f"StabilityDiagnostics: {error}") from None
        for skip in layout.skips:
            self._handles.append(skip.consumer.register_forward_pre_hook(self._skip_hook(skip), with_kwargs=True))
        for name, module in layout.blocks:
            self._handles.append(module.register_forward_hook(self._block_output_hook(name)))
        lsc = getattr(self.model, "lsc", None)
        for g, gate in enumerate(getattr(lsc, "gates", ())):
            self._handles.append(gate.register_forward_hook(self._gate_hook(f"gate/{g}")))
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _skip_hook(self, skip: LongSkip):
        """Pre-hook of the module where scaled skip ``skip.index + 1`` meets the decoder input."""

        def hook(module, args, kwargs):
            parts = skip.split(args, kwargs) if self.recording else None
            if parts is not None:
                self._pending[f"skip/{skip.index + 1}/decoder"] = _mean_norm(parts[0])
                self._pending[f"skip/{skip.index + 1}/scaled"] = _mean_norm(parts[1])

        return hook

    def _block_output_hook(self, name: str):
        def hook(module, args, output):
            tensor = _first_tensor(output)
            if self.recording and tensor is not None:
                self._pending[f"block/{name}"] = _mean_norm(tensor)

        return hook

    def _gate_hook(self, name: str):
        def hook(module, args, output):
            if self.recording:
                self._gate_values.setdefault(name, []).append(output.detach().float().flatten())

        return hook

    # ----------------------------------------------------------------------------------------------- recording
    def should_record(self, step: int) -> bool:
        return step % self.every_n_steps == 0

    def begin_step(self, step: int) -> bool:
        """Start step ``step``; returns whether it is recorded."""
        self.step = step
        self.recording = self.should_record(step)
        self._pending = {}
        self._gate_values = {}
        return self.recording

    def _bins(self, noise_levels: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(noise_levels.detach().float().cpu().reshape(-1), self.noise_level_edges)

    def _record_binned(self, prefix: str, values: torch.Tensor, noise_levels: torch.Tensor) -> None:
        values = values.detach().float().cpu().reshape(-1)
        bins = self._bins(noise_levels).expand_as(values) if noise_levels.numel() == 1 else self._bins(noise_levels)
        for b in range(len(self.noise_level_edges) + 1):
            selected = values[bins == b]
            if selected.numel():
                self._pending[f"{prefix}/bin{b}"] = selected.mean()

    def record_loss(self, per_sample_loss: torch.Tensor, noise_levels: torch.Tensor) -> None:
        """Loss per noise-level bin (``noise_levels``: timesteps or sigmas, one per sample)."""
        if self.recording:
            self._pending["loss/mean"] = per_sample_loss.detach().float().mean()
            self._record_binned("loss", per_sample_loss, noise_levels)

    def record_gradients(self) -> None:
        """Global and per-block gradient norms; call after ``backward`` and before ``zero_grad``."""
        if not self.recording:
            return
        squares: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            if param.grad is None:
                continue
            parts = name.split(".")
            group = ".".join(parts[:2]) if len(parts) > 2 and parts[1].isdigit() else parts[0]
            square = param.grad.detach().float().pow(2).sum()
            squares[group] = squares.get(group, 0.0) + square
        if squares:
            self._pending["grad/global"] = torch.stack(list(squares.values())).sum().sqrt()
            for group, square in squares.items():
                self._pending[f"grad/{group}"] = square.sqrt()

    @torch.no_grad()
    def probe_robustness(self, sample: torch.Tensor, noise_levels: torch.Tensor, *args, **kwargs) -> None:
        """``||f(x + d, t) - f(x, t)|| / ||d||`` per sample with ``d ~ N(0, probe_scale^2)``, per noise-level bin.

        Runs two forward passes in eval mode (dropout off) without recording their features.
        """
        if not self.recording:
            return
        was_training, self.recording = self.model.training, False
        self.model.eval()
        try:
            delta = torch.randn(sample.shape, generator=self.generator).to(sample) * self.probe_scale
            clean = _first_tensor(self.model(sample, noise_levels, *args, **kwargs))
            moved = _first_tensor(self.model(sample + delta, noise_levels, *args, **kwargs))
        finally:
            self.model.train(was_training)
            self.recording = True
        ratio = (moved - clean).float().flatten(1).norm(dim=1) / delta.float().flatten(1).norm(dim=1)
        self._record_binned("robustness", ratio, noise_levels)

    def end_step(self) -> dict[str, float]:
        """Close the step; returns the flat dict of scalars to log (empty on steps that are not recorded)."""
        if not self.recording:
            return {}
        for name, values in self._gate_values.items():
            joined = torch.cat(values)
            self._pending[f"{name}/mean"] = joined.mean()
            self._pending[f"{name}/std"] = joined.std() if joined.numel() > 1 else joined.new_zeros(())
        row = {key: float(value) for key, value in self._pending.items()}
        self.history.append((self.step, row))
        self.recording = False
        return self.log_dict()

    # ----------------------------------------------------------------------------------------------- summaries
    def series(self, key: str) -> tuple[list[int], list[float]]:
        steps = [step for step, row in self.history if key in row]
        return steps, [row[key] for _, row in self.history if key in row]

    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for _, row in self.history:
            seen.update(dict.fromkeys(row))
        return list(seen)

    @staticmethod
    def oscillation(values: Sequence[float]) -> tuple[float, float]:
        """(standard deviation, range) of ``values``."""
        tensor = torch.tensor(values, dtype=torch.float64)
        if tensor.numel() < 2:
            return 0.0, 0.0
        return float(tensor.std()), float(tensor.max() - tensor.min())

    def log_dict(self) -> dict[str, float]:
        """Latest value of every series plus its windowed oscillation (``osc_std/...``, ``osc_range/...``)."""
        if not self.history:
            return {}
        logs = dict(self.history[-1][1])
        for key in self.keys():
            values = self.series(key)[1][-self.window :]
            if len(values) >= 2:
                logs[f"osc_std/{key}"], logs[f"osc_range/{key}"] = self.oscillation(values)
        return logs

    def summary(self) -> dict[str, dict[str, float]]:
        """Per series over the whole run: mean, last value and the mean windowed std / range (sliding windows)."""
        result = {}
        for key in self.keys():
            values = self.series(key)[1]
            windows = [values[k : k + self.window] for k in range(max(1, len(values) - self.window + 1))]
            stats = [self.oscillation(w) for w in windows]
            result[key] = {
                "mean": sum(values) / len(values),
                "last": values[-1],
                "osc_std": sum(s for s, _ in stats) / len(stats),
                "osc_range": sum(r for _, r in stats) / len(stats),
            }
        return result

    # ----------------------------------------------------------------------------------------------- plots
    def plot(self, path: str | os.PathLike, title: str | None = None) -> str:
        """Draw the recorded curves to a PNG (written atomically); returns the path."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        panels = [
            ("scaled skip norm", lambda k: k.startswith("skip/") and k.endswith("/scaled")),
            ("decoder input norm", lambda k: k.startswith("skip/") and k.endswith("/decoder")),
            ("block output norm", lambda k: k.startswith("block/")),
            ("gradient norm", lambda k: k.startswith("grad/")),
            ("loss per noise bin", lambda k: k.startswith("loss/")),
            ("robustness per noise bin", lambda k: k.startswith("robustness/")),
            ("LS gate mean", lambda k: k.startswith("gate/") and k.endswith("/mean")),
        ]
        keys = self.keys()
        panels = [(name, [k for k in keys if wanted(k)]) for name, wanted in panels]
        panels = [(name, selected) for name, selected in panels if selected]
        columns = 2
        rows = max(1, math.ceil(len(panels) / columns))
        figure = Figure(figsize=(6 * columns, 3.2 * rows))
        FigureCanvasAgg(figure)
        for position, (name, selected) in enumerate(panels, start=1):
            axes = figure.add_subplot(rows, columns, position)
            for key in selected:
                steps, values = self.series(key)
                axes.plot(steps, values, label=key, linewidth=1)
            axes.set_title(name)
            axes.set_xlabel("step")
            if name in ("gradient norm", "loss per noise bin", "robustness per noise bin"):
                axes.set_yscale("log")
            if len(selected) <= 12:
                axes.legend(fontsize=6)
        if title:
            figure.suptitle(title)
        figure.tight_layout()
        return _save_figure_atomically(figure, path)


def _save_figure_atomically(figure, path: str | os.PathLike) -> str:
    with atomic_path(path) as temporary:
        figure.savefig(temporary, format="png", dpi=110)
    return os.fspath(path)
