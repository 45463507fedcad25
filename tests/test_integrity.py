"""Content checksums and finiteness checks (``diffusers_scalelong.integrity``) on real files."""

import hashlib
import json

import pytest
import torch

from diffusers_scalelong.ema import PowerFunctionEMA
from diffusers_scalelong.integrity import (
    IntegrityError,
    check_finite,
    file_sha256,
    folder_manifest,
    load_verified,
    save_safetensors,
    tensors_sha256,
    verify_manifest,
)


def _tensors():
    generator = torch.Generator().manual_seed(0)
    return {
        "weight": torch.randn(3, 4, generator=generator),
        "half": torch.randn(5, generator=generator).half(),
        "brain": torch.randn(2, 2, generator=generator).bfloat16(),
        "count": torch.tensor(7),
        "steps": torch.arange(6).reshape(2, 3)[:, 1:],  # not contiguous: hashed as stored (contiguous)
    }


def test_tensor_checksum_matches_an_independent_computation():
    tensors = _tensors()
    lines = []
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        raw = (tensor.view(torch.int16) if tensor.dtype == torch.bfloat16 else tensor).numpy().tobytes()
        dtype = str(tensor.dtype).removeprefix("torch.")
        lines.append(f"{name} {dtype} {list(tensor.shape)} {hashlib.sha256(raw).hexdigest()}\n")
    assert tensors_sha256(tensors) == hashlib.sha256("".join(lines).encode()).hexdigest()
    assert tensors_sha256(dict(reversed(tensors.items()))) == tensors_sha256(tensors)  # order-free


def test_a_flipped_byte_is_named_with_both_checksums(tmp_path):
    path = tmp_path / "state.safetensors"
    tensors = {name: tensor.contiguous() for name, tensor in _tensors().items()}  # what safetensors stores
    save_safetensors(tensors, path, "record", {"kind": "test"})
    loaded, record = load_verified(path, "record")
    assert record["kind"] == "test" and record["content_sha256"] == tensors_sha256(_tensors())
    assert all(torch.equal(loaded[name], tensors[name]) for name in tensors)
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x04  # the last bytes of a safetensors file are tensor data
    path.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=f"{path} is damaged: .* sha256 [0-9a-f]{{64}}, but the file records"):
        load_verified(path, "record")


def test_a_damaged_tracker_state_is_refused(tmp_path):
    model = torch.nn.Linear(3, 3)
    ema = PowerFunctionEMA(model, sigma_rels=(0.1,))
    ema.update(model, 1)
    ema.save_state(tmp_path / "ema.safetensors")
    data = bytearray((tmp_path / "ema.safetensors").read_bytes())
    data[-5] ^= 0x01
    (tmp_path / "ema.safetensors").write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match="ema.safetensors is damaged"):
        PowerFunctionEMA(model, sigma_rels=(0.1,)).load_state(tmp_path / "ema.safetensors")


def test_folder_manifest_names_missing_unrecorded_and_changed_files(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "sub" / "b.json").write_text(json.dumps({"x": 1}))
    (tmp_path / "record.json").write_text("{}")
    manifest = folder_manifest(tmp_path, exclude=("record.json",))
    assert manifest == {
        "a.bin": hashlib.sha256(b"abc").hexdigest(),
        "sub/b.json": hashlib.sha256(b'{"x": 1}').hexdigest(),
    }
    verify_manifest(tmp_path, manifest, exclude=("record.json",))
    (tmp_path / "a.bin").write_bytes(b"abd")
    with pytest.raises(IntegrityError, match=f"a.bin is damaged: its sha256 is {file_sha256(tmp_path / 'a.bin')}"):
        verify_manifest(tmp_path, manifest, exclude=("record.json",))
    (tmp_path / "a.bin").unlink()
    with pytest.raises(IntegrityError, match="a.bin is missing"):
        verify_manifest(tmp_path, manifest, exclude=("record.json",))
    (tmp_path / "a.bin").write_bytes(b"abc")
    (tmp_path / "extra.txt").write_text("")
    with pytest.raises(IntegrityError, match="extra.txt is not in the folder's recorded file list"):
        verify_manifest(tmp_path, manifest, exclude=("record.json",))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_check_finite_finds_every_non_finite_value(bad):
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        tensor = torch.zeros(100, dtype=dtype)
        tensor[37] = bad
        with pytest.raises(ValueError, match="tensor 'w' holds 1 NaN or infinite values"):
            check_finite({"ok": torch.ones(3), "w": tensor}, "test")


def test_check_finite_accepts_large_finite_values_and_integers():
    largest = torch.finfo(torch.float32).max
    check_finite({"w": torch.full((4,), largest), "n": torch.tensor([2**62])}, "test")  # the float32 sum overflows
