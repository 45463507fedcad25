"""Post-hoc EMA snapshots and reconstructions through a real Hub (the ``local_hub`` fixture) and the real client."""

import hashlib
import json
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from diffusers import UNet2DModel
from huggingface_hub import HfApi, ModelCard, hf_hub_download
from huggingface_hub.errors import RepositoryNotFoundError

from diffusers_scalelong.ema import PowerFunctionEMA, list_snapshots, reconstruct_ema, save_reconstructed_models
from diffusers_scalelong.ema import hub_transfer as hub
from tests._snapshot_runs import SIGMA_RELS, TIMES, random_walk_snapshots
from tests._tiny_models import TINY_UNET


def _tiny_unet() -> UNet2DModel:
    return UNet2DModel(**TINY_UNET)


@pytest.fixture(scope="module")
def snapshot_folder(tmp_path_factory):
    """8 snapshots (sigma_rel 0.05 and 0.10 at times 10..40) of a tiny UNet following a random-walk trajectory."""
    return random_walk_snapshots(_tiny_unet(), tmp_path_factory.mktemp("phema"), TIMES)


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _snapshot_gets(local_hub, repo_id) -> list[str]:
    """Names of snapshot files the server sent (GET on resolve) for ``repo_id``."""
    return [
        r["path"].rsplit("/", 1)[-1]
        for r in local_hub.requests()
        if r["method"] == "GET" and f"/{repo_id}/resolve/" in r["path"] and r["path"].endswith(".safetensors")
    ]


def test_pull_downloads_only_the_needed_snapshots_and_reconstructs_like_local(local_hub, snapshot_folder, tmp_path):
    repo_id = "tester/phema-pull"
    hub.push_snapshots(snapshot_folder, repo_id, endpoint=local_hub.endpoint)

    listed = hub.list_remote_snapshots(repo_id, endpoint=local_hub.endpoint, cache_dir=tmp_path / "cache")
    assert [(s.time, s.sigma_rel) for s in listed] == [(t, s) for t in TIMES for s in SIGMA_RELS]
    assert _snapshot_gets(local_hub, repo_id) == []  # listing reads the index, no snapshot file

    target_time = 20
    result = hub.reconstruct_from_hub(
        repo_id, [0.07, 0.12], target_time, endpoint=local_hub.endpoint, cache_dir=tmp_path / "cache"
    )
    fetched = sorted(_snapshot_gets(local_hub, repo_id))
    expected_files = sorted(p.name for p in snapshot_folder.iterdir() if int(p.name.split("-")[1]) <= target_time)
    assert fetched == expected_files and len(fetched) == 4

    reference = reconstruct_ema(snapshot_folder, [0.07, 0.12], target_time)
    for got, want in zip(result, reference, strict=True):
        assert got.keys() == want.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_pulled_files_are_byte_identical(local_hub, snapshot_folder, tmp_path):
    repo_id = "tester/phema-bytes"
    hub.push_snapshots(snapshot_folder, repo_id, endpoint=local_hub.endpoint)
    infos = hub.pull_snapshots(repo_id, endpoint=local_hub.endpoint, cache_dir=tmp_path / "cache")
    assert len(infos) == len(TIMES) * len(SIGMA_RELS)
    for info in infos:
        assert _sha256(info.path) == _sha256(snapshot_folder / info.path.name)


def test_incremental_push_keeps_the_earlier_snapshots_in_the_index(local_hub, snapshot_folder, tmp_path):
    repo_id = "tester/phema-incremental"
    early = tmp_path / "early"
    early.mkdir()
    for path in snapshot_folder.iterdir():
        if int(path.name.split("-")[1]) <= 20:
            (early / path.name).write_bytes(path.read_bytes())
    first = hub.push_snapshots(early, repo_id, endpoint=local_hub.endpoint)
    later = tmp_path / "later"
    later.mkdir()
    for path in snapshot_folder.iterdir():
        if int(path.name.split("-")[1]) > 20:
            (later / path.name).write_bytes(path.read_bytes())
    second = hub.push_snapshots(later, repo_id, endpoint=local_hub.endpoint)
    assert second.oid != first.oid

    index_path = hf_hub_download(
        repo_id, "phema/phema-index.json", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path / "c"
    )
    index = json.loads(open(index_path).read())
    assert sorted(entry["filename"] for entry in index["snapshots"]) == sorted(
        p.name for p in snapshot_folder.iterdir()
    )
    assert [
        s.time for s in hub.list_remote_snapshots(repo_id, endpoint=local_hub.endpoint, cache_dir=tmp_path / "c")
    ] == [t for t in TIMES for _ in SIGMA_RELS]


def test_snapshots_without_index_are_listed_from_their_headers_by_range_requests(local_hub, snapshot_folder, tmp_path):
    repo_id = "tester/phema-no-index"
    local_hub.seed_repo(repo_id, snapshot_folder)  # plain files under the repo root, no index
    listed = hub.list_remote_snapshots(repo_id, path_in_repo="", endpoint=local_hub.endpoint, cache_dir=tmp_path / "c")

    local = list_snapshots(snapshot_folder)
    assert [(s.filename, s.time, s.sigma_rel, s.gamma) for s in listed] == [
        (i.path.name, i.time, i.sigma_rel, i.gamma) for i in local
    ]
    reads = [r for r in local_hub.requests() if f"/{repo_id}/resolve/" in r["path"] and r["method"] == "GET"]
    assert len(reads) == len(local) and all(r["range"] and r["status"] == 206 for r in reads)


@pytest.mark.parametrize(
    "lie, match",
    [
        ({"sigma_rel": 0.07}, "named 'phema-0000000010-0.050.safetensors' but the index .* records time 10 and sigma_rel 0.07"),
        ({"content_sha256": "0" * 64}, "records content_sha256='[0-9a-f]{64}', but the index says content_sha256='0{64}'"),
        ({"filename": "phema-0000000099-0.050.safetensors", "time": 99}, "lists phema/phema-0000000099-0.050.safetensors, which the repository does not hold"),
    ],
    ids=["name", "checksum", "missing file"],
)  # fmt: skip
def test_index_that_contradicts_a_file_is_reported(local_hub, snapshot_folder, tmp_path, lie, match):
    repo_id = f"tester/phema-stale-index-{sorted(lie)[0]}"
    hub.push_snapshots(snapshot_folder, repo_id, endpoint=local_hub.endpoint)
    index_path = hf_hub_download(
        repo_id, "phema/phema-index.json", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path / "c"
    )
    index = json.loads(open(index_path).read())
    index["snapshots"][0].update(lie)  # the index now lies about the first file
    HfApi(endpoint=local_hub.endpoint).upload_file(
        path_or_fileobj=json.dumps(index).encode(), path_in_repo="phema/phema-index.json", repo_id=repo_id
    )
    with pytest.raises(ValueError, match=match):
        hub.pull_snapshots(repo_id, target_time=10, endpoint=local_hub.endpoint, cache_dir=tmp_path / "c2")


def test_push_refuses_to_mix_two_runs_and_damaged_files(local_hub, snapshot_folder, tmp_path):
    repo_id = "tester/phema-two-runs"
    hub.push_snapshots(snapshot_folder, repo_id, endpoint=local_hub.endpoint)
    unet = _tiny_unet()
    other = PowerFunctionEMA(unet, sigma_rels=(0.05,))  # another training run: its own run id
    other.update(unet, 50)
    other.save_snapshots(str(tmp_path / "other"))
    with pytest.raises(ValueError, match="would mix two training runs: .* and phema-0000000050-0.050.safetensors"):
        hub.push_snapshots(tmp_path / "other", repo_id, endpoint=local_hub.endpoint)

    (damaged,) = (tmp_path / "other").iterdir()
    data = bytearray(damaged.read_bytes())
    data[-3] ^= 0x01  # inside the tensor data, which ends the file
    damaged.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="phema-0000000050-0.050.safetensors is damaged"):
        hub.push_snapshots(tmp_path / "other", "tester/phema-damaged", endpoint=local_hub.endpoint)


def test_snapshot_set_model_card(local_hub, snapshot_folder, tmp_path):
    repo_id = "tester/phema-card"
    hub.push_snapshots(snapshot_folder, repo_id, endpoint=local_hub.endpoint)
    path = hf_hub_download(repo_id, "phema/README.md", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path)
    card = ModelCard.load(path)
    assert card.data.phema_sigma_rels == list(SIGMA_RELS)
    assert card.data.phema_times == [TIMES[0], TIMES[-1]]
    assert "post-hoc-ema" in card.data.tags
    for path in snapshot_folder.iterdir():
        assert f"`{path.name}`" in card.text
    assert f'reconstruct_from_hub("{repo_id}"' in card.text


def test_reconstructed_model_is_pushed_with_a_card_recording_sigma_rel(local_hub, snapshot_folder, tmp_path):
    source = "tester/phema-for-model"
    hub.push_snapshots(snapshot_folder, source, endpoint=local_hub.endpoint)
    [folder] = hub.reconstruct_from_hub(
        source, [0.075], output_dir=tmp_path / "out", endpoint=local_hub.endpoint, cache_dir=tmp_path / "cache"
    )
    [local] = save_reconstructed_models(snapshot_folder, tmp_path / "local", [0.075])
    weights_file = "diffusion_pytorch_model.safetensors"
    assert _sha256(folder / weights_file) == _sha256(local / weights_file)
    repo_id = "tester/unet-ema-0.075"
    hub.push_reconstruction(folder, repo_id, source_repo=source, endpoint=local_hub.endpoint)

    card_path = hf_hub_download(repo_id, "README.md", revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path)
    card = ModelCard.load(card_path)
    record = json.loads((folder / "phema.json").read_text())
    assert card.data.ema_sigma_rel == 0.075
    gamma = card.data.ema_gamma  # sigma_rel of the power profile with this exponent (EDM2, section 3)
    # the card rounds gamma to 6 decimals (~1e-7 relative at gamma ~ 10), which moves sigma_rel far less than 1e-5
    assert ((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3))) ** 0.5 == pytest.approx(0.075, rel=1e-5)
    assert gamma == pytest.approx(record["gamma"], rel=1e-6)  # as rounded on the card
    assert card.data.ema_time == TIMES[-1] and card.data.ema_num_snapshots == len(record["snapshots"])
    assert card.data.library_name == "diffusers" and card.data.ema_source == source
    assert "sigma_rel = 0.075" in card.text and f'UNet2DModel.from_pretrained("{repo_id}")' in card.text

    weights = hf_hub_download(repo_id, weights_file, revision="main", endpoint=local_hub.endpoint, cache_dir=tmp_path)
    assert _sha256(weights) == _sha256(folder / weights_file)


def test_push_reconstruction_needs_a_model_folder_and_a_known_sigma_rel(local_hub, tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        hub.push_reconstruction(tmp_path, "tester/never", sigma_rel=0.1, endpoint=local_hub.endpoint)
    _tiny_unet().save_pretrained(tmp_path / "unet")
    with pytest.raises(ValueError, match="pass sigma_rel"):
        hub.push_reconstruction(tmp_path / "unet", "tester/never", endpoint=local_hub.endpoint)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=local_hub.endpoint).repo_info("tester/never")


def test_clear_errors(local_hub, snapshot_folder, tmp_path):
    kwargs = {"endpoint": local_hub.endpoint, "cache_dir": tmp_path / "c"}
    with pytest.raises(RepositoryNotFoundError):
        hub.pull_snapshots("tester/no-such-repo", **kwargs)

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    local_hub.seed_repo("tester/not-phema", tmp_path / "model")
    with pytest.raises(ValueError, match="has no post-hoc EMA snapshots"):
        hub.pull_snapshots("tester/not-phema", **kwargs)

    with pytest.raises(ValueError, match="no snapshot files"):
        hub.push_snapshots(tmp_path / "model", "tester/empty-push", endpoint=local_hub.endpoint)
    with pytest.raises(RepositoryNotFoundError):  # nothing was created
        HfApi(endpoint=local_hub.endpoint).repo_info("tester/empty-push")

    hub.push_snapshots(snapshot_folder, "tester/phema-errors", endpoint=local_hub.endpoint)
    with pytest.raises(ValueError, match="later than the newest snapshot"):
        hub.pull_snapshots("tester/phema-errors", target_time=50, **kwargs)
    with pytest.raises(ValueError, match="no snapshot at target_time=25"):
        hub.pull_snapshots("tester/phema-errors", target_time=25, **kwargs)
    assert _snapshot_gets(local_hub, "tester/phema-errors") == []  # bad targets fail before any download


def test_dropped_connection_resumes_from_the_received_bytes(local_hub, tmp_path):
    """The server cuts a snapshot download; the client asks for the rest with a Range request and completes it.

    huggingface_hub hands data over in 10 MiB chunks, so the snapshot is 12 MiB and the cut comes after 11 MB.
    """
    big = torch.nn.Linear(1024, 3 * 1024, bias=False)  # 12 MiB of float32 weights
    ema = PowerFunctionEMA(big, sigma_rels=(0.10,))
    ema.update(big, 1)
    [snapshot] = ema.save_snapshots(str(tmp_path / "snapshots"))
    repo_id = "tester/phema-dropped"
    hub.push_snapshots(tmp_path / "snapshots", repo_id, endpoint=local_hub.endpoint)

    local_hub.drop_next_download(after_bytes=11_000_000)
    [info] = hub.pull_snapshots(repo_id, endpoint=local_hub.endpoint, cache_dir=tmp_path / "cache")
    assert _sha256(info.path) == _sha256(snapshot)
    gets = [
        (r["status"], r["range"], r["complete"])
        for r in local_hub.requests()
        if r["method"] == "GET" and r["path"].endswith(f"phema/{info.path.name}")
    ]
    assert gets == [(200, None, False), (206, "bytes=10485760-", True)]  # cut mid-body, then only the rest


def test_interrupted_pull_downloads_only_the_missing_snapshots(local_hub, snapshot_folder, tmp_path):
    """Kill a pull part-way (slowed-down server); pulling again fetches only the snapshots not yet complete."""
    repo_id = "tester/phema-killed"
    hub.push_snapshots(snapshot_folder, repo_id, endpoint=local_hub.endpoint)
    cache = tmp_path / "cache"
    download = textwrap.dedent(
        f"""
        from huggingface_hub import snapshot_download
        snapshot_download({repo_id!r}, allow_patterns=["phema/*.safetensors"], cache_dir={str(cache)!r}, max_workers=1)
        """
    )
    file_size = max(path.stat().st_size for path in snapshot_folder.iterdir())
    local_hub.throttle(4 * file_size)  # about 4 files per second
    try:
        process = subprocess.Popen([sys.executable, "-c", download], env=local_hub.env())
        _wait_for_complete_blobs(cache, count=2, timeout=60)
        process.kill()
        process.wait()
    finally:
        local_hub.throttle(None)
    blobs = {p.name for p in cache.glob("models--*/blobs/*")}
    completed = {p.name for p in snapshot_folder.iterdir() if _git_blob_sha1(p) in blobs}
    assert 2 <= len(completed) < len(TIMES) * len(SIGMA_RELS)
    requests_before = len(_snapshot_gets(local_hub, repo_id))

    infos = hub.pull_snapshots(repo_id, endpoint=local_hub.endpoint, cache_dir=cache)
    for info in infos:
        assert _sha256(info.path) == _sha256(snapshot_folder / info.path.name)
    fetched_again = _snapshot_gets(local_hub, repo_id)[requests_before:]
    assert sorted(fetched_again) == sorted({p.name for p in snapshot_folder.iterdir()} - completed)


def _git_blob_sha1(path) -> str:
    """The git object id of a file's content, which the Hub sends as the ETag of a regular (non-LFS) file."""
    data = open(path, "rb").read()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _wait_for_complete_blobs(cache, count, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len([p for p in cache.glob("models--*/blobs/*") if not p.name.endswith(".incomplete")]) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"{count} downloads did not complete in {cache} within {timeout} s")
