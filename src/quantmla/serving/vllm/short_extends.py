"""Short extends through the decode kernels: a request adding a few tokens to a long context (the last
piece of a chunked prompt, a short prompt) attends as that many decode tokens.

vLLM's ``FLASH_ATTN_MLA`` sends every request of at most 512 new tokens down its decode path (its kernel
takes several queries a request). A prefill instead up-projects its whole context to every head: for the
few tokens left of a 32K prompt that cut across a step, ``kv_b_proj`` of 32K latents a layer, where the
decode path reads the same pages once a token. quantmla's decode kernels take one query a sequence, so a
request of ``q`` new tokens becomes ``q`` decode rows of its block table, row ``j`` of length
``n - q + 1 + j`` (causal): :class:`DecodeTokens` maps the rows, planned once a step on the host from
vLLM's query offsets.

Each row reads the exact decode policy for its own length: the sinks and its own last ``recent`` tokens
unquantised. The earlier rows' windows reach back up to ``q - 1`` positions before the step's window;
:meth:`quantmla.serving.windows.WindowPool.plan` (``short=``) gives them shadows (they were the last step's window),
and a request it cannot hold this step goes down the prefill path instead (its windows then relative to
the end of the step), said in the log.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quantmla.serving.windows import host_to_device

#: the most new tokens a request may add and still attend as decode tokens (vLLM's ``reorder_batch_threshold``
#: for quantmla's builder). Each token reads the whole context once, so the decode path costs ``q`` context
#: reads against the prefill's up-projection of the context; the windows' pool holds ``q - 1`` more positions
#: of each such request for the step. 16 covers the 2-8 token pieces of 5 x 32K at vLLM's 16,384-token steps;
#: no other value was measured.
SHORT_EXTEND_TOKENS = 16


@dataclass(frozen=True)
class DecodeTokens:
    """The step's decode tokens as kernel rows, on the host: ``request [T]`` (int64, the decode request of each
    token) and ``back [T]`` (int32, how many tokens of its request come after it in the step), so a row's length
    is ``seq_lens[request] - back``. They reach the device only when a layer reads its rows (:meth:`rows`; a step
    that attends in one launch of several query tokens a request never does)."""

    request: np.ndarray
    back: np.ndarray

    def rows(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode requests' block table ``[num_decodes, pages]`` and lengths after the step ``[num_decodes]``
        as one row a token: ``[T, pages]`` and int32 ``[T]``."""
        request = host_to_device(self.request, block_table.device)
        table = block_table.index_select(0, request)
        lens = seq_lens.index_select(0, request).int() - host_to_device(self.back, seq_lens.device)
        return table, lens


def uniform_query_len(query_start_loc: np.ndarray, num_decodes: int) -> int:
    """The tokens every decode request adds when they all add the same number (a speculative-decoding step: the
    last token and the drafts), else 0 (host query offsets ``[>= num_decodes + 1]``). Such a step attends in one
    launch of ``S`` query tokens a request (:func:`quantmla.kernels.decode.mla_decode`), its shapes fixed, as a CUDA
    graph of vLLM's uniform batches replays it."""
    if num_decodes == 0:
        return 0
    q = np.diff(np.asarray(query_start_loc[: num_decodes + 1], dtype=np.int64))
    return int(q[0]) if (q == q[0]).all() else 0


def decode_tokens(query_start_loc: np.ndarray, num_decodes: int) -> DecodeTokens | None:
    """The rows of the step's first ``num_decodes`` requests (host query offsets ``[>= num_decodes + 1]``), or
    ``None`` when none adds more than one token (a plain decode step: the tables as they are, CUDA graphs
    intact)."""
    qsl = np.asarray(query_start_loc[: num_decodes + 1], dtype=np.int64)
    q = qsl[1:] - qsl[:-1]
    if num_decodes == 0 or (q <= 1).all():  # (a CUDA graph's padding requests add none)
        return None
    req = np.repeat(np.arange(num_decodes), q)
    back = qsl[1:][req] - 1 - (qsl[0] + np.arange(req.size))
    return DecodeTokens(req, back.astype(np.int32))
