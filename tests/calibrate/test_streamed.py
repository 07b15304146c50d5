"""Layer-by-layer calibration (quantmla.calibrate.streamed) of a DeepSeek-V3-config FP8 checkpoint: the same export
as the in-memory path for every per-layer method, the same with the hidden states on disk, bit-for-bit resumption
after an interruption, the whole-model stages run where the model fits and said or refused where it does not, and
a peak memory that does not grow with the depth."""

import json
import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp8_checkpoints import write_v3_fp8_checkpoint
from quantmla.calibrate import calibrate_model
from quantmla.calibrate.api import export_changed
from quantmla.calibrate.streamed import StreamConfig, calibrate_streamed, prepare_streamed
from quantmla.models.loading import load_model

KW = dict(steps=3, model_steps=0, num_seqs=4, val_seqs=2, seq_len=32, batch_size=2)
SCHEMES = {"blockgtq": "c4r3t"}


def _windows(seed=0):
    return torch.randint(3, 500, (6, 32), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return write_v3_fp8_checkpoint(tmp_path_factory.mktemp("src") / "fp8", layers=3)


def _files(path: Path) -> dict[str, object]:
    """Every tensor of the export's safetensors files (codec included) and its quantmla.json's layers."""
    out = {}
    for f in sorted(path.rglob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out |= {f"{f.relative_to(path)}:{n}": st.get_tensor(n) for n in st.keys()}
    out["quantmla.json layers"] = json.loads((path / "quantmla.json").read_text())["layers"]
    return out


def _assert_same(a: Path, b: Path) -> None:
    fa, fb = _files(a), _files(b)
    assert fa.keys() == fb.keys()
    for k, v in fa.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == fb[k].dtype and torch.equal(v.view(torch.uint8), fb[k].view(torch.uint8)), k
        else:
            assert v == fb[k], k


@pytest.mark.parametrize("method", ["rtn", "quantmla", "smoothquant", "quarot", "raq", "rolaq", "blockgtq"])
def test_layer_by_layer_equals_in_memory(source, tmp_path, method):
    kw = dict(KW, method=method, scheme=SCHEMES.get(method, "c4r4"))
    report, wrote = calibrate_streamed(source, _windows(), tmp_path / "streamed", progress=False, **kw)
    model = load_model(source, dtype="float32")
    model, want = calibrate_model(model, None, _windows(), progress=False, **kw)
    export_changed(model, source, tmp_path / "memory", want)
    _assert_same(tmp_path / "streamed", tmp_path / "memory")
    assert report.layers == want.layers and report.weights_changed == want.weights_changed
    assert not (tmp_path / ".streamed.quantmla-work").exists()  # the work directory goes once the export is written


def test_hidden_states_on_disk_give_the_same_export(source, tmp_path):
    kw = dict(KW, method="quantmla", scheme="c2r4")
    calibrate_streamed(source, _windows(1), tmp_path / "cpu", progress=False, **kw)
    scratch = []

    def seen(idx):  # the activations wait on disk between layers, never all in memory
        scratch.append(sorted(p.name for p in (tmp_path / ".disk.quantmla-work" / "activations").iterdir()))

    calibrate_streamed(source, _windows(1), tmp_path / "disk", stream=StreamConfig(offload="disk"), progress=False,
                       on_layer=seen, **kw)  # fmt: skip
    _assert_same(tmp_path / "cpu", tmp_path / "disk")
    assert [len(s) for s in scratch] == [3] * 3  # 2 + 1 batches (calibration, held-out): the next layer's inputs
    assert all(n.endswith(f"layer{i + 1}.pt") for i, s in enumerate(scratch) for n in s)


class _Interrupt(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_same_export(source, tmp_path):
    kw = dict(KW, method="quantmla", scheme="c4r4")
    calibrate_streamed(source, _windows(2), tmp_path / "whole", progress=False, **kw)

    def stop_after_1(idx):
        if idx == 1:
            raise _Interrupt

    work = tmp_path / ".resumed.quantmla-work"
    with pytest.raises(_Interrupt):
        calibrate_streamed(source, _windows(2), tmp_path / "resumed", progress=False, on_layer=stop_after_1, **kw)
    assert sorted(p.name for p in work.glob("layer-*.pt")) == ["layer-000.pt", "layer-001.pt"]
    with pytest.raises(ValueError, match="pass --resume"):
        prepare_streamed(source, _windows(2), tmp_path / "resumed", **kw)
    with pytest.raises(ValueError, match="other config"):
        prepare_streamed(source, _windows(2), tmp_path / "resumed", stream=StreamConfig(resume=True),
                         **dict(kw, steps=4))  # fmt: skip
    with pytest.raises(ValueError, match="other data_sha256"):
        prepare_streamed(source, _windows(3), tmp_path / "resumed", stream=StreamConfig(resume=True), **kw)
    done = []
    calibrate_streamed(source, _windows(2), tmp_path / "resumed", stream=StreamConfig(resume=True), progress=False,
                       on_layer=done.append, **kw)  # fmt: skip
    assert done == [2]  # layers 0 and 1 were read back, not calibrated again
    _assert_same(tmp_path / "whole", tmp_path / "resumed")


def test_the_model_stage_runs_where_the_model_fits_and_is_skipped_where_not(source, tmp_path, caplog):
    kw = dict(KW, method="quantmla", scheme="c4r4", model_steps=2)
    report, _ = calibrate_streamed(source, _windows(), tmp_path / "fits", progress=False, **kw)
    model = load_model(source, dtype="float32")
    model, want = calibrate_model(model, None, _windows(), progress=False, **kw)
    export_changed(model, source, tmp_path / "memory", want)
    _assert_same(tmp_path / "fits", tmp_path / "memory")
    assert report.model_level is not None
    with caplog.at_level(logging.INFO, logger="quantmla.calibrate.streamed"):
        report, _ = calibrate_streamed(source, _windows(), tmp_path / "small", progress=False,
                                       stream=StreamConfig(memory_limit=1 << 20), **kw)  # fmt: skip
    assert "model-level stage needs the whole model" in caplog.text and "skipped" in caplog.text
    assert report.model_level is None and report.config.model_steps == 0
    assert json.loads((tmp_path / "small" / "quantmla.json").read_text())["model_level"] is None
    for method in ("quantmla-raq", "raq-alloc"):
        with pytest.raises(ValueError, match=f"method {method} needs the whole model"):
            prepare_streamed(source, _windows(), tmp_path / "refused", stream=StreamConfig(memory_limit=1 << 20),
                             **dict(kw, method=method, scheme="c2r4"))  # fmt: skip
    assert not (tmp_path / "refused").exists() and not (tmp_path / ".refused.quantmla-work").exists()


def test_raq_alloc_fits_layer_by_layer_and_allocates_as_in_memory(source, tmp_path):
    kw = dict(KW, method="raq-alloc", scheme="c2r4", steps=2)
    work = tmp_path / ".streamed.quantmla-work"
    kinds = []

    def fitted(idx):  # each layer's menu of fits is made (and kept) before the next layer is read
        kinds.append(sorted(torch.load(work / f"layer-{idx:03d}.pt", weights_only=False)["alloc_fits"]))

    report, _ = calibrate_streamed(source, _windows(4), tmp_path / "streamed", progress=False, on_layer=fitted, **kw)
    model = load_model(source, dtype="float32")
    model, want = calibrate_model(model, None, _windows(4), progress=False, **kw)
    export_changed(model, source, tmp_path / "memory", want)
    _assert_same(tmp_path / "streamed", tmp_path / "memory")
    assert report.allocation == want.allocation and report.layers == want.layers
    assert kinds == [[("content", "2"), ("content", "2g128"), ("content", "3g128"), ("rope", "3"), ("rope", "4")]] * 3
    with pytest.raises(ValueError, match="method quantmla takes none"):
        calibrate_model(load_model(source, dtype="float32"), None, _windows(4), progress=False, alloc_fits={},
                        **dict(kw, method="quantmla"))  # fmt: skip


OFFLOADS = {"quantmla": "cpu", "raq": "disk"}  # the inputs handed over from memory, and as linked files


@pytest.mark.parametrize("method", ["quantmla", "raq"])
def test_layers_calibrated_at_once_on_several_devices_give_the_one_device_export(source, tmp_path, method):
    # two processes on the host stand for two GPUs: the same inputs pass, the layers shared between them
    kw = dict(KW, method=method, scheme="c4r4")
    calibrate_streamed(source, _windows(5), tmp_path / "one", progress=False, **kw)
    finished, two = [], StreamConfig(devices=("cpu", "cpu"), offload=OFFLOADS[method])
    report, _ = calibrate_streamed(source, _windows(5), tmp_path / "two", progress=False, on_layer=finished.append,
                                   stream=two, **kw)  # fmt: skip
    _assert_same(tmp_path / "one", tmp_path / "two")
    assert sorted(finished) == [0, 1, 2] and [r["layer"] for r in report.layers] == [0, 1, 2]
    assert not (tmp_path / ".two.quantmla-work").exists()  # the layers' inputs went with the work directory


def test_bad_devices_are_refused_before_any_work():
    with pytest.raises(ValueError, match="two or more devices of one kind"):
        StreamConfig(devices=("cpu",))
    with pytest.raises(ValueError, match="'gpu7'"):
        StreamConfig(devices=("cpu", "gpu7"))


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3_halfrope_noqlora", "glm4_moe_lite"])
def test_every_streamed_family_equals_in_memory(tmp_path, family):
    # unquantised checkpoints of the other families, dense and MoE layers mixed (each layer built with its kind)
    from tiny_models import tiny_model

    tiny_model(family).save_pretrained(tmp_path / "src")
    windows = torch.randint(3, 100, (6, 32), generator=torch.Generator().manual_seed(0))
    kw = dict(KW, method="quantmla", scheme="c4r4", group_size=16)
    calibrate_streamed(tmp_path / "src", windows, tmp_path / "streamed", progress=False, **kw)
    model = load_model(tmp_path / "src", dtype="float32")
    model, want = calibrate_model(model, None, windows, progress=False, **kw)
    export_changed(model, tmp_path / "src", tmp_path / "memory", want)
    _assert_same(tmp_path / "streamed", tmp_path / "memory")


def test_a_model_type_that_cannot_be_streamed_is_refused(tmp_path):
    from tiny_models import tiny_model

    tiny_model("longcat_flash").save_pretrained(tmp_path / "longcat")
    with pytest.raises(ValueError, match="model_type 'longcat_flash' cannot be calibrated layer by layer"):
        prepare_streamed(tmp_path / "longcat", _windows(), tmp_path / "out", **dict(KW, method="rtn"))


PEAK = textwrap.dedent(
    """
    import sys, torch
    from quantmla.calibrate.streamed import calibrate_streamed, StreamConfig
    windows = torch.randint(3, 500, (6, 32), generator=torch.Generator().manual_seed(0))
    calibrate_streamed(sys.argv[1], windows, sys.argv[2], progress=False, method="quantmla", scheme="c4r4", steps=1,
                       model_steps=0, num_seqs=4, val_seqs=2, seq_len=32, batch_size=2)
    # this process's own peak (VmHWM): ru_maxrss would include the forking parent's resident set
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    print(int(status["VmHWM"].split()[0]) * 1024)
    """
)


def test_peak_memory_does_not_grow_with_the_depth(tmp_path):
    # layers of ~50 MB in float32 (16 experts of 1024): 4 more layers in memory would be ~200 MB more
    from quantmla.models.streaming import CheckpointLayers

    peaks, layer = {}, 0
    for n in (4, 8):
        src = write_v3_fp8_checkpoint(tmp_path / f"src{n}", layers=n, experts=16, moe_width=1024)
        layer = CheckpointLayers(src, "float32").layer_bytes(n - 1)
        run = subprocess.run([sys.executable, "-c", PEAK, str(src), str(tmp_path / f"out{n}")], capture_output=True,
                             text=True, check=True)  # fmt: skip
        peaks[n] = int(run.stdout.split()[-1])
    growth = peaks[8] - peaks[4]
    # observed (2-core x86 CPU, 2026-12-06): 4 -> 8 layers, peak RSS 725 -> 736 MiB (a layer: 53 MiB); with every
    # layer's candidate transforms kept in memory it was 733 -> 805 MiB
    print(f"peak RSS {peaks[4] / 2**20:.0f} MiB -> {peaks[8] / 2**20:.0f} MiB; a layer {layer / 2**20:.0f} MiB")
    assert growth <= layer, (growth, layer)


def test_the_cli_calibrates_layer_by_layer_with_progress(tmp_path):
    import shutil

    from typer.testing import CliRunner

    from quantmla.cli.main import app
    from quantmla.models.loading import builtin_path

    src = write_v3_fp8_checkpoint(tmp_path / "src", layers=2, vocab=8192)  # the bundled tokenizer's vocabulary
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(builtin_path("tiny-mla") / f, src / f)
    res = CliRunner().invoke(app, ["calibrate", str(src), "--out", str(tmp_path / "out"), "--sequential", "--offload",
                                   "disk", "--steps", "2", "--model-steps", "0", "--num-seqs", "2", "--val-seqs", "1",
                                   "--seq-len", "64"])  # fmt: skip
    assert res.exit_code == 0, res.output
    assert "layer by layer" in res.output and "2/2" in res.output  # the per-layer progress bar
    assert "tensors changed" in res.output and (tmp_path / "out" / "quantmla.json").is_file()
    for extra, message in ((["--devices", "cpu"], "two or more devices of one kind"),
                           (["--devices", "cpu,gpu7"], "'gpu7' is not a device name")):  # fmt: skip
        res = CliRunner().invoke(app, ["calibrate", str(src), "--out", str(tmp_path / "bad"), "--sequential", *extra])
        assert res.exit_code == 2 and message in res.output, res.output
    res = CliRunner().invoke(app, ["calibrate", str(src), "--out", str(tmp_path / "bad"), "--devices", "cpu,cpu"])
    assert res.exit_code == 2 and "apply to --sequential" in res.output, res.output
    assert not (tmp_path / "bad").exists()
