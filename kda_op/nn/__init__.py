"""Modules built on the KDA ops: the attention layer and a small language model."""

from .layer import KDAState, KimiDeltaAttention, ShortConvolution
from .lm import KDABlock, KDALanguageModel

__all__ = ["KimiDeltaAttention", "ShortConvolution", "KDAState", "KDABlock", "KDALanguageModel"]
