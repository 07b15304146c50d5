"""How a model's attention and cache are observed, for calibration, evaluation and analysis alike: one
attention call captured (:mod:`~quantmla.measure.capture`) and run again with its cache perturbed
(:mod:`~quantmla.measure.attention`), the cache as decode sees it for a whole sequence in one forward
(:mod:`~quantmla.measure.simulate`), and token windows of a text (:mod:`~quantmla.measure.tokens`)."""

from quantmla.measure.attention import run_attention
from quantmla.measure.capture import AttentionCall, capture_attention_call
from quantmla.measure.simulate import SimulatedDecodeCache, simulated_decode
from quantmla.measure.tokens import token_windows

__all__ = [
    "AttentionCall",
    "SimulatedDecodeCache",
    "capture_attention_call",
    "run_attention",
    "simulated_decode",
    "token_windows",
]
