"""Calibrate, fuse and export: :func:`calibrate_model`, :func:`export` (format: :mod:`quantmla.formats.export`)."""

from quantmla.calibrate.api import (
    QUANTMLA_METHODS,
    CalibrationConfig,
    CalibrationReport,
    LayerStage,
    calibrate_model,
    export,
    layer_stage,
    merge_layer_stages,
)
from quantmla.formats.export import METHODS, read_meta

__all__ = [
    "METHODS",
    "QUANTMLA_METHODS",
    "CalibrationConfig",
    "CalibrationReport",
    "LayerStage",
    "calibrate_model",
    "export",
    "layer_stage",
    "merge_layer_stages",
    "read_meta",
]
