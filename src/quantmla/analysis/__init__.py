from quantmla.analysis.analyze import AnalysisConfig, AnalysisReport, LayerReport, analyze, analyze_layer

__all__ = ["AnalysisConfig", "AnalysisReport", "LayerReport", "analyze", "analyze_layer"]
