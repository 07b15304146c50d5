"""Which scheme the vLLM plugin serves: sources, agreement, errors (no vLLM needed)."""

import pytest

from quantmla.formats.export import write_meta
from quantmla.serving.vllm.selection import select


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
