"""The local Hub fixture speaks the Hub protocol to the real ``huggingface_hub`` client and to diffusers."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from diffusers import UNet2DModel
from huggingface_hub import HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
from safetensors.torch import load_file

from tests._tiny_models import TINY_UNET


def _write_folder(folder):
    (folder / "nested").mkdir(parents=True)
    files = {
        "weights.bin": os.urandom(300_000),
        "config.json": b'{"answer": 42}\n',
        "nested/notes.txt": b"hello from a nested folder\n",
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return files


def test_upload_folder_then_download_gives_identical_bytes(local_hub, tmp_path):
    files = _write_folder(tmp_path / "src")
    api = HfApi(endpoint=local_hub.endpoint)
    api.create_repo("tester/roundtrip", exist_ok=True)
    commit = api.upload_folder(repo_id="tester/roundtrip", folder_path=tmp_path / "src", commit_message="add files")

    info = api.repo_info("tester/roundtrip", revision="main")
    assert info.sha == commit.oid
    assert sorted(api.list_repo_files("tester/roundtrip")) == sorted([".gitattributes", *files])

    snapshot = snapshot_download(
        "tester/roundtrip", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path / "c1"
    )
    for name, data in files.items():
        assert (tmp_path / "c1").exists()
        assert open(os.path.join(snapshot, name), "rb").read() == data
    single = hf_hub_download(
        "tester/roundtrip", "nested/notes.txt", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path / "c2"
    )
    assert open(single, "rb").read() == files["nested/notes.txt"]


def test_second_commit_updates_and_deletes(local_hub, tmp_path):
    _write_folder(tmp_path / "src")
    api = HfApi(endpoint=local_hub.endpoint)
    api.create_repo("tester/history")
    first = api.upload_folder(repo_id="tester/history", folder_path=tmp_path / "src")
    (tmp_path / "src" / "config.json").write_bytes(b'{"answer": 43}\n')
    (tmp_path / "src" / "nested" / "notes.txt").unlink()
    second = api.upload_folder(repo_id="tester/history", folder_path=tmp_path / "src", delete_patterns=["nested/*"])
    assert second.oid != first.oid
    assert "nested/notes.txt" not in api.list_repo_files("tester/history")
    old = hf_hub_download(
        "tester/history", "config.json", revision=first.oid, endpoint=local_hub.endpoint, cache_dir=tmp_path / "c"
    )
    new = hf_hub_download(
        "tester/history", "config.json", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path / "c"
    )
    assert open(old).read() == '{"answer": 42}\n' and open(new).read() == '{"answer": 43}\n'


def test_seed_repo_is_served_without_the_client(local_hub, tmp_path):
    files = _write_folder(tmp_path / "src")
    sha = local_hub.seed_repo("tester/seeded", tmp_path / "src")
    api = HfApi(endpoint=local_hub.endpoint)
    assert api.repo_info("tester/seeded", revision="main").sha == sha
    path = hf_hub_download(
        "tester/seeded", "weights.bin", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path / "c"
    )
    assert open(path, "rb").read() == files["weights.bin"]


def test_missing_repo_file_and_revision_raise_the_clients_errors(local_hub, tmp_path):
    local_hub.seed_repo("tester/errors", _folder_with(tmp_path / "src", {"a.txt": b"a"}))
    kwargs = {"endpoint": local_hub.endpoint, "cache_dir": tmp_path / "c"}
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("tester/no-such-repo", "a.txt", revision="main", **kwargs)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("tester/errors", "missing.txt", revision="main", **kwargs)
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("tester/errors", "a.txt", revision="no-such-branch", **kwargs)
    with pytest.raises(HfHubHTTPError) as conflict:
        HfApi(endpoint=local_hub.endpoint).create_repo("tester/errors")
    assert conflict.value.response.status_code == 409


def test_range_requests_answer_partial_content(local_hub, tmp_path):
    files = _write_folder(tmp_path / "src")
    local_hub.seed_repo("tester/ranges", tmp_path / "src")
    import httpx

    response = httpx.get(
        f"{local_hub.endpoint}/tester/ranges/resolve/main/weights.bin", headers={"Range": "bytes=100-199"}
    )
    assert response.status_code == 206
    assert response.content == files["weights.bin"][100:200]
    assert response.headers["content-range"] == f"bytes 100-199/{len(files['weights.bin'])}"


def _folder_with(folder, files):
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder


def test_diffusers_from_pretrained_by_repo_id_in_subprocess(local_hub, tmp_path):
    unet = UNet2DModel(**TINY_UNET)
    unet.save_pretrained(tmp_path / "unet")
    HfApi(endpoint=local_hub.endpoint).create_repo("tester/tiny-unet")
    HfApi(endpoint=local_hub.endpoint).upload_folder(repo_id="tester/tiny-unet", folder_path=tmp_path / "unet")

    script = textwrap.dedent(
        """
        import sys
        from diffusers import UNet2DModel
        from safetensors.torch import save_file
        model = UNet2DModel.from_pretrained("tester/tiny-unet", revision="main")
        save_file(model.state_dict(), sys.argv[1])
        """
    )
    out = tmp_path / "loaded.safetensors"
    env = local_hub.env(hub_cache=tmp_path / "cache")
    subprocess.run([sys.executable, "-c", script, str(out)], env=env, check=True, timeout=120)

    expected, loaded = unet.state_dict(), load_file(out)
    assert expected.keys() == loaded.keys()
    for key, value in expected.items():
        assert torch.equal(value, loaded[key]), key
    served = [
        (r["method"], r["path"].rsplit("/", 1)[-1], r["status"])
        for r in local_hub.requests()
        if "/tiny-unet/resolve/" in r["path"]
    ]
    assert ("GET", "diffusion_pytorch_model.safetensors", 200) in served


def test_commit_on_a_stale_parent_is_refused(local_hub, tmp_path):
    from huggingface_hub import CommitOperationAdd

    api = HfApi(endpoint=local_hub.endpoint)
    api.create_repo("tester/parent-check")
    base = api.repo_info("tester/parent-check", revision="main").sha
    api.create_commit("tester/parent-check", [CommitOperationAdd("a.txt", b"first")], commit_message="first")
    with pytest.raises(HfHubHTTPError) as stale:
        api.create_commit(
            "tester/parent-check", [CommitOperationAdd("a.txt", b"second")], commit_message="x", parent_commit=base
        )
    assert stale.value.response.status_code == 412
    path = hf_hub_download(
        "tester/parent-check", "a.txt", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path
    )
    assert open(path, "rb").read() == b"first"
