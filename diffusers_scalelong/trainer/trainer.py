"""The training loop of the scripts, as a :class:`Trainer` with named phases.

A script describes what it trains as a :class:`TrainingJob` (the module, its data, the loss of a batch, the pipeline
the result is saved in) and how as a :class:`~diffusers_scalelong.trainer.config.TrainingConfig`;
``Trainer(config, job).train()`` then runs the phases in order:

1. :meth:`Trainer.set_up`: everything that can fail, before anything is written: the run's identity (resume or
   fresh), the Accelerator, data loader, optimiser and lr schedule, sharding, the EMAs;
2. :meth:`Trainer.open_output`: the output folder (the earlier run set aside with ``overwrite_output_dir``), logs;
3. :meth:`Trainer.resume`: the checkpoint's state, exactly;
4. per batch, :meth:`Trainer.step` (one micro-step: loss, backward, optimiser) and after each optimiser step
   :meth:`Trainer.after_step` (lr, EMA, logs, then snapshot, sample grid, checkpoint as they fall due);
5. :meth:`Trainer.finish`: the final pipeline (and the push to the Hub).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate.utils import broadcast
from tqdm.auto import tqdm

from ..hub.access import check_hub_access, hub_user_name
from ..integrity import check_finite
from .checkpoint import Checkpoint
from .compute import adamw_class, apply_compute_options, make_accelerator, make_diagnostics
from .config import TrainingConfig
from .frozen import FrozenModules, weight_dtype
from .output import clean_interrupted_writes, ensure_writable_dir, push_run_to_hub, save_pipeline_atomic
from .rng import TrainingRNG
from .run_identity import SNAPSHOT_FOLDER, RunStart, start_run
from .sharding import ShardedTraining, clip_grad_norm_
from .training_ema import TrainingEMA, count_parameters

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite."""


@dataclass
class TrainingJob:
    """What one run trains.

    Attributes:
        module: the trained module (the UNet, or e.g. EDM2's preconditioner around it).
        unet: the diffusers UNet inside ``module``: tracked by the EMAs and saved in the pipeline.
        dataset: a map-style dataset of dict items (optionally with ``set_epoch``).
        loss: ``loss(prepared_module, batch) -> scalar``; runs inside the private training random stream.
        make_lr_scheduler: ``(optimizer, max_steps) -> LRScheduler``.
        make_pipeline: ``unet -> DiffusionPipeline`` saved at the end.
        sample: ``(unet, num_images, seed, num_inference_steps) -> SampleGrid`` for PNG grids (``num_images``
            per sampler batch: ``eval_batch_size``), or None.
        frozen: modules the loss uses but does not train (VAE, text encoder): moved to the device in the
            mixed-precision dtype (``FrozenModules``); the final pipeline gets them back as loaded.
        zero_nonfinite_grads: set NaN/Inf gradient entries to 0 before the optimiser step (EDM2).
        tracker_name: the metrics logger's run name (``tracker_project_name`` overrides it).
        description: logged at the start.
        save_extras: ``(folder, unet, module)`` writes what the saved pipeline folder holds besides the pipeline of
            ``unet`` (e.g. EDM2's preconditioner files), given the whole trained ``module``; or None.
        base_model, dataset_name: where the weights and the data came from (named on a pushed model's card when
            they are Hub repos).
        prepare_data: work on the data that writes files (e.g. a cache of VAE latents), run by every process once
            the main process holds the output folder; or None.
    """

    module: torch.nn.Module
    unet: torch.nn.Module
    dataset: torch.utils.data.Dataset
    loss: Callable
    make_lr_scheduler: Callable
    make_pipeline: Callable
    sample: Callable | None = None
    frozen: list = field(default_factory=list)
    zero_nonfinite_grads: bool = False
    tracker_name: str = "train"
    description: str = ""
    save_extras: Callable | None = None
    base_model: str | None = None
    dataset_name: str | None = None
    prepare_data: Callable[[], object] | None = None


@dataclass(frozen=True)
class StepPlan:
    """How many optimiser steps make an epoch and the run: ``max_train_steps`` or ``num_epochs`` epochs."""

    steps_per_epoch: int
    max_steps: int

    @property
    def num_epochs(self) -> int:
        return math.ceil(self.max_steps / self.steps_per_epoch)


def grid_due(config: TrainingConfig, step: int, steps_per_epoch: int, stop: bool) -> bool:
    """A sample grid after this optimiser step: every ``save_images_steps`` steps, at the end of every
    ``save_images_epochs``-th epoch, and at the end of the run when either is set."""
    return config.wants_grids and (
        stop
        or (config.save_images_steps is not None and step % config.save_images_steps == 0)
        or _epoch_multiple(config.save_images_epochs, step, steps_per_epoch)
    )


def _epoch_multiple(every: int | None, step: int, steps_per_epoch: int) -> bool:
    """Whether ``step`` ends an epoch whose number is a multiple of ``every``."""
    return every is not None and step % steps_per_epoch == 0 and (step // steps_per_epoch) % every == 0


def time_left(elapsed_s: float, limit_s: float, steps_done: int, steps_left: int) -> str:
    """Time until training stops: the time limit, or the last step at the rate so far if that comes first."""
    left = limit_s - elapsed_s
    if steps_done:
        left = min(left, steps_left * elapsed_s / steps_done)
    minutes, seconds = divmod(max(0, round(left)), 60)
    return f"{minutes}:{seconds:02d}"


class Trainer:
    """Trains ``job`` as ``config`` says; :meth:`train` runs the phases and returns the output folder.

    Each phase is a method that can be called on its own in that order (tests do); the state they share lives on
    the instance (``accelerator``, ``module``, ``optimizer``, ``ema``, ``global_step`` ...).
    """

    def __init__(self, config: TrainingConfig, job: TrainingJob):
        self.config = config
        self.job = job
        self.output_dir = Path(config.output_dir)
        self.run: RunStart | None = None
        self.global_step = 0
        self.stop = False

    def _say(self, message: str) -> None:
        """Log ``message`` once, from the main process."""
        if self.accelerator.is_main_process:
            logger.info(message)

    def train(self) -> Path:
        """All phases: set up, open the output folder, resume, the loop, finish. However it ends, the output folder
        is released (and an earlier run set aside by ``overwrite_output_dir`` is put back if this one wrote no
        checkpoint)."""
        try:
            self.set_up()
            self.open_output()
            self.resume()
            self.run_loop()
            return self.finish()
        finally:
            if self.run is not None:
                self.run.close()

    # ============================================================================================ 1. set-up
    def set_up(self) -> None:
        """Build everything the run needs and check every option against it; writes nothing."""
        config, job = self.config, self.job
        if config.hub_token is not None:
            os.environ["HF_TOKEN"] = config.hub_token  # read by every huggingface_hub call of this process
        self.hub_repo_id = None
        if config.push_to_hub:  # the Hub answers and the credentials may write: checked before any work
            self.hub_repo_id = config.hub_model_id or f"{hub_user_name()}/{self.output_dir.resolve().name}"
            check_hub_access(self.hub_repo_id, private=config.hub_private_repo or None)
        self.run = start_run(self.output_dir, config.resume_from_checkpoint, config.overwrite_output_dir)
        if self.run.resume_from is not None:
            self.run.resume_from.check_matches("unet", job.unet)
        apply_compute_options(config, job.unet)
        self.accelerator = make_accelerator(config, self.output_dir)
        self.step_rng = TrainingRNG(config.seed + self.accelerator.process_index, self.accelerator.device)
        self.plan = self._make_loader()
        self._make_optimization()
        self._make_emas()
        self._check_resume_record()

    def _check_resume_record(self) -> None:
        """The checkpoint to resume was written the way this run trains (its record, read once)."""
        if self.run.resume_from is None:
            return
        self.resume_state = state = self.run.resume_from.read_state()
        self.ema.check_resumable(self.run.resume_from.path)
        if state["distributed_type"] != self.config.distributed_type:
            raise ValueError(
                f"{self.run.resume_from} was written with distributed_type {state['distributed_type']} (its "
                f"optimiser state is kept that way); resume it with distributed_type {state['distributed_type']}"
            )
        if state["num_processes"] != self.accelerator.num_processes:
            self._say(
                f"{self.run.resume_from} was written by {state['num_processes']} processes, this run has "
                f"{self.accelerator.num_processes}; the data order and random streams will differ from an unbroken run"
            )

    def _make_loader(self) -> StepPlan:
        """The data loader, and the step plan it gives (refused when the data make no full optimiser step)."""
        config, processes = self.config, self.accelerator.num_processes
        self.loader = torch.utils.data.DataLoader(
            self.job.dataset,
            batch_size=config.train_batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=config.dataloader_num_workers,
        )
        micro_steps_per_epoch = len(self.loader) // processes
        if micro_steps_per_epoch < config.gradient_accumulation_steps:
            raise ValueError(
                f"{len(self.job.dataset)} images give no full optimiser step per epoch at train_batch_size "
                f"{config.train_batch_size} x {processes} processes x gradient_accumulation_steps "
                f"{config.gradient_accumulation_steps}"
            )
        steps_per_epoch = math.ceil(micro_steps_per_epoch / config.gradient_accumulation_steps)
        return StepPlan(steps_per_epoch, config.max_train_steps or config.num_epochs * steps_per_epoch)

    def _make_optimization(self) -> None:
        """Sharding (``distributed_type fsdp``), AdamW, the lr schedule, and Accelerate's preparation of them."""
        config, accelerator, job = self.config, self.accelerator, self.job
        job.module.train()
        self.sharding = None
        if config.distributed_type == "fsdp":
            bf16 = accelerator.mixed_precision == "bf16"
            self.sharding = ShardedTraining(job.module, job.unet, accelerator.device, accelerator.is_main_process, bf16)
        self.trainable = [p for p in job.module.parameters() if p.requires_grad]
        lr = config.learning_rate
        if config.scale_lr:
            lr *= config.gradient_accumulation_steps * config.train_batch_size * accelerator.num_processes
        optimizer = adamw_class(config)(
            self.trainable,
            lr=lr,
            betas=(config.adam_beta1, config.adam_beta2),
            weight_decay=config.adam_weight_decay,
            eps=config.adam_epsilon,
        )
        lr_scheduler = job.make_lr_scheduler(optimizer, self.plan.max_steps)
        if self.sharding is None:
            prepared = accelerator.prepare(job.module, optimizer, self.loader, lr_scheduler)
            self.module, self.optimizer, self.loader, self.lr_scheduler = prepared
        else:  # FSDP2 handles the module; Accelerate the rest (its data parallel wrapper would replicate the shards)
            self.optimizer, self.loader, self.lr_scheduler = accelerator.prepare(optimizer, self.loader, lr_scheduler)
            self.module = job.module
            self.sharding.save_optimizer_in_full(self.optimizer)
        self.frozen = FrozenModules(job.frozen, accelerator.device, weight_dtype(accelerator.mixed_precision))

    def _make_emas(self) -> None:
        """The run's EMAs, and the checkpoint hooks that save and load them with the models."""
        config, accelerator = self.config, self.accelerator
        self.ema = TrainingEMA(
            self.job.unet,
            sigma_rels=config.ema_sigma_rels,
            snapshot_dir=self.output_dir / SNAPSHOT_FOLDER,
            snapshot_every=config.snapshot_every,
            use_classic=config.use_ema,
            classic_kwargs=dict(
                decay=config.ema_max_decay,
                inv_gamma=config.ema_inv_gamma,
                power=config.ema_power,
                foreach=config.foreach_ema,
            ),
            offload_classic=config.offload_ema,
            is_main_process=accelerator.is_main_process,
            sharded=self.sharding is not None,
            run_id=self.run.run_id,
        )
        accelerator.register_save_state_pre_hook(self._save_checkpoint_models)
        accelerator.register_load_state_pre_hook(self._load_checkpoint_models)
        self.diagnostics = None
        if self.sharding is not None and config.diagnostics_every:
            self._say("ScaleLong diagnostics are off with sharded parameters (distributed_type fsdp)")
        elif accelerator.is_main_process:
            self.diagnostics = make_diagnostics(self.job.unet, config.diagnostics_every)

    def _save_checkpoint_models(self, models: list, weights: list, folder: str) -> None:
        """Accelerate's save hook: the models as diffusers folders, the random streams and the EMAs."""
        self.step_rng.save(folder, self.accelerator.process_index)
        trained = [self.accelerator.unwrap_model(model) for model in models]
        if self.sharding is not None:
            trained = [self.sharding.gather()]  # every process takes part; the main process gets the whole module
        if self.accelerator.is_main_process:
            for model in trained:
                Checkpoint.save_models(model, folder)
        self.ema.save(folder)
        weights.clear()  # written above as diffusers folders, not as Accelerate's model files

    def _load_checkpoint_models(self, models: list, folder: str) -> None:
        """Accelerate's load hook: the inverse of :meth:`_save_checkpoint_models` (the EMAs load in :meth:`resume`)."""
        self.step_rng.load(folder, self.accelerator.process_index)
        if self.sharding is not None:
            if self.accelerator.is_main_process:
                Checkpoint.load_models(self.sharding.copy, folder)
            self.sharding.scatter()
        while models:
            Checkpoint.load_models(self.accelerator.unwrap_model(models.pop()), folder)

    # ============================================================================================ 2. output
    def open_output(self) -> None:
        """Create and lock the output folder, set an earlier run aside (``overwrite_output_dir``), start the logs."""
        accelerator, config = self.accelerator, self.config
        if accelerator.is_main_process:
            ensure_writable_dir(self.output_dir)
            self.run.hold_folder(self.output_dir)
            clean_interrupted_writes(self.output_dir)
            self.run.set_aside()
        accelerator.wait_for_everyone()
        if self.job.prepare_data is not None:
            if accelerator.is_main_process:
                self.job.prepare_data()  # the main process writes what is shared (a latent cache) ...
            accelerator.wait_for_everyone()
            if not accelerator.is_main_process:
                self.job.prepare_data()  # ... the others find it
        if accelerator.is_main_process and config.report_to != "none":
            name = config.tracker_project_name or self.job.tracker_name
            accelerator.init_trackers(name, config={k: str(v) for k, v in vars(config).items() if k != "hub_token"})
        job, unet = self.job, self.job.unet
        global_batch = config.train_batch_size * accelerator.num_processes * config.gradient_accumulation_steps
        self._say(
            f"{type(unet).__name__}: {count_parameters(unet) / 1e6:.2f}M parameters; {len(job.dataset)} images; "
            f"{job.description}; {self.plan.max_steps} steps of {global_batch} images"
            + (f"; frozen: {self.frozen.describe()}" if job.frozen else "")
        )

    # ============================================================================================ 3. resume
    def resume(self) -> None:
        """Load the checkpoint the run resumes from (models, optimiser, schedules, data order, random streams, EMAs)."""
        checkpoint = self.run.resume_from
        if checkpoint is None:
            return
        self._say(f"Resuming from {checkpoint}")
        try:
            self.accelerator.load_state(str(checkpoint.path))
        except Exception as error:  # accelerate and torch raise many types for unreadable state files
            raise ValueError(f"checkpoint {checkpoint} could not be loaded: {error!r}") from error
        self.ema.load(checkpoint.path, self.job.unet, self.run.run_id)
        self.global_step = self.resume_state["global_step"]

    # ============================================================================================ 4. the loop
    def run_loop(self) -> None:
        """Epochs of batches until ``max_steps`` optimiser steps, or the time limit, are reached."""
        config, plan = self.config, self.plan
        self.started = time.monotonic()
        self.step_times = [self.started]
        self.initial_step = self.global_step
        self.micro_losses: list[float] = []
        self.stop = self.global_step >= plan.max_steps
        self.progress = tqdm(
            total=plan.max_steps,
            initial=self.global_step,
            disable=not self.accelerator.is_local_main_process,
            desc="steps",
            # A run that stops on time would show a step count and ETA it never reaches: show the time left instead.
            bar_format=None
            if config.max_train_time_minutes is None
            else "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]",
        )
        first_epoch = self.global_step // plan.steps_per_epoch
        with self.progress:  # closed however the loop ends, so that what follows starts a line of its own
            for epoch in range(first_epoch, plan.num_epochs):
                if self.stop:
                    break
                for batch in self._batches(epoch, skip=epoch == first_epoch):
                    self.step(batch)
                    if self.accelerator.sync_gradients:
                        self.after_step()
                    if self.stop:
                        break

    def _batches(self, epoch: int, skip: bool) -> Iterable:
        """The loader's batches of ``epoch``; on resuming, without the ones the checkpoint had already used."""
        self.loader.set_epoch(epoch)
        done = (self.global_step % self.plan.steps_per_epoch) * self.config.gradient_accumulation_steps
        if not (skip and done):
            return self.loader
        batches = self.accelerator.skip_first_batches(self.loader, done)
        batches.set_epoch(epoch)  # the new loader would otherwise replay epoch 0's order
        return batches

    def step(self, batch: dict) -> None:
        """One micro-step: the loss of ``batch``, its gradients and, at the end of an accumulation, the update."""
        accelerator = self.accelerator
        if self.diagnostics is not None:
            self.diagnostics.begin_step(self.global_step + 1)
        with accelerator.accumulate(self.module), self.step_rng.active():
            loss = self.job.loss(self.module, batch)
            mean_loss = accelerator.gather(loss.detach()[None]).mean()
            if not torch.isfinite(mean_loss):
                raise TrainingDiverged(f"the loss is {mean_loss.item()} at step {self.global_step + 1}")
            self.micro_losses.append(mean_loss.item())
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                self.grad_norm = self._finish_gradients()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def _finish_gradients(self) -> torch.Tensor:
        """Before the update: non-finite entries zeroed (EDM2), diagnostics recorded, the norm clipped; the norm."""
        if self.job.zero_nonfinite_grads:
            for parameter in self.trainable:
                if parameter.grad is not None:
                    torch.nan_to_num_(parameter.grad, nan=0.0, posinf=0.0, neginf=0.0)
        if self.diagnostics is not None:
            self.diagnostics.record_gradients()
        clip = self.accelerator.clip_grad_norm_ if self.sharding is None else clip_grad_norm_
        return clip(self.trainable, self.config.max_grad_norm or float("inf"))

    def after_step(self) -> None:
        """After an optimiser step: lr schedule, EMAs, logs and progress, the stop decision; then the snapshot,
        sample grid, pipeline and checkpoint that fall due."""
        config = self.config
        lr = self.lr_scheduler.get_last_lr()[0]
        self.lr_scheduler.step()
        self.global_step += 1
        self.ema.update(self.job.unet, self.global_step)
        self._log_step(lr)
        self.step_times.append(time.monotonic())
        self.stop = self.global_step >= self.plan.max_steps or self._out_of_time()
        step, per_epoch = self.global_step, self.plan.steps_per_epoch
        self.ema.maybe_snapshot(step, final=self.stop)
        if self.job.sample is not None and grid_due(config, step, per_epoch, self.stop):
            self.sample_grid()
        if _epoch_multiple(config.save_model_epochs, step, per_epoch) and not self.stop:
            self.save_pipeline()
        if step % config.checkpointing_steps == 0:
            self.save_checkpoint()

    def _log_step(self, lr: float) -> None:
        logs = {"loss": sum(self.micro_losses) / len(self.micro_losses), "lr": lr, "grad_norm": float(self.grad_norm)}
        self.micro_losses.clear()
        if self.diagnostics is not None:
            logs.update(self.diagnostics.end_step())
        postfix = {"loss": f"{logs['loss']:.4f}"}
        if self.config.max_train_time_minutes is not None:
            postfix["left"] = time_left(
                time.monotonic() - self.started,
                60 * self.config.max_train_time_minutes,
                self.global_step - self.initial_step,
                self.plan.max_steps - self.global_step,
            )
        self.progress.update(1)
        self.progress.set_postfix(postfix)
        self.accelerator.log(logs, step=self.global_step)

    def _out_of_time(self) -> bool:
        """``max_train_time_minutes`` has passed (the main process's clock decides for all processes)."""
        if self.config.max_train_time_minutes is None:
            return False
        late = torch.tensor(float(time.monotonic() - self.started > 60 * self.config.max_train_time_minutes))
        if self.accelerator.num_processes > 1:
            late = broadcast(late.to(self.accelerator.device))
        if late.item():
            self._say(f"max_train_time_minutes reached after {self.global_step} steps")
        return bool(late.item())

    def whole_unet(self) -> torch.nn.Module | None:
        """The UNet with its current weights on the main process (None elsewhere); a collective when sharded."""
        if self.sharding is not None:
            self.sharding.gather()
            return self.sharding.unet_copy
        return self.job.unet if self.accelerator.is_main_process else None

    def _whole_module(self) -> torch.nn.Module:
        """The trained module as a whole on the main process (after :meth:`whole_unet` when sharded)."""
        return self.sharding.copy if self.sharding is not None else self.job.module

    def sample_grid(self) -> None:
        """A PNG grid of the EMA-exported UNet (``samples/step-*.png``), logged to the trackers."""
        source = self.whole_unet()
        if source is None:
            return
        export = self.ema.export_unet(source).eval()
        config = self.config
        grid = self.job.sample(export, config.eval_batch_size, config.seed, config.num_inference_steps)
        source.train()
        grid.save(self.output_dir / "samples" / f"step-{self.global_step:07d}.png")
        grid.log(self.accelerator.trackers, self.global_step)

    def save_pipeline(self) -> torch.nn.Module | None:
        """The pipeline of the EMA-exported UNet, swapped into the output folder; returns it on the main process."""
        source = self.whole_unet()
        if source is None:
            return None
        export = self.ema.export_unet(source)
        check_finite(export.state_dict(), f"the model for {self.output_dir}")
        pipeline = self.job.make_pipeline(export)
        extras = self.job.save_extras
        module = self._whole_module()
        save_pipeline_atomic(pipeline, self.output_dir, extras and (lambda folder: extras(folder, export, module)))
        source.train()
        self._say(f"pipeline saved to {self.output_dir} (step {self.global_step})")
        return pipeline

    def save_checkpoint(self) -> None:
        config = self.config
        saved = Checkpoint.save(
            self.accelerator,
            self.output_dir,
            self.global_step,
            config.checkpoints_total_limit,
            run_id=self.run.run_id,
            distributed_type=config.distributed_type,
        )
        self._say(f"saved {saved}")
        if self.accelerator.is_main_process:
            self.run.drop_set_aside()  # the new run can resume now: the earlier one it replaces goes

    # ============================================================================================ 5. finish
    def finish(self) -> Path:
        """The final pipeline in the output folder (frozen modules as loaded), the optional push; returns the folder."""
        accelerator = self.accelerator
        self._report_compile_time()
        accelerator.wait_for_everyone()
        if self.diagnostics is not None and self.diagnostics.history:
            self.diagnostics.plot(self.output_dir / "stability.png")
        self.frozen.restore()  # the final pipeline holds the frozen modules as loaded, not their mixed-precision copies
        pipeline = self.save_pipeline()
        if pipeline is not None:
            self.run.drop_set_aside()
        if pipeline is not None and self.config.push_to_hub:
            config = self.config
            url = push_run_to_hub(
                pipeline,
                self.output_dir,
                self.hub_repo_id,
                private=config.hub_private_repo,
                ema=config.use_ema,
                base_model=self.job.base_model,
                dataset=self.job.dataset_name,
            )
            self._say(f"pushed to {url}")
        accelerator.end_training()
        return self.output_dir

    def _report_compile_time(self) -> None:
        """With ``compile``: the first step's time (which includes the compilation) apart from the steady rate."""
        times = self.step_times
        if not self.config.compile or len(times) < 2:
            return
        steady = (times[-1] - times[1]) / max(1, len(times) - 2)
        self._say(
            f"torch.compile: first step {times[1] - times[0]:.1f} s (includes the compilation), "
            + (f"then {steady:.3f} s/step" if len(times) > 2 else "no further step")
        )
