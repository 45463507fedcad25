"""Old import paths kept as thin aliases of their new homes; importing one emits a ``FutureWarning``."""

import warnings


def warn_moved(old: str, new: str) -> None:
    """Tell the importer of ``old`` that it moved to ``new`` (the alias will be removed in a later release)."""
    warnings.warn(f"{old} moved to {new}; import it from there", FutureWarning, stacklevel=3)
