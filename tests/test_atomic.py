"""Atomic writes: the old file or the whole new one, never a partial file or a stray temporary."""

import os

import pytest

from diffusers_scalelong.atomic import atomic_path, atomic_write_text


def test_write_replaces_the_file_with_ordinary_permissions(tmp_path):
    target = tmp_path / "sub" / "config.json"
    atomic_write_text(target, "old")
    atomic_write_text(target, "new")
    assert target.read_text() == "new"
    umask = os.umask(0)
    os.umask(umask)
    assert target.stat().st_mode & 0o777 == 0o666 & ~umask  # like open(), not mkstemp's 0o600
    assert sorted(p.name for p in target.parent.iterdir()) == ["config.json"]


def test_error_mid_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "weights.bin"
    target.write_bytes(b"complete old file")
    with pytest.raises(RuntimeError, match="interrupted"):
        with atomic_path(target) as temporary:
            temporary.write_bytes(b"half of the new")
            raise RuntimeError("interrupted")
    assert target.read_bytes() == b"complete old file"
    assert [p.name for p in tmp_path.iterdir()] == ["weights.bin"]
