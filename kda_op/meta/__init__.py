"""Fake (meta) kernels of the KDA ops: shapes, dtypes, devices and strides only.

Written with symbolic sizes and no branch on a size, so ``torch.compile(dynamic=True)``
and ``torch.export`` keep batch and sequence length dynamic.
"""

from .fake_kernels import chunk_kda_bwd_fake, chunk_kda_fwd_fake, fused_recurrent_kda_fwd_fake

__all__ = ["chunk_kda_fwd_fake", "chunk_kda_bwd_fake", "fused_recurrent_kda_fwd_fake"]
