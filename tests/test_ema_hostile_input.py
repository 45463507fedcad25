"""Hostile or mistaken input to post-hoc EMA: edited snapshot headers, symbolic links out of a folder, colliding
profile names, unreachable or absurd targets. Each is refused in one line before anything is built, read from
outside the named folder, uploaded or written; the CLI exits 2 with that line."""

import json
import math
import resource
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from _forked import run_forked
from diffusers import UNet2DModel
from huggingface_hub import HfApi
from huggingface_hub.errors import RepositoryNotFoundError
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from diffusers_scalelong.ema import (
    MAX_PROFILE_ERROR,
    MAX_TARGETS,
    MIN_SIGMA_REL,
    InexactReconstructionWarning,
    PowerFunctionEMA,
    fit_error,
    list_snapshots,
    plan_reconstruction,
    reachable_sigma_rel_range,
    reconstruct_ema,
    save_reconstructed_models,
    sigma_rel_to_gamma,
    snapshot_filename,
)
from diffusers_scalelong.ema import hub_transfer as hub
from diffusers_scalelong.ema.cli import main as cli_main
from diffusers_scalelong.ema.plot import profile_values
from diffusers_scalelong.ema.snapshots import header_sha256
from diffusers_scalelong.integrity import IntegrityError
from tests._snapshot_runs import random_walk_snapshots
from tests._tiny_models import TINY_EDM2_UNET, TINY_UNET

# The tiny UNet's config blown up: 0.66 G parameters (2.6 GB in float32) from 1 MB of snapshots.
HUGE_CONFIG = {"block_out_channels": [1024, 2048], "norm_num_groups": 32}


def _train(model: nn.Module, folder: Path, times: range) -> Path:
    """Snapshots of both profiles of ``model`` following a random walk, at every time in ``times``."""
    return random_walk_snapshots(model, folder, times, step_size=0.01, seed=0)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A plain two-layer module's snapshots at 10 times (10..100): sigma_rel 0.01 lies 48% off (the issue's probe)."""
    return _train(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), tmp_path_factory.mktemp("plain"), range(10, 101, 10))


@pytest.fixture(scope="module")
def unet(tmp_path_factory) -> Path:
    """A tiny diffusers UNet's snapshots at times 10, 20, 30 (a header that records its class and config)."""
    torch.manual_seed(0)
    return _train(UNet2DModel(**TINY_UNET), tmp_path_factory.mktemp("unet"), range(10, 31, 10))


def _copy(folder: Path, tmp_path: Path, name: str = "snapshots") -> Path:
    return Path(shutil.copytree(folder, tmp_path / name))


def _edit_header(path: Path, edit, rehash: bool = True) -> None:
    """Rewrite a snapshot's header with ``edit(meta)`` applied, its tensors (and their checksum) unchanged;
    ``rehash``: also recompute ``header_sha256``, as a deliberate editor would."""
    with safe_open(str(path), framework="pt") as handle:
        meta = json.loads(handle.metadata()["phema"])
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    edit(meta)
    if rehash and "header_sha256" in meta:
        meta["header_sha256"] = header_sha256(meta)
    save_file(tensors, str(path), metadata={"phema": json.dumps(meta)})


def _one_line_cli_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith("scalelong-reconstruct-ema: error: ")
    return line


def _grown_mb(work) -> tuple[str, float]:
    """Run ``work()`` in a forked child; return the error it raised (one line) and how far its peak resident
    memory grew above the child's resident memory at the start, in MB (``getrusage``; Linux counts KB)."""

    def child() -> int:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
            work()
            message = "no error"
        except ValueError as error:
            message = str(error)
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        print(json.dumps({"error": message, "grown_mb": grown}))
        return 0

    status, output = run_forked(child)
    assert status == 0, output
    result = json.loads(output.strip().splitlines()[-1])
    return result["error"], result["grown_mb"]


# ------------------------------------------------------------------------------- a header's config vs its tensors
def _huge_config_bytes() -> int:
    with torch.device("meta"):
        model = UNet2DModel(**{**TINY_UNET, **HUGE_CONFIG})
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _blow_up(folder: Path) -> None:
    for path in folder.glob("phema-*.safetensors"):
        _edit_header(path, lambda meta: meta["model_config"].update(HUGE_CONFIG))


def test_a_header_whose_config_outgrows_its_tensors_is_refused_before_a_model_is_built(unet, tmp_path):
    folder = _copy(unet, tmp_path)
    _blow_up(folder)
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 1_500_000 and _huge_config_bytes() > 2e9  # what a real model of the header takes: > 2 GB
    error, grown = _grown_mb(lambda: save_reconstructed_models(folder, tmp_path / "out", [0.07]))
    assert "its model_config builds a UNet2DModel whose tensors differ from the file's" in error
    assert "\n" not in error and str(folder) in error
    # the meta build and the header reads: < 1 MB measured; a real model of this config is 2600 MB
    assert grown < 150, grown
    assert not (tmp_path / "out").exists()


def test_a_config_that_registers_endless_modules_is_stopped_early(unet, tmp_path):
    folder = _copy(unet, tmp_path)
    for path in folder.glob("phema-*.safetensors"):
        _edit_header(path, lambda meta: meta["model_config"].update(layers_per_block=10**6))
    with pytest.raises(ValueError, match="does not build a UNet2DModel: it registers more than"):
        list_snapshots(folder)


def test_a_hostile_header_pulled_from_the_hub_is_refused_before_a_model_is_built(local_hub, unet, tmp_path):
    folder = _copy(unet, tmp_path)
    _blow_up(folder)
    local_hub.seed_repo("tester/phema-hostile", folder)  # the files as they are, no index: headers read remotely

    def pull_and_reconstruct():
        hub.reconstruct_from_hub(
            "tester/phema-hostile",
            [0.07],
            path_in_repo="",
            output_dir=tmp_path / "out",
            endpoint=local_hub.endpoint,
            cache_dir=tmp_path / "cache",
        )

    error, grown = _grown_mb(pull_and_reconstruct)
    assert "whose tensors differ from the file's" in error and "\n" not in error
    assert grown < 150, grown  # as above: a real model of this config is 2600 MB
    assert not (tmp_path / "out").exists()


def _family(name: str) -> nn.Module:
    from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel, UViT2DModel

    torch.manual_seed(0)
    return {
        "scalelong-ls": lambda: ScaleLongUNet2DModel(**TINY_UNET, lsc_method="ls"),
        "edm2": lambda: EDM2UNet2DModel(**TINY_EDM2_UNET),
        "uvit-ls": lambda: UViT2DModel(
            sample_size=8, patch_size=2, in_channels=1, embed_dim=16, depth=2, num_heads=2, lsc_method="ls"
        ),
    }[name]()


@pytest.mark.parametrize("family", ["scalelong-ls", "edm2", "uvit-ls"])
def test_every_model_family_passes_the_header_check_and_loads(tmp_path, family):
    """The meta-device check accepts the snapshots of each network the package trains (gates, buffers included)."""
    model = _family(family)
    keys = model.state_dict(keep_vars=True)
    assert (
        any("lsc.gates" in key for key in keys)
        if family.endswith("-ls")
        else len(keys) > len(dict(model.named_parameters()))
    )
    folder = _train(model, tmp_path / "snapshots", range(10, 31, 10))
    (written,) = save_reconstructed_models(folder, tmp_path / "out", [0.07])
    loaded = type(model).from_pretrained(written)
    assert loaded.state_dict().keys() == model.state_dict().keys()


def test_tensors_added_after_construction_reconstruct_but_do_not_build_a_model(tmp_path):
    """LS gates added to a plain diffusers UNet (apply_lsc) are in the snapshots but not in the class's config: the
    state_dicts are reconstructed, and writing model folders says why it cannot build the model."""
    from diffusers_scalelong import apply_lsc

    torch.manual_seed(0)
    folder = _train(apply_lsc(UNet2DModel(**TINY_UNET), "ls"), tmp_path / "snapshots", range(10, 31, 10))
    (state,) = reconstruct_ema(folder, [0.07])
    assert any(key.startswith("lsc.gates.") for key in state)
    with pytest.raises(ValueError, match=r"tensors that a UNet2DModel built from their config lacks \(e.g. 'lsc"):
        save_reconstructed_models(folder, tmp_path / "out", [0.07])
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------- gamma and copied_keys edits
def test_an_edited_gamma_is_refused_with_or_without_a_recomputed_header_checksum(unet, tmp_path):
    folder = _copy(unet, tmp_path)
    victim = folder / "phema-0000000020-0.050.safetensors"
    original = victim.read_bytes()

    def shift(meta):
        meta["gamma"] *= 1.05

    _edit_header(victim, shift, rehash=False)
    with pytest.raises(IntegrityError, match="header metadata was changed after it was written"):
        list_snapshots(folder)
    victim.write_bytes(original)
    _edit_header(victim, shift, rehash=True)  # a consistent-looking header: gamma is recomputed from sigma_rel
    with pytest.raises(ValueError, match=r"records gamma=.*but the profile of sigma_rel=0.05 has gamma="):
        reconstruct_ema(folder, [0.07])


@pytest.mark.parametrize("keys", ["all", "one parameter"])
def test_edited_copied_keys_are_refused_against_the_model(unet, tmp_path, keys):
    """The edit that made every target the newest snapshot, un-averaged: refused even with a recomputed checksum."""
    folder = _copy(unet, tmp_path)
    victim = folder / "phema-0000000030-0.100.safetensors"

    def edit(meta):
        with safe_open(str(victim), framework="pt") as handle:
            names = list(handle.keys())
        meta["copied_keys"] = names if keys == "all" else ["conv_in.weight"]

    _edit_header(victim, edit, rehash=True)
    match = "nothing would be averaged" if keys == "all" else "copied_keys do not match the buffers of UNet2DModel"
    with pytest.raises(ValueError, match=match):
        save_reconstructed_models(folder, tmp_path / "out", [0.07])
    assert not (tmp_path / "out").exists()


def test_copied_keys_of_a_plain_module_are_covered_by_the_header_checksum(plain, tmp_path):
    folder = _copy(plain, tmp_path)
    victim = folder / "phema-0000000100-0.100.safetensors"
    _edit_header(victim, lambda meta: meta.update(copied_keys=["1.weight"]), rehash=False)
    with pytest.raises(IntegrityError, match="header metadata was changed"):
        reconstruct_ema(folder, [0.07])


def test_files_written_before_the_header_checksum_still_read_alike(unet, tmp_path):
    folder = _copy(unet, tmp_path)
    for path in folder.iterdir():
        _edit_header(path, lambda meta: meta.pop("header_sha256"), rehash=False)
    old, new = reconstruct_ema(folder, [0.07])[0], reconstruct_ema(unet, [0.07])[0]
    assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in new)
    _edit_header(folder / "phema-0000000010-0.100.safetensors", lambda meta: meta.update(gamma=1.0), rehash=False)
    with pytest.raises(ValueError, match="records gamma=1.0"):  # the recomputed gamma guards old files too
        list_snapshots(folder)


# ------------------------------------------------------------------------------------------ unreachable targets
def test_an_unreachable_target_is_refused_naming_the_reachable_range(plain, tmp_path):
    low, high = reachable_sigma_rel_range(plain)
    # the range's ends sit where the fit error crosses the threshold: just inside it, within; just outside, not
    # (the ends are found to ~0.05% of sigma_rel, so 0.5% steps are on either side)
    inside, outside = fit_error(plain, [low * 1.005, high / 1.005]), fit_error(plain, [low / 1.005, high * 1.005])
    assert np.all(inside <= MAX_PROFILE_ERROR) and np.all(outside > MAX_PROFILE_ERROR)
    assert low < 0.05 and 0.10 < high  # the tracked profiles lie inside
    with pytest.raises(ValueError) as info:
        save_reconstructed_models(plain, tmp_path / "out", [0.07, 0.01])
    message = str(info.value)
    assert "\n" not in message and "allow_inexact" in message
    assert "target sigma_rel=0.01 cannot be reconstructed" in message and "off by 48.1%" in message
    assert f"sigma_rel {low:.4g} to {high:.4g}" in message
    assert not (tmp_path / "out").exists()


def test_allow_inexact_reconstructs_with_a_warning_and_records_the_error(plain, tmp_path):
    with pytest.warns(InexactReconstructionWarning, match="off by 48.1%"):
        (folder,) = save_reconstructed_models(plain, tmp_path / "out", [0.01], allow_inexact=True)
    recorded = json.loads((folder / "phema.json").read_text())["relative_profile_error"]
    # the recorded error against an independent numerical integral of (combined profile - target profile)^2
    with pytest.warns(InexactReconstructionWarning):
        plan = plan_reconstruction(plain, [0.01], allow_inexact=True)
    tau = np.linspace(0, plan.target_time, 400_001)
    mix = sum(
        x * profile_values(tau, s.time, s.gamma) for x, s in zip(plan.coefficients[:, 0], plan.snapshots, strict=True)
    )
    target = profile_values(tau, plan.target_time, sigma_rel_to_gamma(0.01))
    measured = math.sqrt(np.trapezoid((mix - target) ** 2, tau) / np.trapezoid(target**2, tau))
    # trapezoid rule on 4e5 intervals of profiles that jump at the snapshot times: first-order, ~1e-5 relative
    assert recorded == pytest.approx(measured, rel=1e-3) and recorded > 0.4


def test_fit_error_answers_from_remote_index_entries(plain):
    """A tool can place the slider's ends before downloading: the same answer from the Hub index's entries."""
    remote = [hub._entry_from_info(info) for info in list_snapshots(plain)]
    assert np.array_equal(fit_error(remote, [0.01, 0.07], 50), fit_error(plain, [0.01, 0.07], 50))
    assert reachable_sigma_rel_range(remote, 50) == reachable_sigma_rel_range(plain, 50)


def test_cli_refuses_an_unreachable_target_or_warns_with_allow_inexact(plain, tmp_path, capsys):
    output = tmp_path / "out"
    line = _one_line_cli_error(capsys, [str(plain), "--sigma_rel", "0.01", "--output_dir", str(output)])
    assert "off by 48.1%" in line and "--allow_inexact" in line
    assert not output.exists()
    args = [str(plain), "--sigma_rel", "0.01", "--output_dir", str(output), "--allow_inexact"]
    assert cli_main(args) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("scalelong-reconstruct-ema: WARNING: reconstructed anyway (allow_inexact)")
    assert (output / "phema-0000000100-0.010" / "model.safetensors").is_file()


# --------------------------------------------------------------------------------- where sigma_rel values enter
@pytest.mark.parametrize("value", [1e-300, 0.0, -0.1, float("nan"), float("inf"), 0.3])
def test_absurd_sigma_rels_are_one_line_errors(plain, value):
    finite = math.isfinite(value)
    expected = r"sigma_rel must satisfy 0.0001 <= sigma_rel < sqrt\(1/12\)" if finite else "must be a finite number"
    with pytest.raises(ValueError, match=expected):
        reconstruct_ema(plain, [value])
    with pytest.raises(ValueError, match=r"sigma_rels\[1\]" + (": " if finite else " ") + expected):
        PowerFunctionEMA(nn.Linear(2, 1), sigma_rels=(0.05, value))
    assert sigma_rel_to_gamma(MIN_SIGMA_REL) == pytest.approx(1e4, rel=1e-3)  # the narrowest: gamma ~ 1/sigma_rel


def test_thousands_of_targets_are_refused_before_any_allocation(plain, tmp_path):
    targets = list(np.linspace(0.05, 0.1, 5000))
    error, grown = _grown_mb(lambda: save_reconstructed_models(plain, tmp_path / "out", targets))
    assert f"target_sigma_rels holds 5000 values, at most {MAX_TARGETS}" in error
    assert grown < 50, grown  # nothing per target was allocated
    assert len(reconstruct_ema(plain, targets[:MAX_TARGETS])) == MAX_TARGETS  # the limit itself is allowed


# --------------------------------------------------------------------------------- colliding snapshot file names
def test_profiles_whose_file_names_collide_are_refused_when_tracking_starts(tmp_path):
    a, b = 0.1234561, 0.1234562
    assert snapshot_filename(10, a) == snapshot_filename(10, b)  # the collision is real: 6 decimals in a name
    with pytest.raises(ValueError, match=r"sigma_rels 0.1234561 and 0.1234562 share the snapshot file name label"):
        PowerFunctionEMA(nn.Linear(2, 1), sigma_rels=(0.05, a, b))
    model = nn.Linear(2, 1)
    ema = PowerFunctionEMA(model, sigma_rels=(0.05, 0.0500001))  # close, but named apart: two files
    ema.update(model, 10)
    assert len(set(ema.save_snapshots(tmp_path, 10, is_main_process=True))) == 2
    assert [info.sigma_rel for info in list_snapshots(tmp_path)] == [0.05, 0.0500001]


# ------------------------------------------------------------------------ nothing from outside a named folder
@pytest.fixture
def secret(tmp_path) -> Path:
    path = tmp_path / "outside" / "token"
    path.parent.mkdir()
    path.write_text("hf_pretend_this_is_a_token")
    return path


@pytest.mark.parametrize("link", ["file", "folder"])
def test_push_reconstruction_refuses_a_symlink_out_of_the_folder(local_hub, unet, tmp_path, secret, link):
    (folder,) = save_reconstructed_models(unet, tmp_path / "models", [0.07])
    if link == "file":
        (folder / "notes.txt").symlink_to(secret)
    else:
        (folder / "extra").symlink_to(secret.parent, target_is_directory=True)
    served = len(local_hub.requests())
    repo_id = f"tester/never-uploaded-{link}"
    with pytest.raises(ValueError, match=r"is a symbolic link \(to .*outside.*\); only regular files"):
        hub.push_reconstruction(folder, repo_id, endpoint=local_hub.endpoint)
    assert len(local_hub.requests()) == served  # not one request: no repo created, nothing uploaded
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=local_hub.endpoint).repo_info(repo_id)


def test_snapshot_links_are_neither_read_nor_pushed(local_hub, unet, plain, tmp_path):
    folder = _copy(unet, tmp_path)
    link = folder / "phema-0000000040-0.050.safetensors"
    link.symlink_to(plain / "phema-0000000040-0.050.safetensors")  # a snapshot of another run, from elsewhere
    with pytest.raises(ValueError, match="is a symbolic link to .* outside"):
        list_snapshots(folder)
    link.unlink()
    inside = folder / "phema-0000000030-0.100.safetensors"
    moved = folder / "stored-elsewhere.bin"
    inside.rename(moved)
    inside.symlink_to(moved.name)  # a link that stays inside: read, but never uploaded
    assert len(list_snapshots(folder)) == 6
    served = len(local_hub.requests())
    with pytest.raises(ValueError, match="phema-0000000030-0.100.safetensors is a symbolic link"):
        hub.push_snapshots(folder, "tester/phema-linked", endpoint=local_hub.endpoint)
    assert len(local_hub.requests()) == served


def test_a_linked_output_folder_is_not_written_through(unet, tmp_path, secret):
    output = tmp_path / "out"
    output.mkdir()
    (output / "phema-0000000030-0.070").symlink_to(secret.parent, target_is_directory=True)
    with pytest.raises(ValueError, match="symbolic links"):
        save_reconstructed_models(unet, output, [0.07], overwrite=True)
    assert [p.name for p in secret.parent.iterdir()] == ["token"]


# ----------------------------------------------------------------------------------- the CLI: one line, exit 2
@pytest.mark.parametrize(
    "case, match",
    [
        ("unreachable", "cannot be reconstructed"),
        ("tiny sigma_rel", "sigma_rel must satisfy"),
        ("nan sigma_rel", "must be a finite number"),
        ("5000 targets", "at most 64"),
        ("hostile config", "whose tensors differ"),
        ("edited gamma", "records gamma="),
        ("linked snapshot", "is a symbolic link"),
    ],
)
def test_every_refusal_is_one_cli_line_and_writes_nothing(unet, plain, tmp_path, capsys, case, match):
    folder = _copy(unet, tmp_path)
    targets = ["0.07"]
    if case == "unreachable":
        targets = ["0.01"]
    elif case == "tiny sigma_rel":
        targets = ["1e-300"]
    elif case == "nan sigma_rel":
        targets = ["nan"]
    elif case == "5000 targets":
        targets = [f"{s:.6f}" for s in np.linspace(0.05, 0.1, 5000)]
    elif case == "hostile config":
        _blow_up(folder)
    elif case == "edited gamma":
        _edit_header(next(folder.iterdir()), lambda meta: meta.update(gamma=meta["gamma"] * 1.05))
    elif case == "linked snapshot":
        (folder / "phema-0000000040-0.050.safetensors").symlink_to(plain / "phema-0000000040-0.050.safetensors")
    output = tmp_path / "out"
    line = _one_line_cli_error(capsys, [str(folder), "--sigma_rel", *targets, "--output_dir", str(output)])
    assert match in line
    assert not output.exists()


def test_an_oversized_header_record_is_refused_before_it_is_parsed(plain, tmp_path):
    folder = _copy(plain, tmp_path)
    victim = folder / "phema-0000000010-0.050.safetensors"
    _edit_header(victim, lambda meta: meta.update(padding="x" * (5 << 20)))  # a 5 MiB record
    with pytest.raises(ValueError, match="more than the 4194304 a snapshot header may hold"):
        list_snapshots(folder)
