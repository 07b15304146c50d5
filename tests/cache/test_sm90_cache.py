"""QuantizedLatentCache at DeepSeek-V3's attention width with 128 heads on an sm_90 GPU: the kernel path reads the
pages with the sm_90a kernel (``backends_used()`` says so), and its teacher-forced decode logits stay within twice
the bf16 model's own error of a float32 torch-path run. GPU only."""

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

import quantmla
from quantmla.models.compat import cache_kwargs

pytest.importorskip("triton", reason="triton is an optional dependency (pip install 'quantmla[triton]')")
from quantmla.kernels.hopper import missing  # noqa: E402

REASON = missing() if torch.cuda.is_available() else "no CUDA device"
PROMPT, STEPS = 300, 3


def v3_width_model(dtype):
    cfg = DeepseekV3Config(vocab_size=256, hidden_size=256, num_attention_heads=128, num_key_value_heads=128,
                           kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=64,
                           num_hidden_layers=2, first_k_dense_replace=2, intermediate_size=128,
                           max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0.0, mod.in_features**-0.5)
    m = m.to(dtype).cuda().eval()
    quantmla.enable_latent_attention(m)
    return m


@torch.no_grad()
def logits(model, ids, cache):
    out = model(ids[:, :PROMPT], use_cache=True, **cache_kwargs(cache))
    steps = [out.logits[:, -1]]
    for t in range(PROMPT, PROMPT + STEPS):
        out = model(ids[:, t : t + 1], use_cache=True, **cache_kwargs(cache))
        steps.append(out.logits[:, -1])
    return torch.stack(steps, 1).double().cpu()


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=f"the sm_90a kernel needs {REASON}")
def test_the_cache_decodes_through_the_sm90_kernel_at_128_heads():
    ids = torch.randint(3, 256, (2, PROMPT + STEPS), generator=torch.Generator().manual_seed(1)).cuda()
    m16, m32 = v3_width_model(torch.bfloat16), v3_width_model(torch.float32)
    kw = dict(scheme="c4r4", group_size=64)
    ref = logits(m32, ids, quantmla.QuantizedLatentCache(m32.config, backend="torch", **kw))
    torch16 = logits(m16, ids, quantmla.QuantizedLatentCache(m16.config, backend="torch", **kw))
    cache = quantmla.QuantizedLatentCache(m16.config, backend="triton", **kw)
    got = logits(m16, ids, cache)
    assert cache.backends_used() == ["sm90", "sm90"]
    own = (torch16 - ref).abs().max()
    assert (got[:, 1:] - ref[:, 1:]).abs().max() <= 2 * own + 1e-3, ((got - ref).abs().max(), own)
