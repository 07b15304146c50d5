"""Serving quantmla's cache inside an inference engine.

:mod:`quantmla.serving.paged_decode` (decode over an engine's record pages on the CPU) and
:mod:`quantmla.serving.windows` (the BF16 shadows of the window tokens in paged pages) need only torch; the
decode kernels read an engine's pages in place (:meth:`quantmla.kernels.layout.PagedLatentStore.from_pages`);
:mod:`quantmla.serving.vllm` is the vLLM plugin (extra ``[vllm]``).
"""
