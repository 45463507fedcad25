"""run_and_exit: how a training script's process ends. Alone, as Python ends any script; launched as one of several
processes, after the exit functions but without the interpreter's teardown, where torch's leftover gloo threads can
abort a run that has written everything. Real processes; the slow test launches real two-process FSDP2 runs."""

import socket
import subprocess
import sys
import textwrap

import pytest
import torch
from _training_scripts import ROOT, script_env

SCRIPT = textwrap.dedent(
    """
    import atexit, sys
    from diffusers_scalelong.trainer import run_and_exit

    class TornDown:  # its __del__ runs only in the interpreter's teardown
        def __del__(self):
            print("torn down", flush=True)

    kept = TornDown()
    atexit.register(lambda: print("exit functions ran", flush=True))

    def main():
        print("buffered", end="")  # no newline, no flush: the exit must flush it
        if sys.argv[1] == "message":
            sys.exit("refused: a message")
        return int(sys.argv[1])

    run_and_exit(main)
    """
)


def _run(tmp_path, argument: str, world_size: str | None) -> subprocess.CompletedProcess:
    path = tmp_path / "script.py"
    path.write_text(SCRIPT)
    env = script_env()
    env.pop("WORLD_SIZE", None)
    if world_size is not None:
        env["WORLD_SIZE"] = world_size
    return subprocess.run([sys.executable, str(path), argument], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("code", ["0", "3"])  # 0: os._exit receives the int a clean main returns
def test_a_launched_process_runs_exit_functions_flushes_and_skips_the_teardown(tmp_path, code):
    result = _run(tmp_path, code, world_size="2")
    assert result.returncode == int(code), result.stderr
    assert result.stdout.startswith("buffered")
    assert "exit functions ran" in result.stdout
    assert "torn down" not in result.stdout


def test_a_process_alone_ends_as_python_ends_it(tmp_path):
    result = _run(tmp_path, "3", world_size=None)
    assert result.returncode == 3, result.stderr
    assert "exit functions ran" in result.stdout and "torn down" in result.stdout


def test_a_launched_process_exiting_with_a_message_prints_it_and_exits_with_1(tmp_path):
    result = _run(tmp_path, "message", world_size="2")
    assert result.returncode == 1
    assert "refused: a message" in result.stderr


FSDP2_RUN = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from diffusers_scalelong.trainer import run_and_exit

    def main():
        dist.init_process_group("gloo")
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
        mesh = init_device_mesh("cpu", (2,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.Adam(model.parameters())
        for _ in range(3):
            model(torch.randn(8, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        dist.barrier()
        dist.destroy_process_group()
        return 0

    run_and_exit(main)
    """
)


@pytest.mark.slow  # 30 two-process launches: about 3 minutes
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_two_process_fsdp2_runs_end_cleanly(tmp_path):
    """Without run_and_exit, 5 of 60 such launches aborted in the teardown on a busy 2-core machine (so 30 clean
    launches happen by chance about 7 times in 100)."""
    path = tmp_path / "fsdp2_run.py"
    path.write_text(FSDP2_RUN)
    for launch in range(30):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--rdzv_backend", "c10d"]
        command += ["--rdzv_endpoint", f"127.0.0.1:{port}", str(path)]
        result = subprocess.run(command, capture_output=True, text=True, env=script_env(), cwd=ROOT, timeout=300)
        assert result.returncode == 0, (launch, result.stderr[-3000:])
