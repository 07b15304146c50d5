"""Short extends as decode rows: each new token of a request one kernel row, of its causal length."""

import numpy as np
import torch

from quantmla.serving.vllm.short_extends import decode_tokens, uniform_query_len


def test_each_token_a_row_of_its_request_at_its_causal_length():
    qsl = np.array([0, 1, 4, 5, 7, 300])  # decodes of 1, 3, 1 and 2 tokens, then a prefill
    rows = decode_tokens(qsl, 4)
    assert rows.request.tolist() == [0, 1, 1, 1, 2, 3, 3]
    assert rows.back.tolist() == [0, 2, 1, 0, 0, 1, 0]
    table = torch.arange(4 * 3, dtype=torch.int32).reshape(4, 3)
    seq_lens = torch.tensor([10, 50, 7, 20])  # lengths after the step
    t, lens = rows.rows(table, seq_lens)
    assert lens.tolist() == [10, 48, 49, 50, 7, 19, 20] and lens.dtype == torch.int32
    assert torch.equal(t, table[[0, 1, 1, 1, 2, 3, 3]])


def test_a_plain_decode_step_keeps_its_tables():
    assert decode_tokens(np.array([0, 1, 2, 3, 40]), 3) is None
    assert decode_tokens(np.array([0, 90]), 0) is None


def test_padding_requests_add_no_row():
    assert decode_tokens(np.array([0, 1, 1, 1]), 3) is None  # a padded CUDA graph batch
    rows = decode_tokens(np.array([0, 2, 2, 3]), 3)
    assert rows.request.tolist() == [0, 0, 2] and rows.back.tolist() == [1, 0, 0]


def test_a_uniform_step_is_one_launch_of_its_query_tokens():
    assert uniform_query_len(np.array([0, 4, 8, 12, 40]), 3) == 4  # three decodes of 1 + 3 drafts, then a prefill
    assert uniform_query_len(np.array([0, 1, 2, 3]), 3) == 1  # plain decode
    assert uniform_query_len(np.array([0, 4, 6, 10]), 3) == 0  # mixed: a row a token
    assert uniform_query_len(np.array([0, 2, 2]), 2) == 0  # a padded request (none in an eager step)
    assert uniform_query_len(np.array([0, 90]), 0) == 0
