"""Long-skip-connection (LSC) scaling coefficients of ScaleLong (arXiv 2310.13545).

Skips are indexed from the outermost (i = 1: first encoder output -> last decoder input)
to the innermost (i = N). Constant scaling (CS) multiplies skip i by ``kappa ** (i - 1)``.
"""

from collections.abc import Sequence

from ..validation import check_number

LSC_METHODS = ("none", "inv_sqrt2", "cs", "cs_stage", "ls", "ls_nonshared")
LEARNABLE_METHODS = ("ls", "ls_nonshared")


def check_reduction(reduction: int) -> None:
    """Raise ``ValueError`` unless the LS gate reduction ``lsc_reduction`` is an integer >= 1."""
    if isinstance(reduction, bool) or not isinstance(reduction, int) or reduction < 1:
        raise ValueError(f"lsc_reduction must be an integer >= 1, got {reduction!r}")


def validate_lsc_options(method: str, kappa: float, reduction: int = 16) -> None:
    """The one check of the ScaleLong options: raise ``ValueError`` naming ``lsc_method``, ``lsc_kappa`` or
    ``lsc_reduction`` when one is invalid."""
    if method not in LSC_METHODS:
        raise ValueError(f"lsc_method={method!r} is unknown; choose one of {', '.join(LSC_METHODS)}")
    check_number("lsc_kappa", kappa, 0.0, low_inclusive=False)
    check_reduction(reduction)


def lsc_coefficients(
    method: str, num_skips: int, kappa: float = 0.5, stage_ids: Sequence[int] | None = None
) -> list[float]:
    """Constant coefficient of each skip, outermost first (learnable methods return 1.0: their gate is separate).

    - ``none``: 1; ``inv_sqrt2``: 2^-1/2; ``cs``: kappa^(i-1) with i = 1..N counted over all skips;
    - ``cs_stage``: kappa^(j-1) with j counted within each resolution stage, outermost skip of a stage first;
      ``stage_ids[k]`` is the stage of skip k (outermost first, equal ids for one stage).
    """
    validate_lsc_options(method, kappa)
    if num_skips < 0:
        raise ValueError(f"num_skips must be >= 0, got {num_skips}")
    if method == "inv_sqrt2":
        return [2.0**-0.5] * num_skips
    if method == "cs":
        return [float(kappa) ** i for i in range(num_skips)]
    if method == "cs_stage":
        if stage_ids is None or len(stage_ids) != num_skips:
            raise ValueError("lsc_method='cs_stage' needs one stage id per skip (stage_ids)")
        seen: dict[int, int] = {}
        coefficients = []
        for stage in stage_ids:
            position = seen.get(stage, 0)
            seen[stage] = position + 1
            coefficients.append(float(kappa) ** position)
        return coefficients
    return [1.0] * num_skips
