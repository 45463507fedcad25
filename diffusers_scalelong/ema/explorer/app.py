"""The Gradio page of the post-hoc EMA explorer: choose the EMA length (sigma_rel) and training time by looking.

Releasing a slider reconstructs that target from the snapshots in memory (:class:`.session.Explorer`) and samples
the fixed-seed grid; then the profile plot (the target's weight over training time and its least-squares fit from
the stored profiles, with the fit error) and, when a sweep's ``sweep.jsonl`` is given, the scored curve with the
current choice marked are redrawn. Bad input shows one message in the status line; nothing is written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from ..plot import profile_values
from ..reconstruct import ReconstructionPlan
from ..sweep import read_records, sweep_figure
from .session import Explorer
from .source import SnapshotSource

ALL_CLASSES = "all classes, in turn"
DEFAULT_SAVE_DIR = "phema-explorer"
DISPLAY_WIDTH = 384  # grids narrower than this are enlarged on the page


def profile_figure(plan: ReconstructionPlan):
    """A matplotlib ``Figure``: the target profile ``p_T(tau)`` (dashed) and its fit ``sum_i x_i p_i(tau)``."""
    from matplotlib.figure import Figure

    tau = np.linspace(0.0, plan.target_time, 600)
    fit = sum(
        x * profile_values(tau, info.time, info.gamma)
        for x, info in zip(plan.coefficients[:, 0], plan.snapshots, strict=True)
    )
    figure = Figure(figsize=(6, 3.5))
    ax = figure.subplots()
    ax.plot(tau, fit, label=f"fit from {len(plan.snapshots)} snapshots (error {plan.relative_errors[0]:.1%})")
    ax.plot(tau, profile_values(tau, plan.target_time, plan.target_gammas[0]), "--", label="target profile")
    ax.set_xlabel(f"training time ({plan.snapshots[-1].time_unit})")
    ax.set_ylabel("weight of the parameters at that time")
    ax.set_title(f"sigma_rel = {plan.target_sigma_rels[0]:.3f} at time {plan.target_time}")
    ax.legend(fontsize=8)
    figure.tight_layout()
    return figure


def display_pixels(pixels: np.ndarray, width: int = DISPLAY_WIDTH) -> np.ndarray:
    """The grid enlarged by the integer factor ``max(1, width // grid width)`` (nearest neighbour: each sample pixel
    becomes a square block), so that small images are shown large on any page."""
    scale = max(1, width // pixels.shape[1])
    return np.repeat(np.repeat(pixels, scale, axis=0), scale, axis=1)


class ExplorerPage:
    """What the page does, without Gradio: each handler returns plain values (``None``: leave the output as it is)
    and turns bad input into one message."""

    def __init__(self, explorer: Explorer, sweep: str | os.PathLike | None = None) -> None:
        self.explorer, self.source = explorer, explorer.source
        self.sweep = Path(sweep) if sweep is not None else None
        if self.sweep is not None:
            read_records(self.sweep)  # a damaged file is reported now

    def render(self, sigma: float, time: float, steps: float, label: str) -> tuple[np.ndarray | None, str]:
        """The grid of target ``(round(sigma, 6), time)`` for display and the status line."""
        try:
            grid = self.explorer.sample(
                round(float(sigma), 6), int(time), int(steps), None if label == ALL_CLASSES else int(label)
            )
        except (ValueError, OSError) as error:
            return None, f"**Cannot show this EMA:** {error}"
        seconds = ", ".join(f"{k} {v:.2f} s" for k, v in grid.seconds.items())
        status = (
            f"sigma_rel = **{grid.sigma_rel:.3f}** at time **{grid.time}** {self.source.time_unit}: profile fit "
            f"error {grid.profile_error:.2%}; seed {self.explorer.seed}, {int(steps)} Heun steps ({seconds})"
        )
        return display_pixels(grid.pixels), status

    def plots(self, sigma: float, time: float):
        """``(profile figure, sweep figure or None)``; ``(None, None)`` for a target out of reach."""
        try:
            plan = self.source.plan(round(float(sigma), 6), int(time))
        except ValueError:
            return None, None
        records = [r for r in read_records(self.sweep) if r["time"] == int(time)] if self.sweep else []
        return profile_figure(plan), (sweep_figure(records, mark=float(sigma)) if records else None)

    def reachable(self, time: float) -> tuple[tuple[float, float] | None, str]:
        """The sigma_rel range reachable at ``time``, or ``None`` and the message why not."""
        try:
            span = self.source.reachable_range(int(time))
        except ValueError as error:
            return None, f"**Cannot show this EMA:** {error}"
        return span, "" if span else f"**Cannot show this EMA:** no sigma_rel is reachable at time {int(time)}"

    def save(self, sigma: float, time: float, folder: str, repo: str) -> str:
        """Write the pipeline folder (and push it when ``repo`` is given); the message for the page."""
        try:
            path = self.explorer.save(round(float(sigma), 6), int(time), folder.strip() or DEFAULT_SAVE_DIR)
        except (ValueError, OSError) as error:
            return f"**Not saved:** {error}"
        if not repo.strip():
            return f"wrote `{path}`"
        try:
            self.explorer.push(path, repo.strip())
        except (ValueError, OSError) as error:
            return f"wrote `{path}`; **not pushed:** {error}"
        return f"wrote `{path}` and pushed it to `{repo.strip()}`"


def build_app(
    source: str | os.PathLike | SnapshotSource,
    *,
    sweep: str | os.PathLike | None = None,
    save_dir: str | os.PathLike = DEFAULT_SAVE_DIR,
    num_images: int = 16,
    seed: int = 0,
    num_inference_steps: int = 8,
    sigma_rel: float | None = None,
    time: int | None = None,
    **source_options: Any,
):
    """The explorer as a ``gradio.Blocks`` (not launched). ``source``: a training output folder, a snapshot folder,
    a Hub repo id (``source_options``: ``path_in_repo``, ``revision``, ``endpoint``, ``cache_dir``, ...) or a
    :class:`SnapshotSource`. The initial target (default: the newest time, sigma_rel 0.1 or the nearest reachable)
    is checked here: an unreachable one raises ``ValueError``."""
    import gradio as gr

    source = source if isinstance(source, SnapshotSource) else SnapshotSource(source, **source_options)
    page = ExplorerPage(Explorer(source, num_images=num_images, seed=seed), sweep)
    time = source.times[-1] if time is None else int(time)
    reach = source.reachable_range(time)  # ValueError for a time outside the snapshots' range
    if reach is None:
        raise ValueError(f"no sigma_rel is reachable at time {time}; snapshot times: {source.times}")
    low, high = reach
    sigma_rel = min(max(0.1, low), high) if sigma_rel is None else float(sigma_rel)
    source.plan(sigma_rel, time)  # an unreachable start is an error before the page exists

    def render(sigma, at, steps, label):
        pixels, status = page.render(sigma, at, steps, label)
        return (gr.update() if pixels is None else pixels), status

    def plots(sigma, at):
        profile, curve = page.plots(sigma, at)
        return (gr.update() if profile is None else profile), curve

    def on_time(at, sigma):
        span, message = page.reachable(at)
        if span is None:
            return gr.update(), message
        return gr.update(minimum=span[0], maximum=span[1], value=min(max(float(sigma), span[0]), span[1])), message

    with gr.Blocks(title="post-hoc EMA explorer") as app:
        gr.Markdown(
            f"## Post-hoc EMA explorer\n{source.description}: {len(source.entries)} snapshots "
            f"(sigma_rel {', '.join(f'{s:g}' for s in source.tracked_sigma_rels)}) up to time {source.times[-1]} "
            f"{source.time_unit}. Release a slider to reconstruct that EMA and sample it."
        )
        with gr.Row():
            sigma_slider = gr.Slider(low, high, value=sigma_rel, step=0.001, label="sigma_rel", elem_id="sigma_rel")
            time_slider = gr.Slider(
                source.times[0], source.times[-1], value=time, step=source.time_step,
                label=f"training time ({source.time_unit})", elem_id="time",
            )  # fmt: skip
        with gr.Row():
            steps_slider = gr.Slider(2, 64, value=num_inference_steps, step=1, label="Heun steps", elem_id="steps")
            classes = [ALL_CLASSES, *map(str, range(page.explorer.num_classes or 0))]
            class_box = gr.Dropdown(classes, value=ALL_CLASSES, label="class", visible=bool(page.explorer.num_classes))
        status = gr.Markdown(elem_id="status")
        with gr.Row():
            grid = gr.Image(
                type="numpy", format="png", image_mode=None, label=f"{num_images} samples, seed {seed}",
                elem_id="grid", interactive=False,
            )  # fmt: skip
            profile = gr.Plot(label="EMA profile", elem_id="profile")
        curve = gr.Plot(label="sweep scores", elem_id="sweep", visible=page.sweep is not None)
        with gr.Row():
            folder_box = gr.Textbox(str(save_dir), label="save into folder", elem_id="save_dir")
            repo_box = gr.Textbox("", label="also push to Hub repo (optional)", elem_id="push_repo")
            save_button = gr.Button("save this EMA", elem_id="save")
        save_status = gr.Markdown(elem_id="save_status")

        inputs = [sigma_slider, time_slider, steps_slider, class_box]
        for event in (sigma_slider.release, steps_slider.release, class_box.input, app.load):
            event(render, inputs, [grid, status]).then(plots, [sigma_slider, time_slider], [profile, curve])
        time_slider.release(on_time, [time_slider, sigma_slider], [sigma_slider, status]).then(
            render, inputs, [grid, status]
        ).then(plots, [sigma_slider, time_slider], [profile, curve])
        save_button.click(page.save, [sigma_slider, time_slider, folder_box, repo_box], save_status)
    app.page = page
    return app


def launch(
    source: str | os.PathLike | SnapshotSource,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    block: bool = True,
    **options: Any,
):
    """Build the app and serve it on ``host:port`` (``block=False``: return the running app at once)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    app = build_app(source, **options)
    app.queue(default_concurrency_limit=1)
    app.launch(server_name=host, server_port=port, prevent_thread_lock=not block, quiet=not block)
    return app
