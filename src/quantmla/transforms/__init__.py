from quantmla.transforms.fuse import (
    ContentTransform,
    RopeTransform,
    fuse_content,
    fuse_rope,
    fuse_transforms,
    original_basis,
    random_orthogonal,
)

__all__ = [
    "ContentTransform",
    "RopeTransform",
    "fuse_content",
    "fuse_rope",
    "fuse_transforms",
    "original_basis",
    "random_orthogonal",
]
