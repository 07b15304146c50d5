from quantmla.analysis.sensitivity import AnalysisConfig, AnalysisReport, LayerReport, analyze, analyze_layer

__all__ = ["AnalysisConfig", "AnalysisReport", "LayerReport", "analyze", "analyze_layer"]
