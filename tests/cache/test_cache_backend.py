"""The cache's backend choice (logged, with its reason), page sizes, measured bytes, the keys/values
views, ``decode_backend`` and a decode step without GPU->CPU syncs, for both backends (the triton one
runs in Triton's interpreter on CPU)."""

import logging
import math
from types import SimpleNamespace

import pytest
import torch

import quantmla
from quantmla import QuantizedLatentCache
from quantmla.cache import kernel_layer
from quantmla.cache.kernel_layer import KernelLatentLayer, supports_kernel
from tiny_models import tiny_config

pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")

CFG = tiny_config("deepseek_v3")  # latent 128, RoPE 64, 4 heads, 2 layers
DC, DR, H = 128, 64, 4
LOGGER = "quantmla.cache.latent_cache"
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # where the triton backend's kernel can run


def tokens(b, n, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    c, r = torch.randn(b, 1, n, DC, generator=g), torch.randn(b, 1, n, DR, generator=g)
    return c.to(device, dtype), r.to(device, dtype)


def attend_args(B):
    g = torch.Generator().manual_seed(1)
    q_nope, q_pe = torch.randn(B, H, 1, 32, generator=g), torch.randn(B, H, 1, DR, generator=g)
    w_uk, w_uv = torch.randn(H, 32, DC, generator=g), torch.randn(H, 32, DC, generator=g)
    return q_nope.to(DEV, torch.bfloat16), q_pe.to(DEV, torch.bfloat16), w_uk.to(DEV), w_uv.to(DEV), 0.1


def latent_read(cache: QuantizedLatentCache) -> QuantizedLatentCache:
    """The cache, read as quantmla's latent attention reads it (which the kernel backend needs)."""
    cache.declare_latent_reader()
    return cache


def test_auto_logs_its_choice_once_per_cache(caplog):
    c, r = tokens(2, 5, torch.float32)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        cache = QuantizedLatentCache(CFG, scheme="c4r4")
        for step in range(3):
            for layer in range(2):
                cache.update(c[:, :, step : step + 1], r[:, :, step : step + 1], layer)
    lines = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    assert lines == ["quantmla cache c4r4: torch path: activations on cpu (the kernel runs on CUDA)"]
    assert cache.backends_used() == ["torch", "torch"]
    assert cache.backend_reasons() == ["torch path: activations on cpu (the kernel runs on CUDA)"] * 2
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=LOGGER):
        kc = latent_read(QuantizedLatentCache(CFG, scheme="c2r4", backend="triton"))
        kc.update(c.bfloat16(), r.bfloat16(), 0)
    assert [rec.getMessage() for rec in caplog.records] == [
        "quantmla cache c2r4: triton kernel: backend='triton' requested (cpu, bfloat16)"
    ]
    assert kc.backends_used() == ["triton", "-"] and kc.backend_reasons()[1] == "-"


@pytest.mark.parametrize(
    "scheme,dtype,page,backend,reason",
    [
        ("c4r4", torch.bfloat16, 64, "triton", "triton kernel (CUDA, bfloat16)"),
        ("c4r4", torch.float16, 64, "torch", "torch path: activations in float16 (the kernel needs bfloat16)"),
        ("fp8", torch.bfloat16, 64, "torch", "torch path: no kernel layout for this cache (scheme 'fp8': the kernel"),
        ("c8r8", torch.bfloat16, 64, "torch", "torch path: no kernel layout for this cache (scheme 'c8r8': the kernel"),
        ("c4r4", torch.bfloat16, 8, "torch", "torch path: no kernel layout for this cache (page_size=8;"),
    ],
)
def test_auto_on_cuda_picks_by_layout(scheme, dtype, page, backend, reason):
    cache = latent_read(QuantizedLatentCache(CFG, scheme=scheme, page_size=page))
    fake = SimpleNamespace(device=torch.device("cuda"), dtype=dtype)  # the decision reads device and dtype only
    got, why = cache._choose_backend(fake)
    assert got == backend and why.startswith(reason), why


def test_auto_never_picks_the_kernel_for_transformers_own_attention():
    """A kernel decode step returns only the new token: under transformers' attention (no latent reader)
    every answer would come from the newest token alone (seen on the H200 as constant NIAH outputs)."""
    fake = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    got, why = QuantizedLatentCache(CFG, scheme="c4r4")._choose_backend(fake)
    assert got == "torch" and "does not read the cache through quantmla's latent attention" in why
    c, r = tokens(1, 3, torch.bfloat16)
    with pytest.raises(ValueError, match="enable_latent_attention"):
        QuantizedLatentCache(CFG, scheme="c4r4", backend="triton").update(c, r, 0)


def test_latent_attention_declares_itself_the_reader():
    from quantmla.models.compat import cache_kwargs
    from tiny_models import tiny_model

    model = tiny_model("deepseek_v3")
    cfg = model.config
    fake = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    plain = QuantizedLatentCache(cfg, scheme="c4r4")
    model(torch.tensor([[1, 2, 3]]), use_cache=True, **cache_kwargs(plain))
    assert plain._choose_backend(fake)[0] == "torch"  # transformers' own attention read it
    quantmla.enable_latent_attention(model)
    latent = QuantizedLatentCache(cfg, scheme="c4r4")
    model(torch.tensor([[1, 2, 3]]), use_cache=True, **cache_kwargs(latent))
    assert latent._choose_backend(fake)[0] == "triton"


def test_only_no_kernel_layout_falls_back(monkeypatch):
    cfg = QuantizedLatentCache(CFG, scheme="c3r4").cache_config
    ok, why = supports_kernel(cfg)
    assert not ok and "INT3" in why
    assert supports_kernel(QuantizedLatentCache(CFG, scheme="c2r4").cache_config)[0]

    def broken(cfg):
        raise ValueError("a bug, not a missing layout")

    monkeypatch.setattr(kernel_layer, "kernel_layout", broken)
    with pytest.raises(ValueError, match="a bug"):  # never swallowed
        supports_kernel(cfg)


@pytest.mark.parametrize("page", [16, 32])
def test_triton_backend_honours_page_size(page):
    B, T, sink, recent = 2, 90, 2, 5
    c, r = tokens(B, T)
    cache = latent_read(
        QuantizedLatentCache(CFG, scheme="c4r4", sink=sink, recent=recent, page_size=page, backend="triton")
    )
    cache.update(c[:, :, :-1], r[:, :, :-1], 0)
    cache.update(c[:, :, -1:], r[:, :, -1:], 0)
    layer = cache.layers[0]
    assert layer.layout.page_size == page and layer.store.pages.shape[1] == page
    n_mid = T - sink - recent
    assert layer.free_page == B * math.ceil(n_mid / page)
    torch_cache = QuantizedLatentCache(CFG, scheme="c4r4", sink=sink, recent=recent, page_size=page, backend="torch")
    torch_cache.update(c, r, 0)
    assert torch.equal(layer.keys, torch_cache.layers[0].keys)  # the same stored tokens, read from pages


def _kernel_layer_bytes(layer: KernelLatentLayer) -> int:
    """Bytes of the distinct pages the block table maps, from the store's array shapes, plus the windows."""
    used = math.ceil(layer.n_mid / layer.layout.page_size)
    pages = torch.unique(layer.block_table[:, :used]).numel() if used else 0
    per_page = sum(t.shape[1:].numel() * t.element_size() for t in layer.store.tensors())
    windows = [layer.rec_c, layer.rec_r, *layer.sink_c.tensors.values(), *layer.sink_r.tensors.values()]
    return pages * per_page + sum(t.numel() * t.element_size() for t in windows)


@pytest.mark.parametrize("scheme", ["c4r4", "c2r4", "bf16"])
def test_bytes_are_measured_from_the_pages_in_use(scheme):
    B, T, page = 3, 150, 32
    c, r = tokens(B, T)
    kw = dict(scheme=scheme, sink=4, recent=16, page_size=page)
    kc, tc = (
        latent_read(QuantizedLatentCache(CFG, backend="triton", **kw)),
        QuantizedLatentCache(CFG, backend="torch", **kw),
    )
    for cache in (kc, tc):
        for i in range(2):
            cache.update(c[:, :, :100], r[:, :, :100], i)
            for t in range(100, T):  # the pool grows (and doubles) on the way
                cache.update(c[:, :, t : t + 1], r[:, :, t : t + 1], i)
    layer = kc.layers[0]
    assert layer.store.num_pages > layer.free_page  # the pool holds pages not handed out: not counted
    assert kc.layers[0].nbytes() == _kernel_layer_bytes(layer)
    assert kc.nbytes() == sum(_kernel_layer_bytes(lyr) for lyr in kc.layers)
    if scheme == "bf16":  # torch keeps every token unpaged; the kernel in whole BF16 pages
        assert 0 <= kc.nbytes() - tc.nbytes() < 2 * B * page * (DC + DR) * 2
    else:  # both hold the quantised middle in whole pages of the same format
        assert kc.nbytes() == tc.nbytes()
    assert kc.bytes_per_token() == kc.nbytes() / (2 * T * B)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scheme", ["bf16", "c4r4"])
def test_keys_and_values_are_the_cached_tokens(backend, scheme):
    B, T = 2, 60
    c, r = tokens(B, T)
    cache = latent_read(QuantizedLatentCache(CFG, scheme=scheme, sink=2, recent=8, page_size=16, backend=backend))
    assert cache.layers[0].keys is None
    cache.update(c, r, 0)
    layer = cache.layers[0]
    assert layer.keys.shape == (B, 1, T, DC) and layer.values.shape == (B, 1, T, DR)
    if scheme == "bf16":  # exactly what was stored
        assert torch.equal(layer.keys, c) and torch.equal(layer.values, r)
    else:  # what a decode step attends: sinks and recent as computed, the middle dequantised
        assert torch.equal(layer.keys[:, :, :2], c[:, :, :2]) and torch.equal(layer.keys[:, :, -8:], c[:, :, -8:])
        err = (layer.keys[:, :, 2:-8].float() - c[:, :, 2:-8].float()).abs()
        assert 0 < err.max() < 0.5
    with pytest.raises(AttributeError, match="read-only"):
        layer.keys = c


def test_decode_backend_only_after_a_kernel_decode_step():
    c, r = tokens(2, 30)
    kc = latent_read(QuantizedLatentCache(CFG, scheme="c4r4", sink=2, recent=4, page_size=16, backend="triton"))
    tc = QuantizedLatentCache(CFG, scheme="c4r4", sink=2, recent=4, page_size=16, backend="torch")
    for cache in (kc, tc):
        assert cache.decode_backend(0) is None
        cache.update(c[:, :, :20], r[:, :, :20], 0)
        assert cache.decode_backend(0) is None  # prefill returned every token
    out_c, _ = kc.update(c[:, :, 20:21], r[:, :, 20:21], 0)
    assert kc.decode_backend(0) is kc.layers[0] and out_c.shape[2] == 1  # only the new token came back
    assert kc.decode_backend(1) is None
    tc.update(c[:, :, 20:21], r[:, :, 20:21], 0)
    assert tc.decode_backend(0) is None
    kc.update(c[:, :, 21:23], r[:, :, 21:23], 0)
    assert kc.decode_backend(0) is None


@pytest.fixture
def no_syncs(monkeypatch):
    """Make every Python-level read of a tensor's value (a GPU->CPU sync on CUDA) raise; on a GPU also
    torch's own sync detection (``set_sync_debug_mode("error")``)."""

    def sync(*args, **kwargs):
        raise AssertionError("a GPU->CPU sync in the decode step")

    def arm():
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, sync)
        monkeypatch.setattr(torch, "equal", sync)
        if DEV == "cuda":
            torch.cuda.set_sync_debug_mode("error")

    yield arm
    if DEV == "cuda":
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scheme", ["c4r4", "fp8", "bf16"])
def test_decode_step_makes_no_sync(no_syncs, backend, scheme):
    if backend == "triton" and scheme == "fp8":
        pytest.skip("no kernel layout")
    B, T = 2, 40
    c, r = tokens(B, T, device=DEV)
    cache = latent_read(QuantizedLatentCache(CFG, scheme=scheme, sink=2, recent=4, page_size=16, backend=backend))
    for i in range(2):
        cache.update(c[:, :, :-3], r[:, :, :-3], i)  # prefill: checked (syncs allowed)
    mask = torch.ones(B, 1, 1, T - 2, dtype=torch.bool, device=DEV)
    mask[1, ..., :5] = False  # left padding of row 1
    args = attend_args(B)
    no_syncs()
    for i in range(2):  # a decode step: every layer's write (tokens leave the window: quantised) and attention
        cache.update(c[:, :, -3:-2], r[:, :, -3:-2], i)
        layer = cache.decode_backend(i)
        assert (layer is not None) == (backend == "triton")
        if layer is not None:
            out = layer.attend(*args, mask)
            assert out.shape == (B, 1, H, 32)


def test_validate_checks_every_token_only_when_asked():
    c, r = tokens(1, 30, torch.float32)
    bad_c = c[:, :, :1].clone()
    bad_c[..., 3] = float("nan")
    for validate in (False, True):
        cache = QuantizedLatentCache(CFG, scheme="c4r4", sink=0, recent=0, validate=validate)
        with pytest.raises(ValueError, match="content latent holds 1 NaN"):
            cache.update(torch.cat([c, bad_c], 2), torch.cat([r, r[:, :, :1]], 2), 0)  # prefill: always checked
        cache.update(c, r, 0)
        if validate:
            with pytest.raises(ValueError, match="content latent holds 1 NaN"):
                cache.update(bad_c, r[:, :, :1], 0)
        else:  # the decode step stores it unchecked (no sync)
            cache.update(bad_c, r[:, :, :1], 0)
    with pytest.raises(ValueError, match="validate='yes'"):
        QuantizedLatentCache(CFG, validate="yes")


def test_a_mask_that_is_not_left_padding_gives_nan_or_raises():
    B, T = 2, 30
    c, r = tokens(B, T, device=DEV)
    args = attend_args(B)
    mask = torch.ones(B, 1, 1, T + 1, dtype=torch.bool, device=DEV)
    mask[0, ..., 10] = False  # a hole: not a left padding
    for validate in (False, True):
        cache = latent_read(QuantizedLatentCache(CFG, scheme="c4r4", sink=2, recent=4, page_size=16,
                                                 backend="triton", validate=validate))  # fmt: skip
        cache.update(c, r, 0)
        cache.update(c[:, :, :1], r[:, :, :1], 0)
        if validate:
            with pytest.raises(NotImplementedError, match="left padding only"):
                cache.decode_backend(0).attend(*args, mask)
        else:
            out = cache.decode_backend(0).attend(*args, mask)
            assert torch.isnan(out[0]).all() and torch.isfinite(out[1]).all()


@pytest.mark.parametrize("scheme", ["bf16", "c4r4"])
def test_the_kernel_layer_reorders_rows_as_the_torch_layer(scheme):
    """Beam search's reorder, repeat and select on the paged layer: each row reads its source row's tokens, and
    tokens written after it land in the row's own pages (no two rows share one)."""
    B, T = 3, 70
    c, r = tokens(B, T + 40)
    kc = latent_read(QuantizedLatentCache(CFG, scheme=scheme, sink=2, recent=8, page_size=16, backend="triton"))
    tc = QuantizedLatentCache(CFG, scheme=scheme, sink=2, recent=8, page_size=16, backend="torch")

    def same():
        k, t = kc.layers[0], tc.layers[0]
        assert k.batch == t.batch and torch.equal(k.keys, t.keys) and torch.equal(k.values, t.values)

    for cache in (kc, tc):
        cache.update(c[:, :, :T], r[:, :, :T], 0)
        cache.reorder_cache(torch.tensor([2, 0, 0]))
    same()
    for t in range(T, T + 20):  # decode steps after the reorder: rows 1 and 2 part from here
        step = torch.arange(B)[:, None, None, None] + 1.0  # a different token in each row
        for cache in (kc, tc):
            cache.update((c[:, :, t : t + 1] * step).to(c.dtype), r[:, :, t : t + 1], 0)
    same()
    for cache in (kc, tc):
        cache.batch_repeat_interleave(2)
        cache.update(
            c[:, :, T + 20 : T + 40].repeat_interleave(2, 0), r[:, :, T + 20 : T + 40].repeat_interleave(2, 0), 0
        )
        cache.batch_select_indices(torch.tensor([5, 0]))
    same()
    assert kc.layers[0].block_table.shape[0] == 2


def test_beam_search_runs_through_the_kernel_backend():
    """``generate(num_beams=2)`` with the kernel backend (the default on CUDA for a BF16 model): the same beams as
    the torch backend on this model."""
    from quantmla.models.compat import cache_kwargs
    from tiny_models import tiny_model

    model = quantmla.enable_latent_attention(tiny_model("deepseek_v3", torch.bfloat16).to(DEV))
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(0)).to(DEV)
    outs = {}
    for backend in ("torch", "triton"):
        cache = QuantizedLatentCache(model.config, scheme="c4r4", sink=2, recent=8, page_size=16, backend=backend)
        outs[backend] = model.generate(ids, max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0,
                                       **cache_kwargs(cache))  # fmt: skip
        assert cache.backends_used() == [backend] * len(cache.layers)
    assert torch.equal(outs["torch"], outs["triton"])
