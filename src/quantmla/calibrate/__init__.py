from quantmla.calibrate.api import CalibrationConfig, CalibrationReport, calibrate, export, read_meta
from quantmla.calibrate.methods import METHODS

__all__ = ["METHODS", "CalibrationConfig", "CalibrationReport", "calibrate", "export", "read_meta"]
