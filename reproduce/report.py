"""Regenerate the reproduction report and its figures from the JSON lines alone.

python reproduce/report.py [--out benchmarks/results/reproduction] [--report benchmarks/results/reproduction.md]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import verdicts  # noqa: E402
from common import DEFAULT_OUT, ResultStore, stalled  # noqa: E402

METHOD_LABELS = {"none": "vanilla", "inv_sqrt2": "1/sqrt(2)-CS"}


def label(method: str) -> str:
    if method in METHOD_LABELS:
        return METHOD_LABELS[method]
    name, _, kappa = method.partition(":")
    return f"{name} k={kappa}" if kappa else name


def mean_sd(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def save(figure: Figure, path: str) -> None:
    """Write a PNG through a temporary file and a rename, so a reader never sees half a figure."""
    temporary = path + ".tmp.png"
    figure.savefig(temporary, dpi=90)
    os.replace(temporary, path)


def new_figure(width: float, height: float) -> Figure:
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def mean_of(record: dict, part: str) -> float | None:
    values = [v for k, v in record.items() if part in k]
    return statistics.mean(values) if values else None


# ---------------------------------------------------------------------------------------------------- ScaleLong
def backbone(config: dict) -> str:
    if config["family"] == "conv":
        return f"conv UNet w{config['width']} b{config['batch']}"
    return f"U-ViT d{config['depth']} w{config['width']} b{config['batch']}"


def divergence(row: dict) -> str:
    return "diverged" if row["loss_diverged"] else "stalled" if stalled(row) else "no"


def sweep_section(store: ResultStore, folder: str) -> list[str]:
    rows = store.rows("scalelong_sweep")
    if not rows:
        return ["_No sweep run yet._"]
    lines = [
        "| backbone | lr | warm-up | steps done | loss spikes | grad spikes | failed | loss (last 25%) "
        "| grad norm (last 25%) | mid-norm growth | CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (backbone(r["config"]), r["config"]["warmup"], r["config"]["lr"])):
        c = r["config"]
        growth = r.get("feature_norm_growth", {}).get("mid_block/norm")
        lines.append(
            f"| {backbone(c)} | {c['lr']:g} | {c['warmup']} | {r['steps_done']}/{c['steps']} | {r['loss_spikes']} "
            f"| {r['grad_spikes']} | {divergence(r)} | {r['loss_tail']:.4f} "
            f"| {r['grad_tail']:.3f} | {'-' if growth is None else f'{growth:.2f}'} | {r['train_cpu_s']:.0f} |"
        )
    figure = new_figure(11, 7)
    warmups = sorted({r["config"]["warmup"] for r in rows})[:2]
    for column, warmup in enumerate(warmups):
        for row, (field, xs, title, log) in enumerate(
            [("loss", "step", "smoothed loss", True), ("mid_norm", "record_step", "mid-block output norm", True)]
        ):
            axes = figure.add_subplot(2, 2, 2 * row + column + 1)
            for r in rows:
                if r["config"]["warmup"] == warmup and None not in r["series"][field]:
                    s = r["series"]
                    axes.plot(s[xs], s[field], label=f"{backbone(r['config'])} lr {r['config']['lr']:g}", lw=1)
            axes.set_title(f"vanilla, warm-up {warmup} steps: {title}", fontsize=9)
            if log:
                axes.set_yscale("log")
            axes.set_xlabel("step")
            axes.legend(fontsize=6)
    figure.tight_layout()
    save(figure, os.path.join(folder, "scalelong_sweep.png"))
    return [*lines, "", "![sweep](reproduction/scalelong_sweep.png)"]


def group_by_method(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(r["config"]["method"], []).append(r)
    return groups


def steps_to_reach(series: dict, target: float) -> int | None:
    return next((s for s, v in zip(series["step"], series["loss"], strict=True) if v <= target), None)


def paired_fd_delta(rows: list[dict], baseline: list[dict]) -> list[float]:
    """Per seed: method FD - vanilla FD (same seed, same initial weights and data order)."""
    vanilla = {r["config"]["seed"]: r.get("final_fd") for r in baseline}
    return [
        r["final_fd"] - vanilla[r["config"]["seed"]]
        for r in rows
        if r.get("final_fd") is not None and vanilla.get(r["config"]["seed"]) is not None
    ]


def compare_section(store: ResultStore, folder: str, regime: str) -> tuple[list[str], dict]:
    rows = [r for r in store.rows("scalelong_compare") if r["config"].get("regime") == regime]
    if not rows:
        return [f"_No {regime} runs yet._"], {}
    groups = group_by_method(rows)
    baseline = groups.get("none", [])
    half = str(rows[0]["config"]["steps"] // 2)
    lines = [
        f"Setting: {backbone(rows[0]['config'])}, lr {rows[0]['config']['lr']:g}, warm-up "
        f"{rows[0]['config']['warmup']}, {rows[0]['config']['steps']} steps; mean ± sd over seeds.",
        "",
        "| method | seeds | diverged / stalled | loss spikes | grad spikes | loss (last 25%) | loss osc | grad osc "
        "| mid norm (end) | mid-norm growth | decoder-input norm osc | robustness | FD @ half | FD @ end | ΔFD vs vanilla (paired) "
        "| steps to vanilla's final loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    stats = {}
    for method, group in groups.items():
        vanilla_final = {r["config"]["seed"]: r["series"]["loss"][-1] for r in baseline if r["series"]["loss"]}
        reach = [
            steps_to_reach(r["series"], vanilla_final[r["config"]["seed"]])
            for r in group
            if r["config"]["seed"] in vanilla_final
        ]
        reached = [s for s in reach if s is not None]
        deltas = paired_fd_delta(group, baseline) if method != "none" else []
        stats[method] = {"deltas": deltas, "fd": [r.get("final_fd") for r in group]}
        lines.append(
            f"| {label(method)} | {len(group)} | {sum(r['loss_diverged'] for r in group)} / "
            f"{sum(stalled(r) for r in group)} "
            f"| {sum(r['loss_spikes'] for r in group)} | {sum(r['grad_spikes'] for r in group)} "
            f"| {mean_sd([r['loss_tail'] for r in group], 4)} | {mean_sd([r['loss_osc'] for r in group])} "
            f"| {mean_sd([r['grad_osc'] for r in group])} "
            f"| {mean_sd([r.get('feature_norm_last', {}).get('mid_block/norm') for r in group], 0)} "
            f"| {mean_sd([r.get('feature_norm_growth', {}).get('mid_block/norm') for r in group], 2)} "
            f"| {mean_sd([mean_of(r.get('feature_norm_osc', {}), '/in0/') for r in group])} "
            f"| {mean_sd([r.get('robustness') for r in group])} "
            f"| {mean_sd([r['fd_at'].get(half) for r in group], 1)} | {mean_sd([r.get('final_fd') for r in group], 1)} "
            f"| {mean_sd(deltas, 1) if deltas else '-'} "
            f"| {mean_sd(reached, 0) if reached else '-'} ({len(reached)}/{len(reach)} reach) |"
        )
    plot_compare(groups, os.path.join(folder, f"scalelong_{regime}.png"), f"{regime} regime")
    return [*lines, "", f"![{regime}](reproduction/scalelong_{regime}.png)"], stats


def plot_compare(groups: dict[str, list[dict]], path: str, title: str) -> None:
    figure = new_figure(12, 7)
    panels = [
        ("smoothed training loss", "step", "loss", True),
        ("global gradient norm", "step", "grad", True),
        ("mid-block output norm", "record_step", "mid_norm", True),
        ("mean decoder-input (hidden) norm", "record_step", "decoder_norm", True),
    ]
    for position, (name, xs, ys, log) in enumerate(panels, start=1):
        axes = figure.add_subplot(2, 2, position)
        for method, group in groups.items():
            series = [r["series"] for r in group if r["series"][ys] and None not in r["series"][ys]]
            if not series:
                continue
            length = min(len(s[ys]) for s in series)
            mean = [statistics.mean(s[ys][i] for s in series) for i in range(length)]
            axes.plot(series[0][xs][:length], mean, label=label(method), lw=1)
        axes.set_title(name)
        axes.set_xlabel("step")
        if log:
            axes.set_yscale("log")
        axes.legend(fontsize=7)
    figure.suptitle(f"ScaleLong, {title}: mean over seeds")
    figure.tight_layout()
    save(figure, path)


# ---------------------------------------------------------------------------------------------------- EDM2
def edm2_rows(store: ResultStore, **match) -> list[dict]:
    return [r for r in store.rows("edm2_runs") if all(r["config"].get(k) == v for k, v in match.items())]


def magnitudes_section(store: ResultStore, folder: str) -> list[str]:
    runs = {
        "UNet2DModel (standard layers)": edm2_rows(store, variant="unet2d_edm", seed=0),
        "EDM2UNet2DModel (MP layers)": edm2_rows(store, variant="edm2", seed=0, lsc="none", uncertainty=True),
    }
    runs = {
        k: [r for r in v if r["config"]["steps"] == max(x["config"]["steps"] for x in v)][0]
        for k, v in runs.items()
        if v
    }
    if not runs:
        return ["_No magnitude runs yet._"]
    figure = new_figure(12, 7)
    lines = [
        "| network | params | activation RMS (first record -> last), mean over blocks | max block RMS at end "
        "| weight norm / init at end (mean over blocks) | max |",
        "|---|---|---|---|---|---|",
    ]
    for column, (name, r) in enumerate(runs.items()):
        records = r["series"]["magnitudes"]
        steps = [m["step"] for m in records]
        blocks = list(records[0]["act_rms"])
        for row, (field, title) in enumerate([("act_rms", "activation RMS"), ("weight_growth", "weight norm / init")]):
            axes = figure.add_subplot(2, 2, 2 * row + column + 1)
            for block in blocks:
                axes.plot(steps, [m[field].get(block, math.nan) for m in records], lw=1, label=block)
            axes.set_title(f"{name}: {title}", fontsize=9)
            axes.set_xlabel("step")
            axes.legend(fontsize=5, ncol=2)
        first, last = records[0], records[-1]
        lines.append(
            f"| {name} | {r['params'] / 1e6:.2f} M | {statistics.mean(first['act_rms'].values()):.2f} -> "
            f"{statistics.mean(last['act_rms'].values()):.2f} | {max(last['act_rms'].values()):.2f} "
            f"| {statistics.mean(last['weight_growth'].values()):.2f} | {max(last['weight_growth'].values()):.2f} |"
        )
    figure.tight_layout()
    save(figure, os.path.join(folder, "edm2_magnitudes.png"))
    return [*lines, "", "![magnitudes](reproduction/edm2_magnitudes.png)"]


def posthoc_section(store: ResultStore, folder: str, noise: dict) -> tuple[list[str], dict]:
    runs = [r for r in edm2_rows(store, variant="edm2", lsc="none") if r.get("posthoc")]
    if not runs:
        return ["_No post-hoc EMA run yet._"], {}
    r = runs[0]
    curve = {float(k): v for k, v in r["posthoc"].items()}
    sigmas = sorted(curve)
    error = noise.get("single", 0.0)
    figure = new_figure(7, 4.5)
    axes = figure.add_subplot(1, 1, 1)
    axes.errorbar(sigmas, [curve[s] for s in sigmas], yerr=error, marker="o", ms=3, capsize=2, label="post-hoc")
    tracked = {float(k): v for k, v in r.get("tracked", {}).items()}
    axes.scatter(list(tracked), list(tracked.values()), marker="s", color="C3", zorder=3, label="tracked EMA")
    axes.axhline(r["raw_fd"], color="gray", ls="--", lw=1, label="no EMA (raw weights)")
    axes.set_xscale("log")
    axes.set_xlabel("sigma_rel")
    axes.set_ylabel("FD-FMNISTNet")
    axes.set_title(f"Post-hoc EMA, EDM2 UNet, {r['config']['steps']} steps (bars: sample noise of one set)", fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    save(figure, os.path.join(folder, "posthoc_ema.png"))
    lines = ["| sigma_rel | FD (reconstructed) | FD (tracked during training) |", "|---|---|---|"]
    for s in sigmas:
        lines.append(f"| {s:g} | {curve[s]:.2f} | {f'{tracked[s]:.2f}' if s in tracked else '-'} |")
    lines.append(f"| raw weights (no EMA) | {r['raw_fd']:.2f} | - |")
    return [*lines, "", "![posthoc](reproduction/posthoc_ema.png)"], {"curve": curve, "run": r}


def recipe_section(store: ResultStore, folder: str) -> tuple[list[str], dict]:
    rows = [r for r in store.rows("edm2_runs") if r["config"]["lsc"] == "none"]
    rows = [
        r
        for r in rows
        if r["config"]["variant"] in ("edm2", "ddpm")
        and r["config"]["steps"] == max(x["config"]["steps"] for x in rows)
    ]
    if not rows:
        return ["_No recipe runs yet._"], {}
    names = {
        ("edm2", True): "EDM2 recipe, learned uncertainty",
        ("edm2", False): "EDM2 recipe, plain EDM weighting",
        ("ddpm", False): "DDPM recipe (diffusers)",
    }
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(names[(r["config"]["variant"], r["config"]["uncertainty"])], []).append(r)
    lines = [
        "| recipe | seeds | params | FD @ half (CPU s) | FD @ end (CPU s) | ± (2 sets) |",
        "|---|---|---|---|---|---|",
    ]
    figure = new_figure(7, 4.5)
    axes = figure.add_subplot(1, 1, 1)
    for index, (name, group) in enumerate(groups.items()):
        steps = sorted(group[0]["checkpoints"], key=int)
        cells = []
        for step in steps:
            fds = [g["checkpoints"][step]["fd"] for g in group if step in g["checkpoints"]]
            cpu = [g["checkpoints"][step]["cpu_s"] for g in group if step in g["checkpoints"]]
            cells.append(f"{mean_sd(fds, 1)} ({statistics.mean(cpu):.0f} s)")
            for g in group:
                if step in g["checkpoints"]:
                    c = g["checkpoints"][step]
                    axes.scatter(
                        [c["cpu_s"]],
                        [c["fd"]],
                        color=f"C{index}",
                        s=14,
                        label=name if (g is group[0] and step == steps[0]) else None,
                    )
        lines.append(
            f"| {name} | {len(group)} | {group[0]['params'] / 1e6:.2f} M | {' | '.join(cells)} "
            f"| {mean_sd([g['final_fd_halfdiff'] for g in group], 2)} |"
        )
    axes.set_xlabel("training CPU seconds (1 thread)")
    axes.set_ylabel("FD-FMNISTNet")
    axes.set_title("EDM2 vs DDPM recipe (points: checkpoints of each seed)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    save(figure, os.path.join(folder, "recipe.png"))
    return [*lines, "", "![recipe](reproduction/recipe.png)"], groups


def lsc_section(store: ResultStore) -> list[str]:
    rows = [
        r
        for r in edm2_rows(store, variant="edm2", uncertainty=True)
        if r["config"]["steps"] == min(x["config"]["steps"] for x in edm2_rows(store, variant="edm2", uncertainty=True))
    ]
    rows = [r for r in rows if not r["config"].get("posthoc")]
    if not {r["config"]["lsc"] for r in rows} - {"none"}:
        return ["_Not run yet._"]
    groups = {}
    for r in rows:
        groups.setdefault(r["config"]["lsc"], []).append(r)
    lines = ["| method | seeds | EDM2 loss (last 25%) | FD @ end |", "|---|---|---|---|"]
    for method, group in groups.items():
        lines.append(
            f"| {label(method)} | {len(group)} | {mean_sd([g['loss_tail'] for g in group], 4)} "
            f"| {mean_sd([g['final_fd'] for g in group], 1)} |"
        )
    return lines


def budget_section(store: ResultStore) -> list[str]:
    """CPU time actually spent per table (one thread; whole runs including sampling and the metric)."""
    groups: dict[str, list[dict]] = {}
    for r in store.rows("scalelong_sweep"):
        groups.setdefault("1. instability sweep", []).append(r)
    for r in store.rows("scalelong_compare"):
        groups.setdefault(f"2. ScaleLong comparison, {r['config']['regime']}", []).append(r)
    for r in store.rows("edm2_runs"):
        c = r["config"]
        if c["lsc"] != "none" or (c["variant"] == "edm2" and c["steps"] != max_steps(store)):
            name = "2. ScaleLong inside the EDM2 UNet"
        elif c["variant"] == "unet2d_edm" or c.get("posthoc"):
            name = "3-4. magnitudes + post-hoc EMA (and recipe)"
        else:
            name = "5. uncertainty + recipe"
        groups.setdefault(name, []).append(r)
    lines = ["| table | runs | CPU minutes (1 thread) | finished (UTC) |", "|---|---|---|---|"]
    for name in sorted(groups):
        rows = groups[name]
        minutes = sum(r.get("run_cpu_s", r["train_cpu_s"]) for r in rows) / 60
        times = sorted(r["finished_utc"] for r in rows if "finished_utc" in r)
        span = f"{times[0]} to {times[-1][-5:]}" if times else "-"
        lines.append(f"| {name} | {len(rows)} | {minutes:.1f} | {span} |")
    return lines


def max_steps(store: ResultStore) -> int:
    return max((r["config"]["steps"] for r in store.rows("edm2_runs")), default=0)


def fd_noise(store: ResultStore, table: str, variant: str | None = None) -> dict:
    """Sample noise of FD in one table: RMS over its two-set evaluations of |A - B| / sqrt(2) (one set of N samples).
    Per table, because the noise grows with the FD level (U-ViT runs that stalled sit near FD 190, EDM2 near 20)."""
    rows = [r for r in store.rows(table) if variant is None or r["config"].get("variant") == variant]
    diffs = [abs(r["final_fd_a"] - r["final_fd_b"]) for r in rows if r.get("final_fd_a") is not None]
    if not diffs:
        return {}
    single = math.sqrt(statistics.mean(d * d for d in diffs) / 2)
    return {"single": single, "mean_of_two": single / math.sqrt(2), "count": len(diffs)}


def summary_figure(folder: str, compare: dict, posthoc: dict, recipe: dict) -> None:
    """One figure for the README: ScaleLong paired ΔFD per method, post-hoc EMA curve, recipe FD."""
    figure = new_figure(13, 3.8)
    axes = figure.add_subplot(1, 3, 1)
    methods = list(dict.fromkeys(m for stats in compare.values() for m in stats if m != "none" and stats[m]["deltas"]))
    for offset, (regime, stats) in enumerate(compare.items()):
        shown = [m for m in methods if m in stats and stats[m]["deltas"]]
        xs = [methods.index(m) + 0.15 * offset for m in shown]
        means = [statistics.mean(stats[m]["deltas"]) for m in shown]
        errors = [statistics.stdev(stats[m]["deltas"]) if len(stats[m]["deltas"]) > 1 else 0 for m in shown]
        axes.errorbar(xs, means, yerr=errors, fmt="o", capsize=3, label=f"{regime} regime (bars: sd over seeds)")
    axes.set_xticks(range(len(methods)), [label(m) for m in methods], fontsize=7)
    axes.axhline(0, color="gray", lw=1)
    axes.set_title("ScaleLong: FD - vanilla FD (same seed)", fontsize=9)
    axes.legend(fontsize=7)
    if posthoc:
        axes = figure.add_subplot(1, 3, 2)
        sigmas = sorted(posthoc["curve"])
        axes.plot(sigmas, [posthoc["curve"][s] for s in sigmas], marker="o", ms=3)
        axes.set_xscale("log")
        axes.set_xticks([0.02, 0.05, 0.1, 0.2], ["0.02", "0.05", "0.1", "0.2"])
        axes.minorticks_off()
        axes.axhline(posthoc["run"]["raw_fd"], color="gray", ls="--", lw=1, label="raw weights (no EMA)")
        axes.set_xlabel("sigma_rel")
        axes.legend(fontsize=7)
        axes.set_title("EDM2 post-hoc EMA: FD vs sigma_rel", fontsize=9)
    if recipe:
        axes = figure.add_subplot(1, 3, 3)
        names = list(recipe)
        for i, name in enumerate(names):
            fds = [g["final_fd"] for g in recipe[name]]
            axes.scatter([i] * len(fds), fds, color=f"C{i}")
        axes.set_xticks(range(len(names)), [n.replace(", ", "\n") for n in names], fontsize=7)
        axes.set_title("FD at equal steps (points: seeds)", fontsize=9)
    figure.tight_layout()
    save(figure, os.path.join(folder, "summary.png"))


def build_report(out: str, report_path: str) -> str:
    store = ResultStore(out)
    sweep = sweep_section(store, out)
    unstable, unstable_stats = compare_section(store, out, "unstable")
    stable, stable_stats = compare_section(store, out, "stable")
    edge, edge_stats = compare_section(store, out, "edge")
    conv, conv_stats = compare_section(store, out, "conv")
    magnitudes = magnitudes_section(store, out)
    noise = {
        "scalelong": fd_noise(store, "scalelong_compare"),
        "edm2": fd_noise(store, "edm2_runs"),
        "edm2_only": fd_noise(store, "edm2_runs", variant="edm2"),
    }
    posthoc, posthoc_data = posthoc_section(store, out, noise["edm2_only"])
    recipe, recipe_groups = recipe_section(store, out)
    lsc = lsc_section(store)
    budget = budget_section(store)
    regimes = {"unstable": unstable_stats, "edge": edge_stats, "stable": stable_stats}
    summary_figure(out, {name: stats for name, stats in regimes.items() if stats}, posthoc_data, recipe_groups)
    context = {
        "store": store,
        "noise": noise,
        "unstable": unstable_stats,
        "stable": stable_stats,
        "edge": edge_stats,
        "conv": conv_stats,
        "posthoc": posthoc_data,
        "recipe": recipe_groups,
    }
    text = verdicts.render(
        context,
        {
            "sweep": sweep,
            "unstable": unstable,
            "stable": stable,
            "edge": edge,
            "conv": conv,
            "magnitudes": magnitudes,
            "posthoc": posthoc,
            "recipe": recipe,
            "lsc": lsc,
            "budget": budget,
        },
    )
    temporary = report_path + ".tmp"
    with open(temporary, "w") as handle:
        handle.write(text)
    os.replace(temporary, report_path)
    return text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("--report", default=None, help="default: <out>.md beside the folder")
    args = parser.parse_args(argv)
    build_report(args.out, args.report or args.out.rstrip("/") + ".md")


if __name__ == "__main__":
    main()
