"""Snapshot files: naming, header metadata, storage dtypes, atomic writes, header-only listing, exact resume."""

import json
import os
import struct
import types

import pytest
import torch
from _ema_utils import TinyTraining
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import diffusers_scalelong
from diffusers_scalelong import integrity as integrity_module
from diffusers_scalelong.ema import PowerFunctionEMA, list_snapshots, parse_snapshot_filename, sigma_rel_to_gamma


def test_snapshot_names_metadata_and_tensors(tmp_path):
    run = TinyTraining((0.05, 0.10), snapshot_dir=tmp_path, snapshot_every=10)
    run.run(1, 20)
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "phema-0000000010-0.050.safetensors",
        "phema-0000000010-0.100.safetensors",
        "phema-0000000020-0.050.safetensors",
        "phema-0000000020-0.100.safetensors",
    ]
    assert parse_snapshot_filename(names[1]) == (10, 0.1)
    assert parse_snapshot_filename(".phema-0000000010-0.100.safetensors.x1.tmp") is None
    infos = list_snapshots(tmp_path)
    assert [(i.time, i.sigma_rel) for i in infos] == [(10, 0.05), (10, 0.10), (20, 0.05), (20, 0.10)]
    info = infos[-1]
    assert info.gamma == sigma_rel_to_gamma(0.10)
    assert info.time_unit == "steps" and info.dtype == "float32"
    assert info.library_version == diffusers_scalelong.__version__
    assert info.model_class == "diffusers.models.unets.unet_2d.UNet2DModel"
    assert info.model_config["block_out_channels"] == [8, 16]
    assert info.model_config["_class_name"] == "UNet2DModel"
    # the metadata is plain JSON in the safetensors header, readable by any safetensors reader
    with safe_open(str(info.path), framework="pt") as f:
        raw = json.loads(f.metadata()["phema"])
    assert raw["time"] == 20 and raw["sigma_rel"] == 0.10
    stored = load_file(info.path)
    expected = run.ema.averaged_state_dict(0.10)
    assert stored.keys() == run.model.state_dict().keys()
    for k, v in expected.items():
        assert torch.equal(stored[k], v)
    assert info.shapes == {k: tuple(v.shape) for k, v in stored.items()}


@pytest.mark.parametrize("dtype,name", [(torch.float16, "fp16"), (torch.bfloat16, "bfloat16"), (torch.float32, None)])
def test_storage_dtype_keeps_buffers(tmp_path, dtype, name):
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model(torch.randn(5, 3))
    ema = PowerFunctionEMA(model, sigma_rels=(0.1,))
    ema.update(model, 7)
    (path,) = ema.save_snapshots(tmp_path, 7, dtype=name)
    stored = load_file(path)
    assert stored["0.weight"].dtype == dtype
    assert torch.equal(stored["0.weight"], ema.averages[0]["0.weight"].to(dtype))
    assert stored["1.running_mean"].dtype == torch.float32
    assert stored["1.num_batches_tracked"].dtype == torch.int64
    assert list_snapshots(tmp_path)[0].dtype == str(dtype).removeprefix("torch.")


def test_save_snapshots_bad_calls_write_nothing(tmp_path):
    model = nn.Linear(2, 2)
    ema = PowerFunctionEMA(model)
    with pytest.raises(ValueError, match="no update"):
        ema.save_snapshots(tmp_path / "a")
    ema.update(model, 5)
    with pytest.raises(ValueError, match="step=6"):
        ema.save_snapshots(tmp_path / "a", 6)
    with pytest.raises(ValueError, match="dtype"):
        ema.save_snapshots(tmp_path / "a", 5, dtype="int8")
    assert not (tmp_path / "a").exists()
    # only the main process writes
    assert ema.save_snapshots(tmp_path / "b", 5, is_main_process=False) == []
    assert ema.save_snapshots(tmp_path / "b", 5, accelerator=types.SimpleNamespace(is_main_process=False)) == []
    assert not (tmp_path / "b").exists()


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    model = nn.Linear(2, 2)
    ema = PowerFunctionEMA(model, sigma_rels=(0.1,))
    ema.update(model, 1)
    ema.save_snapshots(tmp_path, 1)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def dying_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 10)  # a few bytes, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(integrity_module, "save_file", dying_save_file)
    ema.update(model, 2)
    with pytest.raises(KeyboardInterrupt):
        ema.save_snapshots(tmp_path, 2)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def _vm_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def test_listing_reads_headers_only(tmp_path):
    """A snapshot with a 2 GiB tensor (sparse file) is listed without the process touching its data."""
    model = nn.Linear(2, 2)
    ema = PowerFunctionEMA(model, sigma_rels=(0.1,))
    ema.update(model, 3)
    (path,) = ema.save_snapshots(tmp_path, 3)
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    huge = 2**29  # float32 elements = 2 GiB
    header["huge"] = {"dtype": "F32", "shape": [huge], "data_offsets": [len(data), len(data) + 4 * huge]}
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:  # the safetensors layout: u64 header size, JSON header, data
        f.write(struct.pack("<Q", len(encoded)) + encoded + data)
        f.truncate(8 + len(encoded) + len(data) + 4 * huge)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS counter
    except OSError:
        pytest.fail("cannot reset the peak RSS counter")
    rss_before = _vm_kib("VmRSS")
    (info,) = list_snapshots(tmp_path)
    peak_growth_mib = (_vm_kib("VmHWM") - rss_before) / 1024
    assert info.shapes["huge"] == (huge,) and info.time == 3
    assert peak_growth_mib < 100, peak_growth_mib


def test_resume_gives_identical_snapshots(tmp_path):
    """Train 40 steps straight, and 20 + checkpoint + resume + 20: the snapshot files are byte-identical."""
    straight = TinyTraining((0.05, 0.10), snapshot_dir=tmp_path / "straight", snapshot_every=10)
    straight.run(1, 40)

    first = TinyTraining((0.05, 0.10), snapshot_dir=tmp_path / "resumed", snapshot_every=10)
    first.ema.run_id = straight.ema.run_id  # one run, written twice: the run id is part of the bytes
    first.run(1, 20)
    torch.save({"model": first.model.state_dict(), "optimizer": first.optimizer.state_dict()}, tmp_path / "ckpt.pt")
    first.ema.save_state(tmp_path / "ckpt" / "phema_state.safetensors")
    del first

    second = TinyTraining((0.05, 0.10), snapshot_dir=tmp_path / "resumed", snapshot_every=10)
    checkpoint = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    second.model.load_state_dict(checkpoint["model"])
    second.optimizer.load_state_dict(checkpoint["optimizer"])
    second.ema.load_state(tmp_path / "ckpt" / "phema_state.safetensors")
    assert second.ema.last_step == 20
    second.run(21, 40)

    names = sorted(os.listdir(tmp_path / "straight"))
    assert len(names) == 8 and names == sorted(os.listdir(tmp_path / "resumed"))
    for name in names:
        assert (tmp_path / "straight" / name).read_bytes() == (tmp_path / "resumed" / name).read_bytes(), name


def test_load_state_rejects_bad_files(tmp_path):
    ema = PowerFunctionEMA(nn.Linear(2, 2))
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="bad.safetensors"):
        ema.load_state(tmp_path / "bad.safetensors")
