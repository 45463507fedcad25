"""EMA bookkeeping of a training run: post-hoc (power-function) EMA with snapshots, and diffusers' classic EMA.

Only the main process keeps averages and writes snapshots, and the other processes hold nothing; with sharded
parameters (FSDP2) every process averages its own shards and the main process writes what they gather.
"""

import copy
import os
from pathlib import Path

from diffusers.training_utils import EMAModel
from torch import nn

from ..ema import PowerFunctionEMA

POSTHOC_STATE_FILE = "posthoc_ema.safetensors"
CLASSIC_EMA_FOLDER = "unet_ema"


class TrainingEMA:
    """The EMAs of one UNet during training.

    Args:
        unet: the live (unwrapped) UNet.
        sigma_rels: post-hoc EMA profiles to track (empty: none).
        snapshot_dir / snapshot_every: where and every how many steps to write post-hoc snapshots.
        use_classic: also keep ``diffusers.training_utils.EMAModel`` with ``classic_kwargs``.
        offload_classic: keep the classic EMA on the CPU between updates (as diffusers' ``--offload_ema``).
        is_main_process: the process that writes snapshots and checkpoint state.
        sharded: the UNet's parameters are sharded (FSDP2): every process tracks its shards of the post-hoc EMA,
            and every process must call :meth:`maybe_snapshot` and :meth:`save`.
        run_id: the training run, recorded in every snapshot (see ``run_identity``).
    """

    def __init__(
        self,
        unet: nn.Module,
        sigma_rels: tuple[float, ...] = (),
        snapshot_dir: str | os.PathLike | None = None,
        snapshot_every: int | None = None,
        use_classic: bool = False,
        classic_kwargs: dict | None = None,
        is_main_process: bool = True,
        sharded: bool = False,
        run_id: str | None = None,
        offload_classic: bool = False,
    ):
        self.offload_classic = offload_classic
        self.is_main_process = is_main_process
        self.snapshot_dir = Path(snapshot_dir) if snapshot_dir is not None else None
        self.snapshot_every = snapshot_every
        self.posthoc = None
        if (is_main_process or sharded) and sigma_rels:
            self.posthoc = PowerFunctionEMA(unet, sigma_rels, device="cpu", run_id=run_id)
        self.classic = None
        if is_main_process and use_classic:  # (sharded runs rule it out in their configuration)
            self.classic = EMAModel(
                unet.parameters(),
                use_ema_warmup=True,
                model_cls=type(unet),
                model_config=unet.config,
                **(classic_kwargs or {}),
            )

    def update(self, unet: nn.Module, step: int) -> None:
        """Fold the weights after optimiser step ``step`` into every EMA."""
        if self.posthoc is not None:
            self.posthoc.update(unet, step)
        if self.classic is not None:
            if self.offload_classic:
                self.classic.to(next(unet.parameters()).device)
            self.classic.step(unet.parameters())
            if self.offload_classic:
                self.classic.to("cpu")

    def maybe_snapshot(self, step: int, final: bool = False) -> list[str]:
        """Write post-hoc snapshots at multiples of ``snapshot_every`` (and at the final step)."""
        if self.posthoc is None or self.snapshot_dir is None or self.snapshot_every is None:
            return []
        if step % self.snapshot_every and not final:
            return []
        return self.posthoc.save_snapshots(str(self.snapshot_dir), step, is_main_process=self.is_main_process)

    def save(self, folder: str | os.PathLike) -> None:
        """Write the EMA state into a checkpoint folder (safetensors files only)."""
        if self.posthoc is not None:
            self.posthoc.save_state(os.path.join(folder, POSTHOC_STATE_FILE), is_main_process=self.is_main_process)
        if self.classic is not None:
            self.classic.save_pretrained(os.path.join(folder, CLASSIC_EMA_FOLDER))

    def load(self, folder: str | os.PathLike, unet: nn.Module, run_id: str | None) -> None:
        """Restore the state :meth:`save` wrote; a checkpoint without it, or whose post-hoc EMA state belongs to
        another run than ``run_id`` (the checkpoint's record), raises ``ValueError``."""
        if self.posthoc is not None:
            path = os.path.join(folder, POSTHOC_STATE_FILE)
            self.posthoc.load_state(path)
            if self.posthoc.run_id != run_id:
                raise ValueError(
                    f"{path} belongs to run {self.posthoc.run_id}, but the checkpoint's record names run {run_id}"
                )
        if self.classic is not None:
            path = os.path.join(folder, CLASSIC_EMA_FOLDER)
            if not os.path.isdir(path):
                raise ValueError(
                    f"checkpoint {str(folder)!r} has no classic EMA ({CLASSIC_EMA_FOLDER}/); it was trained without use_ema"
                )
            loaded = EMAModel.from_pretrained(path, model_cls=type(unet))
            loaded.to(next(unet.parameters()).device)
            self.classic = loaded

    def check_resumable(self, folder: str | os.PathLike) -> None:
        """Refuse (``ValueError``) to resume a checkpoint that tracked a post-hoc EMA this run does not track: it would
        be dropped without a word."""
        if self.posthoc is None and os.path.isfile(os.path.join(folder, POSTHOC_STATE_FILE)):
            raise ValueError(
                f"checkpoint {str(folder)!r} tracks a post-hoc EMA ({POSTHOC_STATE_FILE}); resume it with the same "
                "sigma_rels, or that EMA would be lost"
            )

    def export_unet(self, unet: nn.Module) -> nn.Module:
        """The UNet to sample from and to save: a copy holding the classic EMA if kept, else ``unet`` itself."""
        if self.classic is None:
            return unet
        averaged = copy.deepcopy(unet)
        self.classic.copy_to(averaged.parameters())
        return averaged.eval().requires_grad_(False)


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


__all__ = ["TrainingEMA", "count_parameters"]
