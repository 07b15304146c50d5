"""How the cache is stored: the scheme of each path (:mod:`~quantmla.formats.scheme`), per-layer codecs
(:mod:`~quantmla.formats.codec`), bit packing (:mod:`~quantmla.formats.packing`), one path's stored fields
(:mod:`~quantmla.formats.paths`), one token's record (:mod:`~quantmla.formats.records`), the window policy
(:mod:`~quantmla.formats.windows`) and the export's metadata (:mod:`~quantmla.formats.export`). The cache, the
kernels' pages and the engines' pages all take their layout from here."""

from quantmla.formats.codec import LayerCodec, ModelCodec, PathCodec
from quantmla.formats.paths import PathLayout
from quantmla.formats.records import RecordLayout
from quantmla.formats.scheme import CacheScheme, PathFormat, parse_scheme, valid_scheme_names
from quantmla.formats.windows import WindowPolicy

__all__ = [
    "CacheScheme",
    "LayerCodec",
    "ModelCodec",
    "PathCodec",
    "PathFormat",
    "PathLayout",
    "RecordLayout",
    "WindowPolicy",
    "parse_scheme",
    "valid_scheme_names",
]
