"""Qwen2.5-VL image preprocessing without ``transformers``: smart resize within pixel bounds, normalise, patchify.

Same math as ``transformers``' ``Qwen2VLImageProcessor``: the image is resized (bicubic) so that both sides are
multiples of ``patch_size * spatial_merge_size`` and its area lies within ``[min_pixels, max_pixels]`` while the
aspect ratio is kept; pixels are scaled to [0, 1] and normalised with the CLIP mean/std; a still image is repeated
``temporal_patch_size`` times and cut into patches flattened as (channels, frames, patch, patch), ordered
merge-block-major, which is what the vision tower's patch embedding and merger expect.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_flagscale.models.qwen2_5_vl.config import VisionConfig

__all__ = ["CLIP_MEAN", "CLIP_STD", "ImageProcessor"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(kw_only=True)
class ImageProcessor:
    """Image -> ``(pixel_values [n_patches, C*T*P*P], grid_thw (t, h, w))`` for one image."""

    patch_size: int = 14
    """Patch side (pixels)."""
    spatial_merge_size: int = 2
    """Patches merged per side into one LLM token."""
    temporal_patch_size: int = 2
    """Frames per patch; a still image is repeated."""
    min_pixels: int = 56 * 56
    """Smallest image area after resizing."""
    max_pixels: int = 28 * 28 * 1280
    """Largest image area after resizing (bounds the image-token count: ``max_pixels / 28^2``)."""

    def __post_init__(self) -> None:
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"Need 0 < min_pixels <= max_pixels, got {self.min_pixels} and {self.max_pixels}.")
        if self.max_pixels < self.factor**2:
            raise ValueError(f"max_pixels={self.max_pixels} is below one merged patch ({self.factor}x{self.factor}).")

    @classmethod
    def for_vision(cls, vision: VisionConfig, **bounds: int) -> ImageProcessor:
        return cls(
            patch_size=vision.patch_size, spatial_merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size, **bounds,
        )  # fmt: skip

    @property
    def factor(self) -> int:
        return self.patch_size * self.spatial_merge_size

    def target_size(self, height: int, width: int, name: str = "image") -> tuple[int, int]:
        """Qwen2-VL ``smart_resize``: sides multiples of ``factor``, area within the pixel bounds."""
        if height < self.patch_size or width < self.patch_size:
            raise ValueError(
                f"{name}: the image is {width}x{height} pixels, smaller than one {self.patch_size}x{self.patch_size} "
                "patch; use a larger image."
            )
        if max(height, width) / min(height, width) > 200:
            raise ValueError(f"{name}: aspect ratio {width}x{height} is above 200; crop the image.")
        f = self.factor
        h, w = max(f, round(height / f) * f), max(f, round(width / f) * f)
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def __call__(self, image, name: str = "image") -> tuple[Tensor, tuple[int, int, int]]:
        """A PIL image (any mode) or an ``uint8`` array [H, W, 3]."""
        array = self._resized_rgb(image, name)
        pixels = (array.astype(np.float32) / 255.0 - np.array(CLIP_MEAN, np.float32)) / np.array(CLIP_STD, np.float32)
        return self.patchify(torch.from_numpy(pixels).permute(2, 0, 1))

    def patchify(self, chw: Tensor) -> tuple[Tensor, tuple[int, int, int]]:
        """[C, H, W] normalised image (sides multiples of ``factor``) -> flattened patches and the grid."""
        c, height, width = chw.shape
        p, m, t = self.patch_size, self.spatial_merge_size, self.temporal_patch_size
        gh, gw = height // p, width // p
        frames = chw.unsqueeze(0).expand(t, c, height, width)
        patches = frames.reshape(1, t, c, gh // m, m, p, gw // m, m, p).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
        return patches.reshape(gh * gw, c * t * p * p).contiguous(), (1, gh, gw)

    def _resized_rgb(self, image, name: str) -> np.ndarray:
        from PIL import Image

        if isinstance(image, np.ndarray):
            image = Image.fromarray(image)
        image = image.convert("RGB")
        h, w = self.target_size(image.height, image.width, name)
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        return np.asarray(image)
