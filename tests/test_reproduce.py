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
    assert "not run yet" not in text.split("### Conv UNet")[0]
    for figure in FIGURES:
        assert (fresh / figure).stat().st_size > 1000
    report.main(["--out", str(fresh), "--report", str(report_path)])
    assert report_path.read_text() == text  # deterministic: the same JSON lines give the same report
