"""Serving quantmla's cache inside an inference engine.

:mod:`quantmla.serving.records` (a token as a byte record) and :mod:`quantmla.serving.paged_decode`
(decode over paged records in torch) need only torch; :mod:`quantmla.serving.kernel_pages` hands an
engine's pages to the Triton decode kernels in place; :mod:`quantmla.serving.vllm` is the vLLM plugin
(extra ``[vllm]``).
"""
