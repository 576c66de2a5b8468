"""kda-op: Kimi Delta Attention as a first-class PyTorch 2 operator.

``chunk_kda`` (training, prefill) and ``fused_recurrent_kda`` (decoding) follow
flash-linear-attention's call convention. Its forward and
backward are the ops ``torch.ops.kda_op.chunk_kda_fwd`` / ``chunk_kda_bwd``, with
fake kernels and registered autograd, so ``torch.compile(fullgraph=True)`` and
``torch.export`` trace through them.
"""

from ._contract import CHUNK_SIZE
from .api import chunk_kda, fused_recurrent_kda

__all__ = ["chunk_kda", "fused_recurrent_kda", "CHUNK_SIZE"]
__version__ = "0.1.0"
