"""Evaluation of a model through its quantised cache: perplexity, needle retrieval, lm-eval tasks."""

from quantmla.eval.niah import NiahConfig, run_niah
from quantmla.eval.ppl import PerplexityConfig, PerplexityResult, perplexity

__all__ = ["NiahConfig", "PerplexityConfig", "PerplexityResult", "perplexity", "run_niah"]
