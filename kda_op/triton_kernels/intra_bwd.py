import triton
import triton.language as tl

@triton.jit
def kda_intra_bwd_kernel(x):
    pass
