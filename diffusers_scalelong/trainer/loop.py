"""The training loop shared by the training scripts: Accelerate set-up, checkpoints, EMA, logging, final save.

A script describes its run as a :class:`TrainingJob` (what to train, how to compute the loss of a batch, how to
build the pipeline) and calls :func:`run_training` with its parsed options (see ``options.add_training_args``).
"""

import argparse
import importlib.util
import logging
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, ProjectConfiguration, TorchDynamoPlugin, broadcast
from tqdm.auto import tqdm

from ..hub.access import HubAccessError, check_hub_access
from ..integrity import check_finite
from .checkpoint import Checkpoint
from .frozen import FrozenModules, weight_dtype
from .output import clean_interrupted_writes, push_run_to_hub, save_pipeline_atomic
from .rng import TrainingRNG
from .run_identity import SNAPSHOT_FOLDER, RunStart
from .sharding import ShardedTraining, clip_grad_norm_
from .training_ema import TrainingEMA, count_parameters


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
            per sampler batch: ``--eval_batch_size``), or None.
        frozen: modules the loss uses but does not train (VAE, text encoder): moved to the device in the
            mixed-precision dtype (``FrozenModules``); the final pipeline gets them back as loaded.
        zero_nonfinite_grads: set NaN/Inf gradient entries to 0 before the optimiser step (EDM2).
        tracker_name: TensorBoard run name.
        description: printed at the start.
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


def make_diagnostics(unet: torch.nn.Module, every_n_steps: int):
    """ScaleLong's stability diagnostics on ``unet`` every ``every_n_steps`` steps, or None (off / not supported)."""
    if not every_n_steps:
        return None
    from ..scalelong.diagnostics import StabilityDiagnostics

    try:
        return StabilityDiagnostics(unet, every_n_steps=every_n_steps)
    except ValueError as error:  # a model family the diagnostics do not know
        print(f"ScaleLong diagnostics are off: {error}")
        return None


def make_accelerator(args: argparse.Namespace, output_dir: Path) -> Accelerator:
    """The run's Accelerator. Without any GPU-like device it is told so (``cpu=True``): only then does Accelerate
    join the processes of ``accelerate launch --multi_gpu --num_processes N`` (or ``torchrun``) over gloo on CPU."""
    return Accelerator(
        cpu=not torch.accelerator.is_available(),
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_config=ProjectConfiguration(
            project_dir=str(output_dir), logging_dir=str(output_dir / args.logging_dir)
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=args.seed),
        step_scheduler_with_optimizer=False,
        dynamo_plugin=(
            TorchDynamoPlugin(backend=args.compile_backend, mode=args.compile_mode)
            if getattr(args, "compile", False)
            else None
        ),
    )


def apply_compute_options(args: argparse.Namespace, unet: torch.nn.Module) -> None:
    """``--allow_tf32`` (torch's CUDA matmul and cuDNN flags), ``--gradient_checkpointing`` (diffusers'
    ``enable_gradient_checkpointing``; a model without it is refused by name) and
    ``--enable_xformers_memory_efficient_attention`` (a message where it cannot apply)."""
    if args.allow_tf32:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if args.gradient_checkpointing:
        if not getattr(unet, "_supports_gradient_checkpointing", False):
            raise ValueError(f"--gradient_checkpointing: {type(unet).__name__} does not support it")
        unet.enable_gradient_checkpointing()
    if args.enable_xformers_memory_efficient_attention:
        if importlib.util.find_spec("xformers") is None:
            print(
                "--enable_xformers_memory_efficient_attention: xformers is not installed; attention keeps torch's "
                "scaled_dot_product_attention"
            )
        elif not hasattr(unet, "set_attn_processor"):
            print(
                f"--enable_xformers_memory_efficient_attention: {type(unet).__name__} has no attention processors; "
                "its attention is unchanged"
            )
        else:
            unet.enable_xformers_memory_efficient_attention()


def grid_due(args: argparse.Namespace, step: int, steps_per_epoch: int, stop: bool) -> bool:
    """A sample grid after this optimiser step: every ``--save_images_steps`` steps, at the end of every
    ``--save_images_epochs``-th epoch, and at the end of the run when either is set."""
    by_steps = args.save_images_steps is not None and step % args.save_images_steps == 0
    epoch_end = step % steps_per_epoch == 0
    by_epochs = (
        args.save_images_epochs is not None and epoch_end and (step // steps_per_epoch) % args.save_images_epochs == 0
    )
    wanted = args.save_images_steps is not None or args.save_images_epochs is not None
    return by_steps or by_epochs or (stop and wanted)


def adamw_class(args: argparse.Namespace) -> type[torch.optim.Optimizer]:
    """``torch.optim.AdamW``, or bitsandbytes' ``AdamW8bit`` with ``--use_8bit_adam``."""
    if not args.use_8bit_adam:
        return torch.optim.AdamW
    try:
        import bitsandbytes
    except ImportError as error:
        raise ValueError("--use_8bit_adam needs the bitsandbytes package: pip install bitsandbytes") from error
    return bitsandbytes.optim.AdamW8bit


def run_training(args: argparse.Namespace, job: TrainingJob, output_dir: Path, run: RunStart) -> Path:
    """Train ``job`` as the options say, starting as ``run`` says (``run_identity.start_run``); returns
    ``output_dir`` holding the pipeline. Raises ``TrainingDiverged``."""
    if args.push_to_hub:  # the Hub answers and the credentials may write: checked before any work
        check_hub_access(args.hub_model_id, private=args.hub_private_repo or None)
    apply_compute_options(args, job.unet)
    accelerator = make_accelerator(args, output_dir)
    if accelerator.is_main_process:
        run.clear_discarded(output_dir)
        clean_interrupted_writes(output_dir)
    accelerator.wait_for_everyone()
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.WARNING)
    step_rng = TrainingRNG(args.seed + accelerator.process_index, accelerator.device)  # noise differs per process
    frozen = FrozenModules(job.frozen, accelerator.device, weight_dtype(args.mixed_precision))

    loader = torch.utils.data.DataLoader(
        job.dataset,
        batch_size=args.train_batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=args.dataloader_num_workers,
    )
    micro_steps_per_epoch = len(loader) // accelerator.num_processes
    if micro_steps_per_epoch < args.gradient_accumulation_steps:
        raise ValueError(
            f"{len(job.dataset)} images give no full optimiser step per epoch at --train_batch_size {args.train_batch_size} "
            f"x {accelerator.num_processes} processes x --gradient_accumulation_steps {args.gradient_accumulation_steps}"
        )
    job.module.train()
    sharding = None
    if args.distributed_type == "fsdp":
        sharding = ShardedTraining(
            job.module, job.unet, accelerator.device, accelerator.is_main_process, bf16=args.mixed_precision == "bf16"
        )
    trainable = [p for p in job.module.parameters() if p.requires_grad]
    optimizer = adamw_class(args)(
        trainable,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        weight_decay=args.adam_weight_decay,
        eps=args.adam_epsilon,
    )
    steps_per_epoch = math.ceil(micro_steps_per_epoch / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or args.num_epochs * steps_per_epoch
    num_epochs = math.ceil(max_steps / steps_per_epoch)
    lr_scheduler = job.make_lr_scheduler(optimizer, max_steps)
    if sharding is None:
        module, optimizer, loader, lr_scheduler = accelerator.prepare(job.module, optimizer, loader, lr_scheduler)
    else:  # FSDP2 handles the module; Accelerate the rest (its data parallel wrapper would replicate the shards)
        optimizer, loader, lr_scheduler = accelerator.prepare(optimizer, loader, lr_scheduler)
        module = job.module
        sharding.save_optimizer_in_full(optimizer)
    unet = job.unet

    ema = TrainingEMA(
        unet,
        sigma_rels=tuple(args.ema_sigma_rels),
        snapshot_dir=output_dir / SNAPSHOT_FOLDER,
        snapshot_every=args.snapshot_every,
        use_classic=args.use_ema,
        classic_kwargs=dict(decay=args.ema_max_decay, inv_gamma=args.ema_inv_gamma, power=args.ema_power),
        is_main_process=accelerator.is_main_process,
        sharded=sharding is not None,
        run_id=run.run_id,
    )

    def save_model_hook(models, weights, folder):
        step_rng.save(folder, accelerator.process_index)
        trained = [accelerator.unwrap_model(model) for model in models]
        if sharding is not None:
            trained = [sharding.gather()]  # every process takes part; the main process gets the whole module
        if accelerator.is_main_process:
            for model in trained:
                Checkpoint.save_models(model, folder)
        ema.save(folder)
        for _ in models:
            weights.pop()

    def load_model_hook(models, folder):
        step_rng.load(folder, accelerator.process_index)
        if sharding is not None:
            if accelerator.is_main_process:
                Checkpoint.load_models(sharding.copy, folder)
            sharding.scatter()
        while models:
            Checkpoint.load_models(accelerator.unwrap_model(models.pop()), folder)

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)

    global_step = 0
    resume_from = run.resume_from
    if resume_from is not None:
        state = resume_from.read_state()
        if state["distributed_type"] != args.distributed_type:
            raise ValueError(
                f"{resume_from} was written with --distributed_type {state['distributed_type']} (its optimiser state "
                f"is kept that way); resume it with --distributed_type {state['distributed_type']}"
            )
        if state["num_processes"] != accelerator.num_processes:
            accelerator.print(
                f"note: {resume_from} was written by {state['num_processes']} processes, this run has "
                f"{accelerator.num_processes}; the data order and random streams will differ from an unbroken run"
            )
        accelerator.print(f"Resuming from {resume_from}")
        try:
            accelerator.load_state(str(resume_from.path))
        except Exception as error:  # accelerate and torch raise many types for unreadable state files
            raise ValueError(f"checkpoint {resume_from} could not be loaded: {error!r}") from error
        ema.load(resume_from.path, unet, run.run_id)
        global_step = resume_from.step
    first_epoch = global_step // steps_per_epoch
    skip_batches = (global_step % steps_per_epoch) * args.gradient_accumulation_steps

    if accelerator.is_main_process and args.report_to != "none":
        accelerator.init_trackers(job.tracker_name, config={k: str(v) for k, v in vars(args).items()})
    global_batch = args.train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    accelerator.print(
        f"{type(unet).__name__}: {count_parameters(unet) / 1e6:.2f}M parameters; {len(job.dataset)} images; "
        f"{job.description}; {max_steps} steps of {global_batch} images"
        + (f"; frozen: {frozen.describe()}" if job.frozen else "")
    )

    diagnostics = None
    if sharding is not None and args.diagnostics_every:
        accelerator.print("ScaleLong diagnostics are off with sharded parameters (--distributed_type fsdp)")
    elif accelerator.is_main_process:
        diagnostics = make_diagnostics(unet, args.diagnostics_every)

    def whole_unet() -> torch.nn.Module | None:
        """The UNet with its current weights on the main process (None elsewhere); a collective when sharded."""
        if sharding is not None:
            sharding.gather()
            return sharding.unet_copy
        return unet if accelerator.is_main_process else None

    def sample_grid(step: int) -> None:
        source = whole_unet()
        if source is None:
            return
        export = ema.export_unet(source).eval()
        grid = job.sample(export, args.num_grid_images, args.seed, args.num_inference_steps)
        source.train()
        grid.save(output_dir / "samples" / f"step-{step:07d}.png")
        grid.log(accelerator.trackers, step)

    time_limit_s = None if args.max_train_time_minutes is None else 60 * args.max_train_time_minutes
    progress = tqdm(
        total=max_steps,
        initial=global_step,
        disable=not accelerator.is_local_main_process,
        desc="steps",
        # A run that stops on time would show a step count and ETA it never reaches: show the time left instead.
        bar_format=None if time_limit_s is None else "{desc}: {n_fmt} [{elapsed}, {rate_fmt}{postfix}]",
    )
    start = time.monotonic()
    step_times = [start]
    initial_step = global_step
    stop = global_step >= max_steps
    micro_losses = []
    for epoch in range(first_epoch, num_epochs):
        if stop:
            break
        loader.set_epoch(epoch)
        batches = loader
        if epoch == first_epoch and skip_batches:
            batches = accelerator.skip_first_batches(loader, skip_batches)
            batches.set_epoch(epoch)  # the new loader would otherwise replay epoch 0's order
        for batch in batches:
            if diagnostics is not None:
                diagnostics.begin_step(global_step + 1)
            with accelerator.accumulate(module), step_rng.active():
                loss = job.loss(module, batch)
                mean_loss = accelerator.gather(loss.detach()[None]).mean()
                if not torch.isfinite(mean_loss):
                    raise TrainingDiverged(f"the loss is {mean_loss.item()} at step {global_step + 1}")
                micro_losses.append(mean_loss.item())
                accelerator.backward(loss)
                grad_norm = None
                if accelerator.sync_gradients:
                    if job.zero_nonfinite_grads:
                        for parameter in trainable:
                            if parameter.grad is not None:
                                torch.nan_to_num_(parameter.grad, nan=0.0, posinf=0.0, neginf=0.0)
                    if diagnostics is not None:
                        diagnostics.record_gradients()
                    clip = accelerator.clip_grad_norm_ if sharding is None else clip_grad_norm_
                    grad_norm = clip(trainable, args.max_grad_norm or float("inf"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:
                continue

            lr = lr_scheduler.get_last_lr()[0]
            lr_scheduler.step()
            global_step += 1
            progress.update(1)
            ema.update(unet, global_step)
            logs = {"loss": sum(micro_losses) / len(micro_losses), "lr": lr, "grad_norm": float(grad_norm)}
            micro_losses.clear()
            if diagnostics is not None:
                logs.update(diagnostics.end_step())
            postfix = {"loss": f"{logs['loss']:.4f}"}
            if time_limit_s is not None:
                postfix["left"] = _time_left(
                    time.monotonic() - start, time_limit_s, global_step - initial_step, max_steps - global_step
                )
            progress.set_postfix(postfix)
            accelerator.log(logs, step=global_step)

            step_times.append(time.monotonic())
            stop = global_step >= max_steps
            if time_limit_s is not None:
                out_of_time = torch.tensor(float(time.monotonic() - start > time_limit_s))
                if accelerator.num_processes > 1:
                    out_of_time = broadcast(out_of_time.to(accelerator.device))
                if out_of_time.item():
                    accelerator.print(f"--max_train_time_minutes reached after {global_step} steps")
                    stop = True
            ema.maybe_snapshot(global_step, final=stop)
            if job.sample and grid_due(args, global_step, steps_per_epoch, stop):
                sample_grid(global_step)
            if global_step % args.checkpointing_steps == 0:
                saved = Checkpoint.save(
                    accelerator,
                    output_dir,
                    global_step,
                    args.checkpoints_total_limit,
                    run_id=run.run_id,
                    distributed_type=args.distributed_type,
                )
                accelerator.print(f"saved {saved}")
            if stop:
                break
    progress.close()
    if getattr(args, "compile", False) and len(step_times) > 1:
        steady = (step_times[-1] - step_times[1]) / max(1, len(step_times) - 2)
        accelerator.print(
            f"torch.compile: first step {step_times[1] - step_times[0]:.1f} s (includes the compilation), "
            + (f"then {steady:.3f} s/step" if len(step_times) > 2 else "no further step")
        )

    accelerator.wait_for_everyone()
    if diagnostics is not None and diagnostics.history:
        diagnostics.plot(output_dir / "stability.png")
    frozen.restore()  # the final pipeline holds the frozen modules as loaded, not their mixed-precision copies
    final_unet = whole_unet()
    if accelerator.is_main_process:
        export = ema.export_unet(final_unet)
        check_finite(export.state_dict(), f"the final model for {output_dir}")
        pipeline = job.make_pipeline(export)
        save_pipeline_atomic(pipeline, output_dir)
        accelerator.print(f"pipeline saved to {output_dir}")
        if args.push_to_hub:
            url = push_run_to_hub(pipeline, output_dir, args.hub_model_id, private=args.hub_private_repo)
            accelerator.print(f"pushed to {url}")
    accelerator.end_training()
    return output_dir


def _time_left(elapsed_s: float, limit_s: float, steps_done: int, steps_left: int) -> str:
    """Time until training stops: the time limit, or the last step at the rate so far if that comes first."""
    left = limit_s - elapsed_s
    if steps_done:
        left = min(left, steps_left * elapsed_s / steps_done)
    minutes, seconds = divmod(max(0, round(left)), 60)
    return f"{minutes}:{seconds:02d}"


def run_script_main(parser: argparse.ArgumentParser, train: Callable, argv: list[str] | None = None) -> int:
    """Parse options and call ``train(args)``: a ``ValueError`` (bad input) or ``HubAccessError`` (the Hub cannot be
    reached or refuses the credentials) exits with status 2 and its message; a diverged loss exits with status 1
    naming the last good checkpoint."""
    args = parser.parse_args(argv)
    try:
        train(args)
    except (ValueError, HubAccessError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except TrainingDiverged as error:
        found = Checkpoint.find_all(args.output_dir)
        where = f"The last good checkpoint is {found[-1]}; " if found else "No checkpoint was written yet; "
        print(
            f"error: {error}; training stopped. {where}lower --learning_rate and resume with "
            "--resume_from_checkpoint latest.",
            file=sys.stderr,
        )
        return 1
    return 0
