"""One writer per output folder: the lock a run holds on it, tested with real processes."""

import gc
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import pytest
from _earlier_run import write_earlier_run
from _training_scripts import ROOT, TINY_UNET, TRAIN_UNCONDITIONAL, run_script, script_env

from diffusers_scalelong.trainer.folder_lock import lock_folder
from diffusers_scalelong.trainer.run_identity import start_run


@contextmanager
def held_by_child(folder, **start_options):
    """A forked child process that holds ``folder`` through ``start_run`` until the block ends; yields its pid."""
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(ready_read)
            run = start_run(folder, None, False, is_main_process=True, **start_options)
            os.write(ready_write, b"locked")
            signal.pause()  # until the test kills it
            del run
        finally:
            os._exit(code)
    os.close(ready_write)
    try:
        assert os.read(ready_read, 16) == b"locked", "the child did not take the lock"
        yield pid
    finally:
        os.close(ready_read)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


def test_a_second_run_is_refused_naming_the_first_and_a_killed_run_leaves_no_lock(tmp_path):
    with held_by_child(tmp_path) as pid:
        with pytest.raises(ValueError) as refused:
            start_run(tmp_path, None, False, is_main_process=True)
        message = str(refused.value)
        assert "is in use by another training run" in message and str(tmp_path) in message
        assert f"pid {pid} on host {socket.gethostname()}" in message
    # the child was killed with SIGKILL while holding the lock: the folder is free at once
    with start_run(tmp_path, None, False, is_main_process=True) as run:
        assert run.holds_lock


def test_only_the_main_process_locks(tmp_path, monkeypatch):
    with held_by_child(tmp_path):
        run = start_run(tmp_path, None, False, is_main_process=False)
        assert not run.holds_lock
        monkeypatch.setenv("RANK", "1")  # what torchrun and accelerate launch set for the other processes
        assert not start_run(tmp_path, None, False).holds_lock
        monkeypatch.setenv("RANK", "0")
        with pytest.raises(ValueError, match="in use by another training run"):
            start_run(tmp_path, None, False)


def test_the_lock_is_released_when_the_run_closes_or_is_refused(tmp_path):
    with start_run(tmp_path, None, False, is_main_process=True):
        with pytest.raises(ValueError, match="that is this process: an earlier run in it is still open"):
            start_run(tmp_path, None, False, is_main_process=True)
    run = start_run(tmp_path, None, False, is_main_process=True)
    del run  # a run never closed releases the folder when it is garbage-collected
    gc.disable()  # the cycle below is collected by start_run, not by chance
    try:
        cycle = [start_run(tmp_path, None, False, is_main_process=True)]
        cycle.append(cycle)  # reclaimed only by the cycle collector (as through an exception's traceback)
        del cycle
        kept = start_run(tmp_path, None, False, is_main_process=True)
    finally:
        gc.enable()
    with pytest.raises(ValueError, match="that is this process: an earlier run in it is still open"):
        start_run(tmp_path, None, False, is_main_process=True)  # a run still referenced is not collected
    kept.close()
    write_earlier_run(tmp_path / "out")
    with pytest.raises(ValueError, match="already holds another training run"):
        start_run(tmp_path / "out", None, False, is_main_process=True)
    lock_folder(tmp_path / "out").release()  # the refused start let go of the lock


@pytest.mark.slow
def test_two_training_scripts_into_one_folder(tmp_path):
    """A second training script started while the first trains exits with status 2 naming the first one."""
    output = tmp_path / "out"
    command = [sys.executable, str(TRAIN_UNCONDITIONAL), "--output_dir", str(output), *map(str, TINY_UNET)]
    command += ["--max_train_steps", "100000", "--checkpointing_steps", "100000"]
    first = subprocess.Popen(command, env=script_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while str(first.pid) not in ((output / ".run.lock").read_text() if (output / ".run.lock").exists() else ""):
            assert first.poll() is None, first.stderr.read().decode()
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        second = run_script(TRAIN_UNCONDITIONAL, ["--output_dir", output, *TINY_UNET], check=False)
        assert second.returncode == 2, second.stderr
        assert f"is in use by another training run (pid {first.pid} on host" in second.stderr
        assert first.poll() is None, "the first run goes on"
    finally:
        first.kill()
        first.wait()
        first.stderr.close()


def test_a_run_decided_before_its_folder_exists_locks_it_once_created(tmp_path):
    output = tmp_path / "new"
    run = start_run(output, "latest", False, is_main_process=True)
    assert (run.resume_from, run.holds_lock, output.exists()) == (None, False, False)  # nothing created yet
    output.mkdir()
    with held_by_child(output) as pid:  # another run took the new folder meanwhile
        with pytest.raises(ValueError, match=f"in use by another training run \\(pid {pid} "):
            run.hold_folder()
    write_earlier_run(output)  # ... and wrote a run into it
    with pytest.raises(ValueError, match="changed while this run was being set up"):
        run.hold_folder()  # "latest" would now resume the other run
    fresh = start_run(tmp_path / "fresh", None, False, is_main_process=True)
    shutil.copytree(output, tmp_path / "fresh")
    with pytest.raises(ValueError, match="already holds another training run"):
        fresh.hold_folder()
    assert not run.holds_lock and not fresh.holds_lock
    other = start_run(tmp_path / "other", None, False, is_main_process=True)
    (tmp_path / "other").mkdir()
    other.clear_discarded(tmp_path / "other")  # the name the training loop calls it by until it is rewired
    assert other.holds_lock and not start_run(tmp_path / "other", None, False, is_main_process=False).holds_lock
    with pytest.raises(ValueError, match="that is this process"):
        start_run(tmp_path / "other", None, False, is_main_process=True)
