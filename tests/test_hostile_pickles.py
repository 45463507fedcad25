"""Hostile network pickles and checkpoints: each is refused with one line, and the process stays as it was.

The corpus (``tests/_hostile_pickles.py``) is built byte by byte; ``tests/_hostile_runner.py`` feeds it to the
command-line converters inside one child process that runs under an address-space limit, and after every file
converts a benign reference again and compares it with what the same process gave when it was fresh.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from test_convert_edm2 import official  # noqa: F401  (fixture: fake official modules and pickle writer)
from test_convert_uvit import HEADS, official_state_dict

from diffusers_scalelong.convert import PickleLimits, UnsafePickleError, load_restricted_pickle, load_torch_checkpoint
from tests._hostile_pickles import build_corpus, network_pickles

TESTS = Path(__file__).parent
# Address space a child may map beyond what its imports mapped: the benign conversions need tens of MB; every
# allocation bomb of the corpus asks for 1.9 GB or more, so one that got through would fail here, not swap.
HEADROOM = 1 << 30
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmSize from /proc")


def _child(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(TESTS.parent)}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)


def _runner(job: dict, path: Path) -> dict:
    path.write_text(json.dumps(job))
    done = _child([str(TESTS / "_hostile_runner.py"), str(path)])
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture
def benign(official, tmp_path):  # noqa: F811
    """An official network pickle and a U-ViT checkpoint, both well-formed."""
    edm2, uvit = tmp_path / "edm2-img16-t-0000512-0.100.pkl", tmp_path / "nnet_ema.pth"
    official.write(edm2)
    torch.save(official_state_dict(3), uvit)
    return {"edm2": str(edm2), "uvit": str(uvit), "uvit_heads": HEADS}


def test_every_hostile_file_is_refused_with_one_line_and_leaves_the_process_unchanged(benign, tmp_path):
    corpus = build_corpus(tmp_path / "corpus")
    hostile = {name: str(path) for name, (path, _) in corpus.items()}
    report = _runner(
        {**benign, "scratch": str(tmp_path / "out"), "headroom": HEADROOM, "hostile": hostile}, tmp_path / "job.json"
    )
    assert report["final"] == report["reference"]
    problems = []
    for name, (path, pattern) in corpus.items():
        result = report["results"][name]
        lines = result["stderr"].splitlines()
        command = "scalelong-convert-edm2" if path.suffix == ".pkl" else "scalelong-convert-uvit"
        checks = {
            "exit status 2": result["status"] == 2,
            "one line naming the command": len(lines) == 1 and lines[0].startswith(f"{command}: "),
            f"reason matching {pattern!r}": bool(lines) and re.search(pattern, lines[0]) is not None,
            "nothing written": not result["written"],
            "allow-listed objects unchanged": result["process_unchanged"],
            "the benign file converts exactly as in the fresh process": result["benign_unchanged"],
        }
        problems += [
            f"{name}: {check} failed ({result['status']!r}, {lines})" for check, ok in checks.items() if not ok
        ]
    assert not problems, "\n".join(problems)
    assert len(corpus) >= 70


def test_the_corpus_is_live_against_a_find_class_allow_list(tmp_path):
    """The same files through ``pickle.Unpickler`` with only ``find_class`` restricted (the design this reader
    replaces) change torch process-wide and allocate what the file asks for."""
    files = network_pickles()
    for name in ("build_on_rebuild_function_negates", "bytearray_size", "giant_memo_index"):
        (tmp_path / f"{name}.pkl").write_bytes(files[name][0])
    script = textwrap.dedent(
        f"""
        import io, pickle, resource, torch
        from torch._weights_only_unpickler import _get_allowed_globals
        allowed = _get_allowed_globals()
        mapped = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (mapped + {HEADROOM}, mapped + {HEADROOM}))

        class FindClassOnly(pickle.Unpickler):
            def find_class(self, module, name):
                return allowed[f"{{module}}.{{name}}"]

        def attempt(name):
            try:
                FindClassOnly(open(f"{tmp_path}/{{name}}.pkl", "rb")).load()
                return "loaded"
            except MemoryError:
                return "MemoryError"
            except Exception as error:
                return type(error).__name__

        weights = torch.arange(1.0, 5.0)
        before = pickle.loads(pickle.dumps(weights))
        print(attempt("build_on_rebuild_function_negates"))
        print(torch.equal(pickle.loads(pickle.dumps(weights)), -before))
        print(attempt("bytearray_size"), attempt("giant_memo_index"))
        """
    )
    done = _child(["-c", script])
    assert done.returncode == 0, done.stderr[-3000:]
    negated, flipped, bombs = done.stdout.splitlines()
    assert flipped == "True"  # every tensor unpickled afterwards in that process comes out negated
    # under the address-space limit, the 1.9 GB bytearray and the 2**32-entry memo table cannot be allocated
    assert bombs == "MemoryError MemoryError", bombs


def test_limits_are_enforced_on_a_benign_network(benign):
    data = load_restricted_pickle(benign["edm2"])
    assert data["ema"].class_name == "Precond"
    size = os.path.getsize(benign["edm2"])
    with pytest.raises(UnsafePickleError, match=f"more than {size // 2} bytes"):
        load_restricted_pickle(benign["edm2"], PickleLimits(max_bytes=size // 2))  # the storages alone are ~size
    with pytest.raises(UnsafePickleError, match="deeper than 8 levels"):
        load_restricted_pickle(benign["edm2"], PickleLimits(max_depth=8))
    with pytest.raises(UnsafePickleError, match="more than 1000 nodes"):
        load_restricted_pickle(benign["edm2"], PickleLimits(max_nodes=1000))


def test_checkpoint_reader_matches_torch_load_on_plain_state_dicts(tmp_path):
    shared = torch.randn(3, 4, dtype=torch.float16)
    state = OrderedDict(
        weight=torch.nn.Parameter(torch.randn(5, 3), requires_grad=False),
        channels_last=torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        transposed=torch.randn(4, 6).t(),
        half=shared,
        tied=shared,
        empty=torch.zeros(0, 3),
        steps=torch.tensor(7),
        bf16=torch.randn(4, dtype=torch.bfloat16),
    )
    path = tmp_path / "state.pth"
    torch.save(state, path)
    ours, theirs = load_torch_checkpoint(path), torch.load(path, weights_only=True)
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and ours[key].stride() == theirs[key].stride(), key
        torch.testing.assert_close(ours[key], theirs[key], atol=0, rtol=0)  # the same bytes
    assert ours["tied"].data_ptr() == ours["half"].data_ptr()  # a storage shared in the file is read once
    with pytest.raises(UnsafePickleError, match="does not cover exactly"):
        torch.save({"view": torch.arange(6.0)[1:4]}, path)
        load_torch_checkpoint(path)


@pytest.mark.slow  # a fresh process importing diffusers; the corpus test checks the same status in-process
def test_a_refusal_through_the_console_script_exits_2_with_one_line(tmp_path):
    path = tmp_path / "evil.pkl"
    path.write_bytes(network_pickles()["build_on_rebuild_function_negates"][0])
    script = Path(sys.executable).parent / "scalelong-convert-edm2"
    done = subprocess.run([script, str(path), "--output_dir", str(tmp_path / "out")], capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "scalelong-convert-edm2: refusing BUILD on torch._utils._rebuild_tensor_v2: this reader sets state only "
        "on an object it has just made"
    ]
    assert not (tmp_path / "out").exists()
