"""The eval commands' cache: the option where given, else the model's quantmla.json, else the defaults."""

import pytest

from quantmla.cli.eval_cmd import CacheSettings, cache_settings

META = {"scheme": "c2r4", "sink": 2, "recent": 16, "group_size": 32}


def test_defaults_without_metadata():
    assert cache_settings(None, None, None, None, None) == CacheSettings(("bf16",), 4, 128, 64)


def test_metadata_fills_what_the_options_leave_open():
    assert cache_settings(META, None, None, None, None) == CacheSettings(("c2r4",), 2, 16, 32)
    assert cache_settings(META, "C4R4, bf16", 0, None, 64) == CacheSettings(("c4r4", "bf16"), 0, 16, 64)


def test_no_sink_recent_overrides_both():
    assert cache_settings(META, None, 3, 7, None, no_sink_recent=True) == CacheSettings(("c2r4",), 0, 0, 32)


@pytest.mark.parametrize("bad", [" , ", "c5r4"])
def test_bad_scheme_lists_are_refused(bad):
    with pytest.raises(ValueError, match="scheme"):
        cache_settings(None, bad, None, None, None)
