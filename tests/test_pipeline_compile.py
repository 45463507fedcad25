"""EDM2Pipeline sampling with a compiled EDM2UNet2DModel: one graph, no graph breaks, no recompiles across steps."""

import pytest
import torch
from torch._dynamo.utils import counters

from diffusers_scalelong.models import EDM2UNet2DModel
from diffusers_scalelong.pipelines import EDM2Pipeline
from diffusers_scalelong.schedulers import EDMHeunScheduler
from tests._tiny_models import TINY_EDM2_UNET


def sample(unet: torch.nn.Module, steps: int = 4) -> torch.Tensor:
    pipe = EDM2Pipeline(unet=unet, scheduler=EDMHeunScheduler())
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    return pipe(batch_size=2, class_labels=[0, 2], num_inference_steps=steps, generator=generator, output_type="pt")[0]


@pytest.mark.slow  # dynamo traces the whole network: minutes of CPU on a busy 2-core machine
@pytest.mark.parametrize(("backend", "channels_last"), [("eager", False), ("inductor", False), ("inductor", True)])
def test_compiled_sampling_is_one_graph_without_breaks_or_recompiles(backend, channels_last):
    torch.manual_seed(0)
    unet = EDM2UNet2DModel(**TINY_EDM2_UNET, num_class_embeds=3, lsc_method="ls").eval()
    with torch.no_grad():  # non-zero gains, so that every layer shapes the output
        unet.out_gain.fill_(0.5)
    expected = sample(unet)
    torch._dynamo.reset()
    counters.clear()
    if channels_last:  # the fastest CPU sampling set-up (benchmarks/results/edm2_unet.md)
        unet = unet.to(memory_format=torch.channels_last)
    compiled = torch.compile(unet, backend=backend, fullgraph=True)  # fullgraph: a graph break raises
    with torch._dynamo.config.patch(error_on_recompile=True):
        images = sample(compiled, steps=4)  # 7 network evaluations (Heun), every one with another c_noise
    assert counters["stats"]["unique_graphs"] == 1
    assert not counters["graph_break"]
    # eager: the same kernels; inductor fuses elementwise chains into other float32 roundings.
    tolerance = {"rtol": 0, "atol": 0} if backend == "eager" else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(images, expected, **tolerance)
