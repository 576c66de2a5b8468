"""Triton (CUDA) kernels of the KDA ops, one module per stage of the chunked form
(DESIGN.md section 2; chunks of CHUNK_SIZE = 64 tokens, sub-blocks of 16):

forward   gam_fwd.py     gam = cumsum(g) per chunk (settings.INTRA_GAM_KERNEL)
          intra_a_fwd.py  (gam where gam_fwd.py is off) A_kk, A_qk, Qg, Kr (a separate
                         launch for steep chunks); where nothing is kept, gam on chip and
                         Kb for W (settings.INTRA_A_GAM_ON_CHIP)
          intra_wu_fwd.py Tm = (I + diag(beta) A_kk)^-1, W, U
          state_fwd.py   the scan over chunks: chunk states, residuals U' = U - W S0
          output_fwd.py  O = (Q exp(gam)) S0 + A_qk U'
          state_output_fwd.py  the two above in one pass (settings.FUSED_OUTPUT): the scan
                         writes O, and the chunk states and U' only where they are kept
backward  intra_a_fwd.py, intra_wu_fwd.py  recomputed, keeping Tm, unless the
                         forward kept them all (keep_intermediates)
          state_bwd.py   the reverse scan: dU', the grads of the chunk states, dh0
          intra_bwd_w.py back through the states and W: partial dq, dk, dg (per K slice)
          intra_bwd.py   dv, dbeta, dA_kk, dA_qk
          intra_bwd_a.py back through A_kk, A_qk: dq, dk, dg (parallel over K slices)
          intra_bwd_a_rows.py  the same by 16-row blocks, then dg, where fla's bounded gate
                         allows (settings.INTRA_BWD_A_ROW_PROGRAMS)
          gva_reduce.py  dq, dk summed from the value heads to the key heads
decode    recurrent_fwd.py  token by token, the state held on chip (fused_recurrent_kda; on a
                         state pool in place with POOL)
shared    _indexing.py   program index -> batch, heads, sequence start
host      fwd.py         allocation and launches of the chunked forward (kda_fwd_triton,
                         kda_fwd_triton_export)
          bwd.py         ... of the chunked backward (kda_bwd_triton)
          decode.py      ... of the recurrent kernel (kda_recurrent_fwd_triton, and on a
                         state pool: kda_recurrent_pool_triton)
          _host.py       helpers they share: block sizes, checks, intermediates layout
          settings.py    the tuning settings (warps, blocks, options), read at every call
"""

from .bwd import kda_bwd_triton
from .decode import kda_recurrent_fwd_triton, kda_recurrent_pool_triton
from .fwd import kda_chunk_pool_triton, kda_fwd_triton

__all__ = ["kda_fwd_triton", "kda_bwd_triton", "kda_recurrent_fwd_triton", "kda_recurrent_pool_triton",
           "kda_chunk_pool_triton"]
