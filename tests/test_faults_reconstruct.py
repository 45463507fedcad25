"""The reconstruct CLI under faults: killed at every file-system step (with and without ``--overwrite``), a
truncated or corrupt snapshot, a full disk and a read-only output folder.

A kill must leave each model folder as the complete old result or the complete new one (the old one possibly
moved aside, in which case the next run puts it back), and the next run must tidy every leftover.
"""

import ctypes
import os
import resource
import shutil
import signal
from pathlib import Path

import pytest
import torch
from _forked import kill_at, run_forked

from diffusers_scalelong.ema import PowerFunctionEMA
from diffusers_scalelong.ema.cli import main as cli_main

TARGETS = ("0.060", "0.080")
NAMES = [f"phema-0000000040-{sigma_rel}" for sigma_rel in TARGETS]
HOOKS = {
    "mkdir": (os, "mkdir"),
    "replace": (os, "replace"),
    "rmtree": (shutil, "rmtree"),
    "write_text": (Path, "write_text"),
}


@pytest.fixture(scope="module")
def snapshots(tmp_path_factory) -> Path:
    """Snapshots of two profiles of a small two-layer model at times 10..40."""
    folder = tmp_path_factory.mktemp("snapshots")
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.10))
    for step in range(1, 41):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.01)
        ema.update(model, step)
        if step % 10 == 0:
            ema.save_snapshots(folder, step, is_main_process=True)
    return folder


def _argv(snapshots: Path, output: Path, dtype: str, *extra: str) -> list[str]:
    return [str(snapshots), "--sigma_rel", *TARGETS, "--output_dir", str(output), "--dtype", dtype, *extra]


def _tree(folder: Path) -> dict[str, bytes] | None:
    if not folder.is_dir():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def results(snapshots, tmp_path_factory) -> dict[str, dict[str, dict[str, bytes]]]:
    """The complete old (float16) and new (float32) result of every target, written by undisturbed runs."""
    trees = {}
    for dtype in ("float16", "float32"):
        output = tmp_path_factory.mktemp(dtype)
        assert cli_main(_argv(snapshots, output, dtype)) == 0
        trees[dtype] = {name: _tree(output / name) for name in NAMES}
    assert trees["float16"] != trees["float32"]
    return trees


def _steps(snapshots: Path, tmp_path: Path, overwrite: bool) -> list[tuple[str, int]]:
    """Every (function, n-th call) of the file-system steps one run takes, counted in an undisturbed child."""
    output = tmp_path / "count"
    extra = ("--overwrite",) if overwrite else ()
    if overwrite:
        assert cli_main(_argv(snapshots, output, "float16")) == 0
    counted = tmp_path / "counts.txt"

    def work() -> int:
        counts = kill_at(("none", 0), HOOKS)
        code = cli_main(_argv(snapshots, output, "float32", *extra))
        counted.write_text(repr(counts))
        return code

    status, output_text = run_forked(work)
    assert status == 0, output_text
    counts = eval(counted.read_text())  # noqa: S307 - a dict literal this test wrote
    return [(name, n) for name, total in counts.items() for n in range(1, total + 1)]


def _kill_then_recover(snapshots: Path, output: Path, step: tuple[str, int], overwrite: bool, results, caplog) -> None:
    """Write the old result (when ``overwrite``), kill a run writing the new one at ``step``, check each folder, then
    check that the next run puts everything right."""
    extra = ("--overwrite",) if overwrite else ()
    if overwrite:
        assert cli_main(_argv(snapshots, output, "float16")) == 0

    def work() -> int:
        kill_at(step, HOOKS)
        return cli_main(_argv(snapshots, output, "float32", *extra))

    status, text = run_forked(work)
    assert status == -signal.SIGKILL, f"{step}: the run was not killed ({status}):\n{text}"
    allowed = [results["float32"]] + ([results["float16"]] if overwrite else [None])
    for name in NAMES:
        tree = _tree(output / name)
        if tree is None and overwrite:  # killed between the two renames: the old folder waits aside, complete
            (aside,) = output.glob(f".{name}.old.*.tmp")
            tree = _tree(aside)
        assert tree in [a and a[name] if a else None for a in allowed], f"{step}: {name} is neither old nor new"
    leftovers = sorted(p.name for p in output.iterdir() if p.name.startswith(".")) if output.exists() else []

    caplog.clear()
    assert cli_main(_argv(snapshots, output, "float32", "--overwrite")) == 0
    assert {name: _tree(output / name) for name in NAMES} == results["float32"]
    assert sorted(p.name for p in output.iterdir()) == NAMES, f"{step}: leftovers were not tidied"
    said = " ".join(record.getMessage() for record in caplog.records)
    assert all(name in said for name in leftovers), f"{step}: the next run did not name {leftovers}: {said}"


def test_kill_between_moving_the_old_folder_aside_and_renaming_the_new_one(snapshots, results, tmp_path, caplog):
    """The moment a delete-then-rename loses both: the old folder has been moved aside, the new one is not yet in
    place. The next run (even without --overwrite) restores the old folder first."""
    output = tmp_path / "out"
    assert cli_main(_argv(snapshots, output, "float16")) == 0

    def work() -> int:
        kill_at(("replace", 2), HOOKS)  # 1: old folder aside, 2: new folder into place
        return cli_main(_argv(snapshots, output, "float32", "--overwrite"))

    status, text = run_forked(work)
    assert status == -signal.SIGKILL, text
    assert not (output / NAMES[0]).exists()
    (aside,) = output.glob(f".{NAMES[0]}.old.*.tmp")
    assert _tree(aside) == results["float16"][NAMES[0]]
    assert _tree(output / NAMES[1]) == results["float16"][NAMES[1]]

    with pytest.raises(SystemExit) as exit_info:  # without --overwrite: the old result is restored, then refused
        cli_main(_argv(snapshots, output, "float32"))
    assert exit_info.value.code == 2
    assert {name: _tree(output / name) for name in NAMES} == results["float16"]
    assert sorted(p.name for p in output.iterdir()) == NAMES
    assert any(f"restored {output / NAMES[0]}" in record.getMessage() for record in caplog.records)
    assert cli_main(_argv(snapshots, output, "float32", "--overwrite")) == 0
    assert {name: _tree(output / name) for name in NAMES} == results["float32"]


@pytest.mark.parametrize("overwrite", [True, False], ids=["overwrite", "fresh"])
def test_kill_at_every_file_system_step(snapshots, results, tmp_path, caplog, overwrite):
    steps = _steps(snapshots, tmp_path, overwrite)
    assert len(steps) >= (10 if overwrite else 6), steps
    assert ("replace", 2 * len(NAMES) if overwrite else len(NAMES)) in steps  # every rename of the run is a step
    for index, step in enumerate(steps):
        _kill_then_recover(snapshots, tmp_path / f"out-{index}", step, overwrite, results, caplog)


def test_a_stale_temporary_of_a_live_process_is_left_alone(snapshots, tmp_path):
    """Only leftovers of ended processes are tidied: a run in progress keeps its temporaries."""
    output = tmp_path / "out"
    output.mkdir()
    live = output / f".{NAMES[0]}.{os.getppid()}-abcdefgh.tmp"  # the process that started pytest is alive
    live.mkdir()
    assert cli_main(_argv(snapshots, output, "float32")) == 0
    assert live.is_dir()


# ------------------------------------------------------------------------------------------ one-line errors
def _one_line_error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "error" in line]
    assert line.startswith("scalelong-reconstruct-ema: error:") and "Traceback" not in err
    return line


@pytest.mark.parametrize("damage", ["truncated", "garbage header"])
def test_damaged_snapshot_file_is_a_one_line_error(snapshots, tmp_path, capsys, damage):
    folder = tmp_path / "snapshots"
    shutil.copytree(snapshots, folder)
    victim = folder / "phema-0000000030-0.050.safetensors"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) - 40] if damage == "truncated" else b"\xff" * 8 + data[8:])
    line = _one_line_error(capsys, _argv(folder, tmp_path / "out", "float32"))
    assert str(victim) in line
    assert not (tmp_path / "out").exists()


def test_full_disk_is_a_one_line_error_and_leaves_nothing(snapshots, tmp_path):
    """A write that fails for lack of space (here: the file-size limit, EFBIG) ends in one line, status 2."""
    output = tmp_path / "out"

    def work() -> int:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
        return cli_main(_argv(snapshots, output, "float32"))

    status, text = run_forked(work)
    assert status == 2, text
    assert "Traceback" not in text
    assert text.strip().splitlines()[-1].startswith("scalelong-reconstruct-ema: error:")
    assert not output.exists()


def _make_read_only(folder: Path) -> bool:
    """Make ``folder`` read-only for this (child) process: a read-only bind mount for root, else its mode."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        return True
    libc = ctypes.CDLL(None, use_errno=True)
    ms_rdonly, ms_remount, ms_bind, ms_rec, ms_private = 1, 32, 4096, 16384, 1 << 18
    steps = [
        lambda: libc.unshare(0x00020000),  # CLONE_NEWNS: the mount is seen by this child only
        lambda: libc.mount(None, b"/", None, ms_rec | ms_private, None),
        lambda: libc.mount(bytes(folder), bytes(folder), None, ms_bind, None),
        lambda: libc.mount(None, bytes(folder), None, ms_bind | ms_remount | ms_rdonly, None),
    ]
    return all(step() == 0 for step in steps)


def test_read_only_output_folder_is_a_one_line_error(snapshots, tmp_path):
    output = tmp_path / "out"
    output.mkdir()

    def work() -> int:
        if not _make_read_only(output):
            return 77
        return cli_main(_argv(snapshots, output, "float32"))

    status, text = run_forked(work)
    if status == 77:
        pytest.skip(
            "running as root, whom permission bits do not stop, in a container that refuses the read-only bind "
            "mount (no CAP_SYS_ADMIN for a private mount namespace): no way to make a folder read-only here"
        )
    assert status == 2, text
    assert "Traceback" not in text
    line = text.strip().splitlines()[-1]
    assert line.startswith("scalelong-reconstruct-ema: error:") and str(output) in line
    assert list(output.iterdir()) == []


def test_plot_into_a_missing_folder_creates_it(snapshots, tmp_path):
    plot = tmp_path / "new" / "deeper" / "profiles.png"
    assert cli_main([*_argv(snapshots, tmp_path / "out", "float32"), "--plot", str(plot)]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
