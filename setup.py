"""Package layout for diffusers-scalelong (metadata and dependencies are in pyproject.toml).

One import name, ``diffusers_scalelong``. The data folders under ``assets/`` are namespace packages so that
setuptools ships their files as package data; the Hub shim files of the top-level ``pipelines/`` folder ship
inside the package as ``diffusers_scalelong.hub_shims`` (a link to that folder in the source tree).
"""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["diffusers_scalelong", "diffusers_scalelong.*"]),
)
