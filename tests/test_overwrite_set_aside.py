"""--overwrite_output_dir replaces the earlier run, never deletes it first: real processes, real kills."""

import os
import shutil
import signal

import pytest
from _earlier_run import tree, write_checkpoint, write_earlier_run, write_snapshots
from _forked import kill_at, run_forked
from _training_scripts import TINY_UNET, TRAIN_UNCONDITIONAL, run_script

from diffusers_scalelong.ema import list_snapshots
from diffusers_scalelong.trainer import Checkpoint
from diffusers_scalelong.trainer.run_identity import SET_ASIDE_PREFIX, start_run

EARLIER = "a" * 32
EARLIER_ENTRIES = ["checkpoint-2", "checkpoint-4", "ema_snapshots", "samples"]


@pytest.fixture
def earlier(tmp_path):
    """An output folder holding an earlier run, and its files as they were."""
    output = tmp_path / "out"
    write_earlier_run(output, EARLIER)
    return output, tree(output)


def _new_run(output, staging, checkpoint: bool) -> int:
    """In a child process: a run with --overwrite_output_dir that sets the earlier run aside, writes snapshots and
    a sample grid, then (``checkpoint``) its first checkpoint and drops the earlier run, or stops on an error."""
    with start_run(output, None, True, is_main_process=True) as run:
        run.set_aside()
        write_snapshots(output, range(1, 4), run.run_id, seed=1)
        (output / "samples").mkdir()
        (output / "samples" / "step-0000001.png").write_bytes(b"new grid")
        if not checkpoint:
            raise RuntimeError("the run fails before its first checkpoint")
        write_checkpoint(output, 2, run.run_id, staging)
        run.drop_set_aside()
    return 0


def _snapshot_ids(output):
    return {info.run_id for info in list_snapshots(output / "ema_snapshots")}


def _checkpoint_ids(output):
    return {checkpoint.path.name: checkpoint.read_state()["run_id"] for checkpoint in Checkpoint.find_all(output)}


def test_a_run_failing_before_its_first_checkpoint_puts_the_earlier_run_back(earlier, tmp_path):
    output, before = earlier
    status, log = run_forked(lambda: _new_run(output, tmp_path / "staging", checkpoint=False))
    assert status == 99 and "fails before its first checkpoint" in log  # the exception, as run_forked reports it
    assert tree(output) == before
    assert not list(output.glob(f"{SET_ASIDE_PREFIX}*"))


def test_what_is_set_aside_and_put_back_is_named(earlier, tmp_path, caplog):
    output, before = earlier
    with pytest.raises(RuntimeError):
        _new_run(output, tmp_path / "staging", checkpoint=False)
    moved, restored = (record.getMessage() for record in caplog.records)
    assert "moved the earlier run's checkpoint-2, checkpoint-4, ema_snapshots, samples into .set-aside-" in moved
    assert "stopped before its first checkpoint: put the earlier run back (checkpoint-2, checkpoint-4, " in restored
    assert "deleted what it had written (ema_snapshots, samples)" in restored
    assert tree(output) == before


def test_a_run_that_checkpointed_replaces_the_earlier_run(earlier, tmp_path):
    output, _ = earlier
    status, log = run_forked(lambda: _new_run(output, tmp_path / "staging", checkpoint=True))
    assert status == 0, log
    (new_id,) = set(_checkpoint_ids(output).values())
    assert list(_checkpoint_ids(output)) == ["checkpoint-2"] and new_id != EARLIER
    assert sorted(path.name for path in (output / "ema_snapshots").iterdir()) == [
        f"phema-{step:010d}-{sigma_rel}.safetensors" for step in (1, 2, 3) for sigma_rel in ("0.050", "0.100")
    ]
    assert not list(output.glob(f"{SET_ASIDE_PREFIX}*"))


def test_a_finished_run_without_checkpoints_replaces_the_earlier_run(earlier):
    output, _ = earlier
    with start_run(output, None, True, is_main_process=True) as run:
        run.set_aside()
        (output / "model_index.json").unlink()  # the final pipeline is swapped in (a new file)
        (output / "model_index.json").write_text("{}")
    assert not any((output / name).exists() for name in EARLIER_ENTRIES)
    assert not list(output.glob(f"{SET_ASIDE_PREFIX}*"))


def test_checks_that_fail_after_start_run_move_nothing(earlier):
    output, before = earlier
    with pytest.raises(ValueError, match="a bad option"):
        with start_run(output, None, True, is_main_process=True):
            raise ValueError("a bad option")  # a check after start_run, before set_aside
    assert tree(output) == before


@pytest.mark.parametrize("checkpoint", [False, True], ids=["fails-early", "checkpoints"])
@pytest.mark.parametrize(
    "killed_in", ["replace", "rmdir", *(pytest.param(name, marks=pytest.mark.slow) for name in ("mkdir", "unlink"))]
)
def test_a_kill_at_any_point_is_settled_by_the_next_start(earlier, tmp_path, checkpoint, killed_in):
    """SIGKILL before each call of one file-system function (``os.replace``: every move; the others: every folder
    made, file or folder deleted) in a replacing run: the next start puts the earlier run back bit for bit, or,
    once the new run's first checkpoint is complete, deletes the earlier run and resumes the new one."""
    output, before = earlier
    pristine = tmp_path / "pristine"
    shutil.copytree(output, pristine)
    outcomes = set()
    for index in range(1, 500):
        shutil.rmtree(output)
        shutil.copytree(pristine, output)
        shutil.rmtree(tmp_path / "s", ignore_errors=True)

        def work(index=index):
            kill_at((killed_in, index), {killed_in: (os, killed_in)})
            return _new_run(output, tmp_path / "s", checkpoint)

        status, _ = run_forked(work)
        if status != -signal.SIGKILL:  # the run got past its last call of the function
            break
        recovered = start_run(output, "latest", False, is_main_process=True)
        recovered.close()
        assert not list(output.glob(f"{SET_ASIDE_PREFIX}*"))
        if recovered.resume_from is None or recovered.run_id == EARLIER:
            assert tree(output) == before, index
            outcomes.add("put back")
        else:
            assert checkpoint and list(_checkpoint_ids(output)) == ["checkpoint-2"], index
            assert _snapshot_ids(output) == {recovered.run_id}, index
            assert sorted(path.name for path in (output / "samples").iterdir()) == ["step-0000001.png"]
            outcomes.add("replaced")
    assert index > 1, "the run was never killed"
    if not checkpoint:
        assert outcomes == {"put back"}
    else:  # every move (os.replace) comes before the checkpoint is complete; deleting the earlier run after it
        assert ("replaced" in outcomes) == (killed_in in ("rmdir", "unlink")), outcomes


@pytest.mark.slow
def test_overwrite_with_too_few_images_keeps_the_earlier_run(earlier):
    """The training script with --overwrite_output_dir and a data set too small for one step: refused, and the
    earlier run is back bit for bit."""
    output, before = earlier
    args = ["--output_dir", output, *TINY_UNET, "--overwrite_output_dir", "--max_train_samples", 4]
    result = run_script(TRAIN_UNCONDITIONAL, args, check=False)
    assert result.returncode == 2 and "give no full optimiser step" in result.stderr, result.stderr
    assert tree(output) == before
    assert not list(output.glob(f"{SET_ASIDE_PREFIX}*"))
