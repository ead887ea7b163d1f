"""What a worker need not import: run before anything imports transformers' models.

transformers up to at least 5.17 imports `sklearn.metrics` (and with it scipy) when its
generation package loads (`generation/candidate_generator.py`, for assisted decoding's
confidence threshold), which every causal LM's import pulls in; later versions import it only
where assisted decoding runs. This trainer never decodes with an assistant model. Measured on
an H100 machine (2026-12-06, transformers 5.17, `python -X importtime -c "import trainer.main"`
with the bytecode cache filled): sklearn took 3.5 s of a first process's 10.3 s of imports, and
1.4 s of each later one's.
"""

from __future__ import annotations


def skip_sklearn() -> None:
    """Tell transformers that scikit-learn is not installed (its own check, `is_sklearn_available`,
    read where it is imported from), so that loading its generation package imports nothing from
    it. Call before the first import of a transformers model; a no-op where the check is absent."""
    import transformers.utils
    from transformers.utils import import_utils

    def unavailable() -> bool:
        return False

    for module in (import_utils, transformers.utils):
        if hasattr(module, "is_sklearn_available"):
            module.is_sklearn_available = unavailable  # type: ignore[attr-defined]
