"""The settings of a GQA/MHA -> MLA conversion (MLAfication), validated on creation."""

from __future__ import annotations

from dataclasses import dataclass

#: how the kept RoPE pairs are chosen: every c-th pair (DeepSeek's schedule, exportable) or per KV head by
#: E||q_pair|| * E||k_pair|| (MHA2MLA's 2-norm score; not expressible in DeepSeek's one shared RoPE key)
ROPE_CHOICES = ("uniform", "contribution")
#: the low-rank factorisation of [W_k,nope; W_v]: weighted by the inputs' second moment, by it and by what the error
#: costs downstream (a key's error through the group's queries' second moment, as a score error; a value's through
#: the group's W_o blocks, as an output error), or of the weights alone
SVD_CHOICES = ("activation", "functional", "weight")
#: one latent for keys and values of every KV head, or two halves (keys, values) factorised apart
LATENT_CHOICES = ("joint", "split")
#: Qwen3's per-head key RMSNorm: a fitted constant per layer and KV head folded into W_k, or left out (the gain
#: alone folded; the ablation)
KNORM_CHOICES = ("calibrated", "gain-only")
#: DeepSeek's latent RMSNorm (``kv_a_layernorm``, always applied): made linear (the pre-norm latent scaled far below
#: the norm's epsilon, the gain scaled back: the norm divides by ~sqrt(eps), a constant) or a plain RMSNorm whose
#: gain is the latent's mean RMS (each token's latent rescaled to that RMS)
LATENT_NORM_CHOICES = ("linear", "rms")


@dataclass(frozen=True)
class ConvertConfig:
    """``rope_pairs`` RoPE pairs a KV head keeps (the rest become NoPE); ``latent_rank`` the latent's width
    (DeepSeek's ``kv_lora_rank``). Calibration: ``num_seqs`` sequences of ``seq_len`` tokens."""

    rope_pairs: int
    latent_rank: int
    rope: str = "uniform"
    svd: str = "activation"
    latent: str = "joint"
    knorm: str = "calibrated"
    latent_norm: str = "linear"
    damping: float = 0.01  # of the second moment's mean diagonal, added before its inverse square root
    num_seqs: int = 32
    seq_len: int = 512
    batch_size: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name, value, valid in (
            ("rope", self.rope, ROPE_CHOICES),
            ("svd", self.svd, SVD_CHOICES),
            ("latent", self.latent, LATENT_CHOICES),
            ("knorm", self.knorm, KNORM_CHOICES),
            ("latent_norm", self.latent_norm, LATENT_NORM_CHOICES),
        ):
            if value not in valid:
                raise ValueError(f"{name}={value!r}; valid: {', '.join(valid)}")
        if self.rope_pairs < 1:
            raise ValueError(f"rope_pairs={self.rope_pairs} must be >= 1")
        if self.latent_rank < 1:
            raise ValueError(f"latent_rank={self.latent_rank} must be >= 1")
        if self.latent == "split" and self.latent_rank % 2:
            raise ValueError(f"latent_rank={self.latent_rank} must be even with latent='split' (keys and values)")
        if not 0 <= self.damping < 1:
            raise ValueError(f"damping={self.damping} must lie in [0, 1)")
        for name in ("num_seqs", "seq_len", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")

    def check_dims(self, head_dim: int, num_kv_heads: int, inputs: int) -> None:
        """Refuse pair counts and ranks the source's heads cannot give (before any work); ``inputs`` is the
        attention's input width (hidden size, + 1 where keys or values have biases)."""
        pairs = head_dim // 2
        if self.rope_pairs > pairs:
            raise ValueError(
                f"rope_pairs={self.rope_pairs}: a head of {head_dim} has {pairs} pairs; valid: 1 .. {pairs}"
            )
        if self.rope == "uniform" and pairs % self.rope_pairs:
            divisors = [r for r in range(1, pairs) if pairs % r == 0]
            raise ValueError(
                f"rope_pairs={self.rope_pairs} with rope='uniform' must divide the head's {pairs} pairs; "
                f"valid: {', '.join(map(str, divisors))}"
            )
        rows = num_kv_heads * (head_dim - 2 * self.rope_pairs + head_dim)
        k_rows = num_kv_heads * (head_dim - 2 * self.rope_pairs)
        most = min(rows, inputs) if self.latent == "joint" else 2 * min(k_rows, inputs)
        if self.latent_rank > most:
            raise ValueError(
                f"latent_rank={self.latent_rank} is larger than the rank of [W_k,nope; W_v] can be ({rows} rows, "
                f"{inputs} inputs, {num_kv_heads} KV heads); valid: 1 .. {most}"
            )
