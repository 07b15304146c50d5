"""Function-preserving transforms of the two cached paths, fused into the weights (METHOD.md section 3).

Content path, per attention module: an orthogonal ``R`` (d_c x d_c) and positive scales ``s``:

* latent rows of ``kv_a_proj_with_mqa``: ``W_y <- R^T W_y`` (bias ``b_y <- b_y R``); RMS is kept;
* ``kv_a_layernorm.weight <- s``;
* every head of ``kv_b_proj``: ``W_UK,h <- W_UK,h diag(g) R S^-1`` and the same for ``W_UV,h``,

so the cached latent becomes ``c' = c diag(g)^-1 R S`` and every product with it is unchanged. With
``R = diag(sign g)`` and ``S = |g|`` (the *original-basis identity*) the cache is ``c`` itself and the
fused weights equal the original ones bit for bit, up to the sign of the latent rows where ``g < 0``.

RoPE path: ``B = blockdiag(sigma_i Rot(phi_i))`` over the frequency pairs RoPE rotates (in the
projection rows' pair layout), which commutes with every RoPE rotation. The key's RoPE rows get ``B``
(``W_r <- B^T W_r``), each head's query RoPE rows ``B^-T`` (``W_q <- B^-1 W_q``), so ``q . k`` is
unchanged and the cached key becomes ``k^R B`` (in the cache's pair layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from quantmla.models.adapter import MLAAdapter, get_adapter


@dataclass
class ContentTransform:
    rotation: torch.Tensor  # [d_c, d_c] orthogonal
    scales: torch.Tensor  # [d_c] positive

    def __post_init__(self) -> None:
        d = self.rotation.shape[0]
        if self.rotation.shape != (d, d) or self.scales.shape != (d,):
            raise ValueError(f"rotation {tuple(self.rotation.shape)} and scales {tuple(self.scales.shape)} mismatch")
        if not bool((self.scales > 0).all()):
            raise ValueError("content scales must be positive")
        eye = torch.eye(d, dtype=torch.float64, device=self.rotation.device)
        err = (self.rotation.double() @ self.rotation.double().T - eye).abs().max().item()
        if err > 1e-4:
            raise ValueError(f"rotation is not orthogonal (max |R R^T - I| = {err:.2e})")


def original_basis(gain: torch.Tensor) -> ContentTransform:
    """``R = diag(sign g)``, ``S = |g|`` for the latent gain ``g``: the fused cache is ``c`` itself (the identity).

    ``R = I``, ``S = 1`` is not the identity of the cache: it divides the gain out (the cache ``c / g``).
    """
    g = gain.detach().double().cpu()  # transforms live on the CPU in float64, like every other candidate
    if bool((g == 0).any()):
        zeros = torch.nonzero(g == 0).flatten().tolist()
        raise ValueError(f"the latent gain is 0 in channels {zeros[:8]}: no transform of the cached basis exists")
    return ContentTransform(torch.diag(torch.sign(g)), g.abs())


@dataclass
class RopeTransform:
    angles: torch.Tensor  # [d_r / 2] phi_i
    log_scales: torch.Tensor  # [d_r / 2] log sigma_i

    def blocks(self) -> torch.Tensor:
        """``[d_r/2, 2, 2]`` blocks sigma_i Rot(phi_i) (row-vector convention: v @ M)."""
        c, s = torch.cos(self.angles), torch.sin(self.angles)
        rot = torch.stack([torch.stack([c, s], -1), torch.stack([-s, c], -1)], -2)
        return rot * torch.exp(self.log_scales)[:, None, None]

    def matrix(self, pairs: torch.Tensor, inverse_transpose: bool = False) -> torch.Tensor:
        """The d_r x d_r matrix acting on channel pairs ``pairs [d_r/2, 2]``."""
        m = self.blocks() if not inverse_transpose else RopeTransform(self.angles, -self.log_scales).blocks()
        d = 2 * pairs.shape[0]
        out = torch.zeros(d, d, dtype=m.dtype, device=m.device)
        for a in range(2):
            for b in range(2):
                out[pairs[:, a], pairs[:, b]] = m[:, a, b]
        return out

    def inverse_matrix(self, pairs: torch.Tensor) -> torch.Tensor:
        """``B^-1`` (maps the cached ``k B`` back to ``k``)."""
        return self.matrix(pairs, inverse_transpose=True).T


@torch.no_grad()
def fuse_content(adapter: MLAAdapter, attn: nn.Module, t: ContentTransform) -> None:
    proj = adapter.kv_a_proj(attn)
    rows = adapter.latent_rows(attn)
    w = proj.weight
    r = t.rotation.to(w.device, torch.float64)
    w[rows] = (r.T @ w[rows].double()).to(w.dtype)
    if proj.bias is not None:
        proj.bias[rows] = (proj.bias[rows].double() @ r).to(proj.bias.dtype)
    norm = adapter.kv_norm(attn)
    g = norm.weight.double().clone()
    sc = t.scales.to(w.device, torch.float64)
    norm.weight.copy_(sc.to(norm.weight.dtype))
    # diag(g) R S^-1 entry-wise (g_i R_ij / s_j): the original-basis identity (R = diag(sign g), S = |g|)
    # gives exactly the identity, so fusing it leaves kv_b_proj bit-identical in any dtype
    right = r * g[:, None] / sc[None, :]  # [d_c, d_c]
    for view in (adapter.w_uk(attn), adapter.w_uv(attn)):
        view.copy_((view.double() @ right).to(view.dtype))


@torch.no_grad()
def fuse_rope(adapter: MLAAdapter, attn: nn.Module, t: RopeTransform, config) -> None:
    pairs = adapter.rope_layout(config).weight_pairs(attn.qk_rope_head_dim).to(t.angles.device)
    dev = adapter.kv_a_proj(attn).weight.device
    b = t.matrix(pairs).to(dev, torch.float64)
    b_it = t.matrix(pairs, inverse_transpose=True).to(dev, torch.float64)
    proj = adapter.kv_a_proj(attn)
    rows = adapter.rope_rows(attn)
    proj.weight[rows] = (b.T @ proj.weight[rows].double()).to(proj.weight.dtype)
    if proj.bias is not None:
        proj.bias[rows] = (proj.bias[rows].double() @ b).to(proj.bias.dtype)
    q = adapter.q_proj(attn)
    for head_rows in adapter.q_rope_rows(attn):  # q' = q B^-T  <=>  W_q <- (B^-T)^T W_q
        q.weight[head_rows] = (b_it.T @ q.weight[head_rows].double()).to(q.weight.dtype)


def fuse_transforms(model: nn.Module, content: dict | None = None, rope: dict | None = None) -> nn.Module:
    """Fuse per-module transforms (keyed by cache index) into ``model``'s weights, in place."""
    adapter = get_adapter(model)
    modules = dict(adapter.attention_modules(model))
    for idx in list((content or {}).keys()) + list((rope or {}).keys()):
        if idx not in modules:
            raise ValueError(f"no attention module with cache index {idx}; valid: {sorted(modules)}")
    for idx, t in (content or {}).items():
        fuse_content(adapter, modules[idx], t)
    for idx, t in (rope or {}).items():
        fuse_rope(adapter, modules[idx], t, model.config)
    return model


def random_orthogonal(d: int, generator: torch.Generator | None = None, dtype=torch.float64) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(dtype)


def polar_factor(r: torch.Tensor) -> torch.Tensor:
    """The orthogonal polar factor ``r (rᵀ r)^(-1/2)`` of a nearly orthogonal ``r`` (the rotation a learned
    ``matrix_exp`` gives, re-orthogonalised against its rounding): the ``u vᵀ`` of its SVD, computed through the
    symmetric eigendecomposition of ``rᵀ r``, since LAPACK's SVD can fail to converge on a matrix whose singular values
    all cluster at 1."""
    lam, w = torch.linalg.eigh(r.mT @ r)
    return r @ (w * lam.rsqrt()) @ w.mT
