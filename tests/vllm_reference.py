"""quantmla's transformers path as the reference for the vLLM plugin's tests (CPU and GPU)."""

from __future__ import annotations

import torch


def teacher_forced_logprobs(model, scheme: str | None, prompts, tokens, chunk: int | None = None, group_size: int = 64,
                            hp_dtype=None):  # fmt: skip
    """Per request, the logprob of each of vLLM's ``tokens`` under quantmla's transformers path: the prompt
    through ``QuantizedLatentCache`` (its default windows, sink 4 + recent 128; in pieces of ``chunk`` tokens
    if given, as a chunked prefill feeds it), then the tokens one decode step at a time. ``scheme=None``:
    the unquantised model, in one forward."""
    from quantmla.cache import QuantizedLatentCache

    out = []
    device = next(model.parameters()).device

    def ids(x):
        return torch.tensor(x, device=device)

    with torch.no_grad():
        for p, t in zip(prompts, tokens, strict=True):
            if scheme is None:
                lp = model(ids([p + t])).logits.float().log_softmax(-1)[0, len(p) - 1 : -1]
            else:
                cache = QuantizedLatentCache(model.config, scheme=scheme, group_size=group_size, backend="torch",
                                             hp_dtype=hp_dtype)  # fmt: skip
                step = chunk or len(p)
                for i in range(0, len(p), step):
                    last = model(ids([p[i : i + step]]), past_key_values=cache, use_cache=True).logits[0, -1]
                steps = [last]
                for x in t[:-1]:
                    steps.append(model(ids([[x]]), past_key_values=cache, use_cache=True).logits[0, -1])
                lp = torch.stack(steps).float().log_softmax(-1)
            out.append(lp.gather(-1, ids(t)[:, None])[:, 0].tolist())
    return out


def mean_abs_diff(a, b) -> float:
    d = [abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True)]
    return sum(d) / len(d)


def max_abs_diff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))
