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


def random_v2(directory) -> str:
    """The GPU plugin test's model, saved in BF16 to ``directory``: a random DeepSeek-V2 of DeepSeek's MLA dimensions
    (512 + 64, heads of 128 + 64 / 128; vLLM's CUDA prefill accepts no others), 2 dense layers, seed 0."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                           num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
                           qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=2,
                           n_routed_experts=4, max_position_embeddings=2048, initializer_range=0.1,
                           tie_word_embeddings=False, torch_dtype="bfloat16")  # fmt: skip
    torch.manual_seed(0)
    DeepseekV2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(directory)
    return str(directory)


def mean_abs_diff(a, b) -> float:
    d = [abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True)]
    return sum(d) / len(d)


def max_abs_diff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b, strict=True) for x, y in zip(u, v, strict=True))


def codec_export(model_dir, out, layers: list[tuple[str, str]], dims: tuple[int, int] = (512, 64), seed: int = 0,
                 strength: float = 0.2, scheme: str = "c4r4", orthogonal: bool = False) -> str:  # fmt: skip
    """An export of ``model_dir`` (weights unchanged, copied into ``out``) with a per-layer codec: ``layers`` gives
    each layer's scheme and what is fitted on it: ``"transforms"`` (RAQ-MLA-like invertible write-side transforms
    of both paths, ``I + strength N / sqrt(d)``), ``"ranges"`` (RoLaQ-like learned ranges on the content) or
    ``""``. ``dims``: the model's latent and RoPE widths; ``scheme``: the export's nominal scheme (its windows);
    ``orthogonal``: random rotations instead (condition number 1: no rounding amplified through the inverse)."""
    import shutil
    from pathlib import Path

    from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
    from quantmla.formats.export import write_codec, write_meta
    from quantmla.formats.scheme import parse_scheme

    out = Path(out)
    for f in Path(model_dir).iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(seed)

    def transform(d):
        noise = torch.randn(d, d, generator=g, dtype=torch.float64)
        if orthogonal:
            q, r = torch.linalg.qr(noise)
            return q * torch.sign(torch.diagonal(r))
        return torch.eye(d, dtype=torch.float64) + strength * noise / d**0.5

    codecs = []
    for name, fit in layers:
        s = parse_scheme(name)
        content, rope = PathCodec(s.content), PathCodec(s.rope)
        if fit == "transforms":
            content = PathCodec(s.content, transform=transform(dims[0]))
            rope = PathCodec(s.rope, transform=transform(dims[1]))
        elif fit == "ranges":
            n = dims[0] // 64
            ratio = 0.7 + 0.3 * torch.rand(n, generator=g, dtype=torch.float64)
            gain = 1 + 0.05 * torch.rand(n, generator=g, dtype=torch.float64)
            content = PathCodec(s.content, clip_ratio=ratio, gain=gain)
        elif fit:
            raise ValueError(f"fit {fit!r}: give 'transforms', 'ranges' or ''")
        codecs.append(LayerCodec(content, rope))
    _, names = write_codec(out, ModelCodec(f"raq {scheme}", tuple(codecs)))
    write_meta(out, {"format": 1, "scheme": scheme, "method": "raq", "group_size": 64, "sink": 4, "recent": 128,
                     "layer_schemes": names})  # fmt: skip
    return str(out)
