import triton
import triton.language as tl

@triton.jit
def kda_state_bwd_kernel(x):
    pass
