"""Every way of putting a pipeline on the Hub gives a repo that loads by repo id, on the real local Hub.

Routes: ``save_pretrained`` with a variant and shards then ``upload_folder``, diffusers' ``pipe.push_to_hub``,
``save_pretrained(push_to_hub=True)`` and the package's ``push_pipeline_to_hub`` (the Hub layout), for
``EDM2Pipeline``, ``DDPMPipeline`` + ``ScaleLongUNet2DModel`` and ``DDPMPipeline`` + ``UViT2DModel``. Each repo is
loaded with ``DiffusionPipeline.from_pretrained`` in fresh processes where the package is imported, installed but not
imported, or absent (its import blocked), with and without ``trust_remote_code``; a load must give the pushed weights
bit for bit, a refusal the documented error. Run with ``-s`` to print the route table.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from diffusers_scalelong.hub.cards import INSTALL

ROOT = Path(__file__).resolve().parents[1]
PIPELINES = ("EDM2Pipeline+EDM2UNet2DModel", "DDPMPipeline+ScaleLongUNet2DModel", "DDPMPipeline+UViT2DModel")
# route -> (slug, variant the repo is loaded with)
ROUTES = {
    "save_pretrained(variant, max_shard_size) + upload_folder": ("saved", "fp16"),
    "pipe.push_to_hub(repo_id)": ("diffusers-push", None),
    "save_pretrained(push_to_hub=True, variant, max_shard_size)": ("save-push", "fp16"),
    "push_pipeline_to_hub (Hub layout)": ("hub-layout", "fp16"),
}
MODES = ("imported", "installed, not imported", "absent")
# What diffusers' errors name when the package is not imported: the UNet's module (model_index.json names it) or,
# for EDM2Pipeline, a component's module or the pipeline class it looks up on the diffusers module.
NAMED_IN_ERROR = {
    "EDM2Pipeline+EDM2UNet2DModel": ("diffusers_scalelong.", "has no attribute EDM2Pipeline"),
    "DDPMPipeline+ScaleLongUNet2DModel": ("diffusers_scalelong.models.scalelong_unet",),
    "DDPMPipeline+UViT2DModel": ("diffusers_scalelong.models.uvit",),
}

PUSHER = """
import sys
sys.path.insert(0, ROOT)
import torch
from diffusers import DDPMPipeline, DDPMScheduler
from huggingface_hub import HfApi
from safetensors.torch import save_file
from diffusers_scalelong.hub import push_pipeline_to_hub
from diffusers_scalelong.models import EDM2UNet2DModel, ScaleLongUNet2DModel, UViT2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._tiny_models import TINY_EDM2_UNET, TINY_UNET

def build(name):
    torch.manual_seed(0)
    if name.startswith("EDM2Pipeline"):
        return EDM2Pipeline(unet=EDM2UNet2DModel(**TINY_EDM2_UNET, lsc_method="cs"), scheduler=EDMHeunScheduler())
    if name.endswith("ScaleLongUNet2DModel"):
        unet = ScaleLongUNet2DModel(**TINY_UNET, lsc_method="cs")
    else:
        unet = UViT2DModel(sample_size=8, patch_size=2, in_channels=1, embed_dim=16, num_heads=2, depth=2)
    return DDPMPipeline(unet=unet, scheduler=DDPMScheduler(num_train_timesteps=10))

def push(pipe, route, repo_id):
    if route == "saved":
        pipe.save_pretrained(repo_id, variant="fp16", max_shard_size="20KB")
        HfApi().create_repo(repo_id, exist_ok=True)
        HfApi().upload_folder(repo_id=repo_id, folder_path=repo_id)
    elif route == "diffusers-push":
        pipe.push_to_hub(repo_id)
    elif route == "save-push":
        pipe.save_pretrained(repo_id, push_to_hub=True, repo_id=repo_id, variant="fp16", max_shard_size="20KB")
    else:
        push_pipeline_to_hub(pipe, repo_id, variant="fp16", max_shard_size="20KB", ema=False)

for name, routes in REPOS.items():
    pipe = build(name)
    save_file({k: v.contiguous() for k, v in pipe.unet.state_dict().items()}, f"{name}.safetensors")
    for route, repo_id in routes:
        push(pipe, route, repo_id)
print("pushed")
"""

# The package made absent: its editable-install finder taken off sys.meta_path and, should it still be found (a
# regular install), a finder that reports it missing, as Python does for a package that is not installed.
ABSENT = """
import importlib.abc, importlib.util, sys
sys.meta_path[:] = [f for f in sys.meta_path if "diffusers_scalelong" not in type(f).__module__]
if importlib.util.find_spec("diffusers_scalelong") is not None:
    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "diffusers_scalelong":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, Absent())
try:
    import diffusers_scalelong
    raise SystemExit("diffusers_scalelong is still importable")
except ModuleNotFoundError as error:
    assert error.name == "diffusers_scalelong", error
"""

LOADER = """
import json, sys, torch
from diffusers import DiffusionPipeline
from safetensors.torch import load_file
for name, repo_id, variant, trust in CASES:
    before = "diffusers_scalelong" in sys.modules
    try:
        pipe = DiffusionPipeline.from_pretrained(repo_id, revision="main", variant=variant, trust_remote_code=trust)
        ref, got = load_file(f"{name}.safetensors"), pipe.unet.state_dict()
        same = ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
        out = {"loaded": f"{type(pipe).__name__}+{type(pipe.unet).__name__}", "same_weights": same}
    except Exception as error:
        out = {"error": type(error).__name__, "message": str(error)}
    print(json.dumps({"repo": repo_id, "trust": trust, "imported_before": before, **out}), flush=True)
"""


# A model on its own: diffusers' ModelMixin.push_to_hub, loaded by repo id with AutoModel and with its class.
MODEL_ROUTE = """
from diffusers import AutoModel
from diffusers_scalelong.models import ScaleLongUNet2DModel
unet = build("DDPMPipeline+ScaleLongUNet2DModel").unet
unet.push_to_hub("routes/scalelong-unet")
for loader in (AutoModel, ScaleLongUNet2DModel):
    loaded = loader.from_pretrained("routes/scalelong-unet", revision="main")
    ref, got = unet.state_dict(), loaded.state_dict()
    same = ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    print(json.dumps({"loader": loader.__name__, "class": type(loaded).__name__, "same_weights": same}), flush=True)
"""


def repo_id(pipeline: str, route: str) -> str:
    return f"routes/{pipeline.replace('+', '-').lower()}-{ROUTES[route][0]}"


def expected(name: str, route: str, mode: str, trust: bool) -> tuple[str, ...]:
    """``("loads",)`` or texts one of which the error must contain."""
    if "Hub layout" not in route:
        return ("loads",) if mode == "imported" else NAMED_IN_ERROR[name]
    if not trust:
        return ("Pass `trust_remote_code=True`",)
    return (f"Install it with: {INSTALL}",) if mode == "absent" else ("loads",)


def run(code: str, env: dict, cwd: Path) -> list[dict]:
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=cwd,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def route_table(
    local_hub, tmp_path: Path, pipelines=PIPELINES, routes=tuple(ROUTES), modes=MODES, extra: str = ""
) -> tuple[dict, list[dict]]:
    """Push every pipeline by every route, then load every repo in every mode, each mode in a fresh process with its
    own empty Hub cache (the imported mode in the pushing process when it is the only one, followed by ``extra``);
    returns ``{(pipeline, route, mode, trust): cell}`` and the lines ``extra`` printed."""
    env = {**local_hub.env(hub_cache=tmp_path / "push-cache"), "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the loaders must not see the source tree
    repos = {name: [(ROUTES[route][0], repo_id(name, route)) for route in routes] for name in pipelines}
    # The loads that run the repo's code file (a Hub layout trusted) import the package: they go last, so that every
    # other load of the "installed, not imported" process runs with the package not imported (checked below).
    cases = sorted(
        ((name, repo_id(name, route), ROUTES[route][1], trust) for name in pipelines for route in routes
         for trust in (False, True)),
        key=lambda case: case[3] and case[1].endswith("-hub-layout"),
    )  # fmt: skip
    pusher = f"ROOT = {str(ROOT)!r}\nREPOS = {repos!r}\nCASES = {cases!r}\n" + PUSHER
    if modes == ("imported",):
        env["HF_MODULES_CACHE"] = str(tmp_path / "imported")
        lines = run(pusher + LOADER + extra, env, tmp_path)  # the pusher's cache holds no file of what it uploaded
        results = {"imported": [line for line in lines if "repo" in line]}
    else:
        lines = run(pusher, env, tmp_path)
        results = {}
        for mode in modes:
            mode_env = {
                **env,
                "HF_HUB_CACHE": str(tmp_path / f"cache-{mode}"),
                "HF_MODULES_CACHE": str(tmp_path / mode),
            }
            prelude = ABSENT if mode == "absent" else "import diffusers_scalelong\n" if mode == "imported" else ""
            results[mode] = run(prelude + f"CASES = {cases!r}\n" + LOADER, mode_env, tmp_path)
    table = {}
    for mode, mode_lines in results.items():
        by_repo = {(line["repo"], line["trust"]): line for line in mode_lines}
        if mode != "imported":
            runs_repo_code = [line["trust"] and line["repo"].endswith("-hub-layout") for line in mode_lines]
            assert not any(
                line["imported_before"] for line, last in zip(mode_lines, runs_repo_code, strict=True) if not last
            ), mode_lines
        for name in pipelines:
            for route in routes:
                for trust in (False, True):
                    table[name, route, mode, trust] = by_repo[repo_id(name, route), trust]
    return table, [line for line in lines if "repo" not in line]


def check_and_print(table: dict, extra_lines: list[dict]) -> None:
    rows = []
    for (name, route, mode, trust), cell in table.items():
        want = expected(name, route, mode, trust)
        if want == ("loads",):
            assert cell.get("loaded") == name and cell["same_weights"], (name, route, mode, trust, cell)
            shown = "loads (same weights)"
        else:
            assert "error" in cell and any(text in cell["message"] for text in want), (name, route, mode, trust, cell)
            shown = f"{cell['error']}: {cell['message'][:110]}..."
        rows.append(f"| {name} | {route} | {mode} | {trust} | {shown} |")
    for line in extra_lines:
        rows.append(f"| {line['class']} alone | model.push_to_hub(repo_id) | imported | False | "
                    f"{line['loader']}.from_pretrained: {'loads (same weights)' if line['same_weights'] else line} |")  # fmt: skip
    print("\n| pipeline | route | package | trust_remote_code | result |\n|---|---|---|---|---|\n" + "\n".join(rows))


def test_a_diffusers_push_loads_by_repo_id_once_the_package_is_imported(local_hub, tmp_path):
    """The short version: diffusers' ``push_to_hub`` of the ScaleLong DDPM pipeline (the Hub layout's push and loads
    are in test_pipeline_hub.py)."""
    pipelines, routes = ("DDPMPipeline+ScaleLongUNet2DModel",), ("pipe.push_to_hub(repo_id)",)
    table, models = route_table(local_hub, tmp_path, pipelines, routes, modes=("imported",), extra=MODEL_ROUTE)
    check_and_print(table, models)
    assert [(line["loader"], line["class"], line["same_weights"]) for line in models] == [
        ("AutoModel", "ScaleLongUNet2DModel", True),
        ("ScaleLongUNet2DModel", "ScaleLongUNet2DModel", True),
    ]


@pytest.mark.slow
def test_every_route_loads_by_repo_id(local_hub, tmp_path):
    check_and_print(*route_table(local_hub, tmp_path))
