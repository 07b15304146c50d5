"""Token windows of a text: the calibration and evaluation batches."""

from __future__ import annotations

import torch


def token_windows(tokenizer, text: str, seq_len: int, num_seqs: int | None, spread: bool = False) -> torch.Tensor:
    """Windows ``[n, seq_len]`` of the text's tokens: all full windows, the first ``num_seqs``, or with
    ``spread`` ``num_seqs`` of them evenly spaced over the text (at most all of them)."""
    return select_windows(all_windows(tokenizer, text, seq_len), num_seqs, spread)


def all_windows(tokenizer, text: str, seq_len: int) -> torch.Tensor:
    """Every full window ``[n, seq_len]`` of the text's tokens, in order."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of seq_len={seq_len}")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def select_windows(windows: torch.Tensor, num_seqs: int | None, spread: bool) -> torch.Tensor:
    """All of ``windows``, the first ``num_seqs``, or ``num_seqs`` spread evenly (at most all)."""
    n, seq_len = windows.shape
    if num_seqs is None:
        return windows
    if spread:
        return windows[torch.linspace(0, n - 1, min(num_seqs, n)).round().long()]
    if num_seqs > n:
        raise ValueError(f"num_seqs={num_seqs} but the text holds only {n} windows of {seq_len} tokens")
    return windows[:num_seqs]
