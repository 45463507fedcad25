"""Inverse-square-root learning-rate decay with linear warm-up (EDM2, Karras et al., arXiv 2312.02696, Eq. 17)."""

from collections.abc import Callable

__all__ = ["inverse_sqrt_lr_lambda"]


def inverse_sqrt_lr_lambda(t_ref: int = 70_000, warmup_steps: int = 0) -> Callable[[int], float]:
    """Multiplier of ``ref_lr`` at step t, for ``torch.optim.lr_scheduler.LambdaLR`` (base lr = ref_lr).

    ``lr(t) / ref_lr = min(t / warmup_steps, 1) / sqrt(max(t / t_ref, 1))``: linear warm-up over ``warmup_steps``
    (none when 0), constant until ``t_ref``, then decay as ``1 / sqrt(t)``. The paper warms up over 10M images
    (``warmup_steps = 10e6 / batch_size``) and uses ``t_ref`` = 70k (ImageNet-512) or 35k (ImageNet-64) steps of
    batch 2048. As in the paper, step 0 of a warm-up has lr 0.
    """
    if t_ref <= 0:
        raise ValueError(f"t_ref must be positive, got {t_ref}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")

    def lr_lambda(step: int) -> float:
        factor = 1.0 / max(step / t_ref, 1.0) ** 0.5
        if warmup_steps > 0:
            factor *= min(step / warmup_steps, 1.0)
        return factor

    return lr_lambda
