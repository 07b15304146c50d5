from quantmla.eval.ppl import PerplexityConfig, PerplexityResult, perplexity
from quantmla.eval.simulate import SimulatedDecodeCache, simulated_decode

__all__ = ["PerplexityConfig", "PerplexityResult", "SimulatedDecodeCache", "perplexity", "simulated_decode"]
