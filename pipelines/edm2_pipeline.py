"""Custom-pipeline file for diffusers-scalelong's EDM2Pipeline.

diffusers loads this file for a Hub repo whose ``model_index.json`` names ``["edm2_pipeline", "EDM2Pipeline"]``
(``DiffusionPipeline.from_pretrained(repo_id, trust_remote_code=True)``), or when it is passed as
``custom_pipeline=``. The implementation lives in the installed package: ``pip install diffusers-scalelong``.
"""

from diffusers_scalelong.pipelines.edm2_pipeline import EDM2Pipeline

__all__ = ["EDM2Pipeline"]
