"""Smoke test of the reproduction study: each script runs at a tiny size, a second invocation skips finished runs,
and the report and its figures regenerate from the JSON lines alone."""

import json
import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "reproduce"))

import report  # noqa: E402
import run as study  # noqa: E402

STAGES = ["sweep", "edm2_main", "compare_core_seed0", "edm2_recipe_seed0"]
FIGURES = [
    "scalelong_sweep.png",
    "scalelong_unstable.png",
    "scalelong_stable.png",
    "summary.png",
    "edm2_magnitudes.png",
    "posthoc_ema.png",
    "recipe.png",
]


@pytest.fixture
def keep_threads():
    """The study pins torch to one thread; give the test process its setting back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def line_counts(folder: str) -> dict[str, int]:
    return {
        name: sum(1 for _ in open(os.path.join(folder, name))) for name in os.listdir(folder) if name.endswith(".jsonl")
    }


def test_study_resumes_and_report_regenerates_from_json_lines(tmp_path, capsys, keep_threads):
    out = tmp_path / "results"
    study.main(["--scale", "smoke", "--out", str(out), "--only", *STAGES])
    first = capsys.readouterr().out
    counts = line_counts(out)
    assert set(counts) == {"scalelong_sweep.jsonl", "scalelong_compare.jsonl", "edm2_runs.jsonl"}
    assert counts["scalelong_sweep.jsonl"] == 4  # 2 lrs without warm-up + the same 2 with
    assert counts["scalelong_compare.jsonl"] == 6  # vanilla, CS and LS in the unstable and the stable regime
    assert counts["edm2_runs.jsonl"] == 4  # EDM2 + standard UNet (magnitudes), EDM2 without uncertainty, DDPM
    assert first.count("[") >= sum(counts.values())

    study.main(["--scale", "smoke", "--out", str(out), "--only", *STAGES])
    second = capsys.readouterr().out
    assert line_counts(out) == counts
    assert "[scalelong_" not in second and "[edm2_runs]" not in second  # nothing was trained again

    rows = [json.loads(line) for line in open(out / "edm2_runs.jsonl")]
    posthoc = next(r for r in rows if r["config"].get("posthoc"))["posthoc"]
    assert sorted(map(float, posthoc)) == [0.05, 0.1, 0.2]

    # Only the JSON lines travel to a fresh folder: the report and every figure come back from them.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    for name in counts:
        shutil.copy(out / name, fresh / name)
    report_path = tmp_path / "fresh.md"
    report.main(["--out", str(fresh), "--report", str(report_path)])
    text = report_path.read_text()
    for heading in ("instability sweep", "Stable regime", "magnitude preservation", "post-hoc EMA", "DDPM recipe"):
        assert heading in text
    # Every section the smoke stages feed is filled; the edge-of-stability comparison is not among those stages.
    filled = text.split("### Edge of stability")[0].replace("- ScaleLong, edge of stability: Verdict: not run yet.", "")
    assert "not run yet" not in filled
    for figure in FIGURES:
        assert (fresh / figure).stat().st_size > 1000
    report.main(["--out", str(fresh), "--report", str(report_path)])
    assert report_path.read_text() == text  # deterministic: the same JSON lines give the same report


def test_regimes_are_picked_from_the_base_sweep_by_the_stated_rule(tmp_path):
    """Unstable: the smallest failing no-warm-up lr; stable: the largest quiet lr with warm-up; edge: the geometric
    mean of the unstable lr and the largest no-warm-up lr below it that trained. Extended rows (other widths) do not
    move the regimes."""
    import scalelong_study as sl
    from common import ResultStore, run_key

    scale = {**study.SCALES["full"], "depths": [12]}
    store = ResultStore(str(tmp_path))
    base = {"family": "uvit", "depth": 12, "width": scale["width"], "batch": scale["batch"], "method": "none"}
    base.update({"seed": 0, "steps": 300})

    def add(lr, warmup, loss_tail, **changes):
        config = {**base, "lr": lr, "warmup": warmup, **changes}
        record = {"config": config, "loss_tail": loss_tail, "loss_diverged": False, "loss_spikes": 0, "grad_spikes": 0}
        store.append(sl.SWEEP_TABLE, run_key(config), record)

    add(0.001, 0, 0.3)
    add(0.01, 0, 0.2)
    add(0.03, 0, 1.0)  # stalled
    add(0.01, 100, 0.2)
    add(0.03, 100, 0.2)
    add(0.01, 0, 1.0, width=2 * scale["width"])  # an extended row that stalled at a lower lr
    regimes = sl.pick_regimes(store, scale)
    assert regimes["unstable"]["lr"] == 0.03 and regimes["unstable"]["warmup"] == 0
    assert regimes["stable"]["lr"] == 0.03 and regimes["stable"]["warmup"] == 100
    assert regimes["edge"]["lr"] == 0.0173 and regimes["edge"]["warmup"] == 0  # sqrt(0.01 * 0.03) = 0.01732
    assert regimes["edge"]["width"] == scale["width"]
    edge_runs = sl.compare_configs(store, scale, "edge", [0, 1])
    assert len(edge_runs) == 2 * len(sl.METHODS) and {c["regime"] for c in edge_runs} == {"edge"}
