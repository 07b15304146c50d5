"""Metrics of the local lm-eval test tasks."""


def starts_with(references, predictions):
    """1.0 when the generation, stripped, starts with the reference."""
    return float(predictions[0].strip().startswith(references[0].strip()))
