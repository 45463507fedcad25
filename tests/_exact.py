"""Helpers that make save/load and cross-process comparisons exact instead of loosened.

Two things change the last bits of float32 results on CPU although the computation is the same:

* memory alignment: diffusers loads safetensors files memory-mapped, so a reloaded tensor starts wherever it sits
  in the file (8-byte aligned), while a freshly created tensor is 64-byte aligned. ATen and oneDNN kernels split
  their vectorised loops differently for unaligned data, which changes the float32 summation order: about 1e-7
  relative per layer, 1e-5 after a few sampling steps (seen on AMD EPYC). :func:`realign` copies every parameter
  and buffer into fresh storage, so a reloaded model computes bit-identically to the one that was saved;
* the number of threads: reductions are split per thread. :func:`one_thread` pins the count for a reference that a
  subprocess (run with ``OMP_NUM_THREADS=1``) must reproduce.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch


def realign(model_or_pipeline):
    """Copy the parameters and buffers of a module (or of every module component of a pipeline) into fresh,
    allocator-aligned storage, in place; returns its argument."""
    components = getattr(model_or_pipeline, "components", None)
    modules = components.values() if isinstance(components, dict) else [model_or_pipeline]
    with torch.no_grad():
        for module in modules:
            if isinstance(module, torch.nn.Module):
                for tensor in [*module.parameters(), *module.buffers()]:
                    tensor.data = tensor.data.clone()
    return model_or_pipeline


REALIGN_SOURCE = "import torch\n" + inspect.getsource(realign)
"""The same function as source text, for scripts run in a fresh process (which cannot import the tests folder)."""


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """Run the block with one torch thread (as a subprocess started with ``OMP_NUM_THREADS=1`` does)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
