"""Modules built on the KDA ops: the attention layer and a small language model."""

from .layer import KDAPool, KDAState, KimiDeltaAttention, RMSNormGated, ShortConvolution
from .lm import KDABlock, KDALanguageModel

__all__ = ["KimiDeltaAttention", "ShortConvolution", "RMSNormGated", "KDAState", "KDAPool", "KDABlock",
           "KDALanguageModel"]
