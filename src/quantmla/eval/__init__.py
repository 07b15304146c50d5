from quantmla.eval.niah import NiahConfig, run_niah
from quantmla.eval.ppl import PerplexityConfig, PerplexityResult, perplexity
from quantmla.eval.simulate import SimulatedDecodeCache, simulated_decode

__all__ = [
    "NiahConfig",
    "PerplexityConfig",
    "PerplexityResult",
    "SimulatedDecodeCache",
    "perplexity",
    "run_niah",
    "simulated_decode",
]
