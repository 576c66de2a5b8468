"""What the ops promise about dtypes and chunking; shared by kernels and fake kernels."""

from __future__ import annotations

import math

import torch

#: Floating dtypes the ops accept for every tensor argument.
SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
)

#: Tokens per chunk: the forward saves the state at every chunk boundary
#: (t = 0, C, 2C, ..., and T), and the backward recomputes the states inside one
#: chunk at a time from them.
CHUNK_SIZE: int = 64


def state_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the recurrent state for inputs q/k/v of ``input_dtype``.

    fp64 inputs keep the state in fp64 (so the reference can serve as an fp64
    oracle); every other dtype accumulates the state in fp32.
    """
    return torch.float64 if input_dtype == torch.float64 else torch.float32


def num_chunks(seq_len, chunk_size: int = CHUNK_SIZE):
    """ceil(seq_len / chunk_size), written without a branch so it stays symbolic."""
    return (seq_len + chunk_size - 1) // chunk_size


def num_chunk_boundaries(seq_len, chunk_size: int = CHUNK_SIZE):
    """How many states ``chunk_states`` holds: one entering each chunk, plus the
    final one. Besides being what the backward needs, this count is >= 2 for
    every T >= 1, which the compiler can prove from T's range; a size that could
    be 1 (like the chunk count alone) makes it guard on that size and recompile
    once T crosses one chunk."""
    return num_chunks(seq_len, chunk_size) + 1


def varlen_chunk_slots(seq_len, num_seqs, chunk_size: int = CHUNK_SIZE):
    """Chunks of N packed sequences of T tokens in all (``cu_seqlens``): at most
    ``T // C + N`` (each sequence's ceil(l / C) <= l // C + 1). Buffers with one
    entry per chunk take this bound, which needs no host sync; entries past the
    real count are unused."""
    return seq_len // chunk_size + num_seqs


def varlen_state_slots(seq_len, num_seqs, has_initial_state: bool = True, chunk_size: int = CHUNK_SIZE):
    """Chunk states of N packed sequences (``varlen_state_offsets`` says where each
    sequence's start). With initial states: each sequence's NC_n + 1 boundaries, at
    most ``T // C + 2 N`` in all. Without (training): only the states entering a
    sequence's chunks after its first (the first enters from zero, the final one is
    the op's final state), NC_n - 1 each, at most ``T // C`` in all (ceil(l / C) - 1
    <= l // C), plus two spare slots so that the count is provably >= 2 for a
    symbolic T (a size that could be 0 or 1 makes the compiler guard on it): at
    2048 sequences of 1-64 tokens and 16 heads 0.5 GiB instead of 2.5. Unused
    slots (past the last sequence's) are zero."""
    if has_initial_state:
        return seq_len // chunk_size + 2 * num_seqs
    return seq_len // chunk_size + 2


def varlen_state_offsets(lengths: list, has_initial_state: bool = True,
                         chunk_size: int = CHUNK_SIZE) -> tuple[list, int]:
    """For the layout of ``varlen_state_slots`` and N sequence lengths: ``(starts,
    first_unused)``, the slot of the state entering chunk 0 of each sequence (chunk
    c's at that + c) and where the unused slots begin. With initial states sequence
    n's boundaries start at ``chunk_offsets[n] + n`` (chunk_offsets[n]: the chunks
    of the sequences before n). Without, chunk c >= 1's state is at ``sum over m < n
    of max(NC_m - 1, 0) + c - 1``, so the start is one less (-1 for the first
    sequence: chunk 0's state is zero, neither stored nor read). Host integers (the
    reference's layout); the CUDA kernels form the same on the device
    (``triton_kernels._host._varlen_index``)."""
    starts, slot = [], 0
    for length in lengths:
        chunks = num_chunks(length, chunk_size)
        starts.append(slot if has_initial_state else slot - 1)
        slot += chunks + 1 if has_initial_state else max(chunks - 1, 0)
    return starts, slot


def chunked_kernels_serve(device_type: str, input_dtype: torch.dtype) -> bool:
    """Whether the chunked Triton kernels serve these inputs (else the einsum
    reference does): CUDA, and not fp64 (the kernels keep the state in fp32)."""
    return device_type == "cuda" and input_dtype != torch.float64


def scan_operand_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """dtype of W, Qg and Kr, which the CUDA scans and output kernel read once per
    chunk: bf16 for bf16 inputs (half the bytes, the range of fp32; the dots
    still run in TF32 on the upcast values), fp32 otherwise (fp16's range is too
    narrow for W = Tm diag(beta) K exp(gam))."""
    return torch.bfloat16 if input_dtype == torch.bfloat16 else torch.float32


# U and U' (the scan's input and residuals) in bf16 for bf16 inputs instead of
# fp32, as fla keeps them. On the H200 (2026-11-30, benchmarks/RESULTS.md) this
# took the B2-T8192-H8-HV32 forward 2.145 -> 2.065 ms: the output kernel and the
# forward scan are at the copy ceiling there and U, U' were 0.4 GB of their traffic
# in fp32. o and the final state kept their error to the fp64 reference. Both the
# CUDA kernels and the fake kernel's size of the kept intermediates read it: set it
# before anything is traced.
BF16_RESIDUALS = True


def residual_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """dtype of U = Tm diag(beta) V and U' = U - W S0 in the CUDA forward: fp32, or
    bf16 for bf16 inputs under ``BF16_RESIDUALS``."""
    return torch.bfloat16 if BF16_RESIDUALS and input_dtype == torch.bfloat16 else torch.float32


# The chunk states (the forward's third output, what the backward starts from) in
# bf16 for bf16 inputs where the CUDA kernels serve, instead of fp32, as fla keeps
# its h. At B2-T8192-H8-HV32 they are 0.54 GB in fp32, written by the scan and read
# by the output kernel; on the H200 (2026-11-30) bf16 took that forward 2.145 ->
# 2.063 ms alone and to 1.909 ms with BF16_RESIDUALS. The output kernel rounded
# them to bf16 already (OUTPUT_BF16_DOTS); the backward's dots read them rounded
# (dg's error to the fp64 reference 2e-4 -> 1.7e-3 with both, under the
# interpreter). The final state stays fp32. Read by the CUDA forward and the fake
# kernels: set it before anything is traced.
BF16_CHUNK_STATES = True


def chunk_states_dtype(input_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """dtype of ``chunk_kda_fwd``'s chunk states: ``state_dtype``, or bf16 for bf16
    inputs on the chunked CUDA kernels under ``BF16_CHUNK_STATES``."""
    if BF16_CHUNK_STATES and input_dtype == torch.bfloat16 and chunked_kernels_serve(device_type, input_dtype):
        return torch.bfloat16
    return state_dtype(input_dtype)


# A_qk (the chunk's lower-triangular Q-K block, read by the forward's output
# kernel and the backward's scan) in bf16 for bf16 inputs instead of fp32. The
# output kernel rounded it to bf16 for its dot already (o unchanged); the
# backward's dots read it rounded. 134 MB less written and read at
# B2-T8192-H8-HV32: on the H200 (2026-11-30, same process) forward 1.898 ->
# 1.883 ms, forward+backward 7.988 -> 7.917 (B1: 0.636 -> 0.630, 2.524 -> 2.508).
# Read by the CUDA kernels and the fake kernel's size of the kept intermediates:
# set it before anything is traced.
BF16_AQK = True


def aqk_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """dtype of A_qk in the CUDA forward: fp32, or bf16 for bf16 inputs under
    ``BF16_AQK``."""
    return torch.bfloat16 if BF16_AQK and input_dtype == torch.bfloat16 else torch.float32


# A_kk (the chunk's strictly lower K-K block, read by the forward's diag_inv and
# intra_wu_fwd, and by the backward's intra_bwd for dbeta) in bf16 for bf16 inputs
# instead of fp32, in the kept intermediates and where it lives only inside the forward
# alike, so that a forward that keeps nothing gives the bits of one that keeps. The Tm
# dots read it at TF32 already; fla keeps its inverse in bf16. Built 2026-12-06: on an H100
# (ours alone) its no-grad form took the B8-T8192-H16 forward 2.773 -> 2.732 ms; the
# training step is not timed. Read by the CUDA kernels and the fake kernel's size of the
# kept intermediates: set it before anything is traced.
BF16_AKK = False


# Tm = (I + diag(beta) A_kk)^-1 as the backward reads it (the kept intermediates' Tm, and the
# backward's recompute) in bf16 for bf16 inputs instead of fp32, as fla keeps its inverse:
# half its bytes where the forward stores it and where intra_bwd_w and intra_bwd read it,
# and with dU' in bf16 too (settings.BF16_DUP) intra_bwd's Tm^T dU' on bf16 operands, which
# then needs no fp32 copy of dU'. The forward's own W and U take Tm from registers (fp32),
# unchanged. Built 2026-12-07 (forty-sixth session), untimed (no device time was left).
# Read by the CUDA kernels and the fake kernel's size of the kept intermediates: set it
# before anything is traced.
BF16_TM = False


# The storage-dtype switches above, by name: what the benchmarks' --variants and the tests'
# KDA_TEST_SETTINGS may change here besides settings.py.
STORAGE_SETTINGS = ("BF16_RESIDUALS", "BF16_CHUNK_STATES", "BF16_AQK", "BF16_AKK", "BF16_TM")


def akk_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """dtype of A_kk in the CUDA forward: fp32, or bf16 for bf16 inputs under
    ``BF16_AKK``."""
    return torch.bfloat16 if BF16_AKK and input_dtype == torch.bfloat16 else torch.float32


def tm_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """dtype of the stored Tm in the CUDA forward and backward: fp32, or bf16 for bf16
    inputs under ``BF16_TM``."""
    return torch.bfloat16 if BF16_TM and input_dtype == torch.bfloat16 else torch.float32


def _round_up(nbytes, multiple: int = 256):
    return (nbytes + multiple - 1) // multiple * multiple


def intermediates_layout(B, T, HV, K, V, input_dtype: torch.dtype, device_type: str, num_seqs=None):
    """Where the chunked CUDA forward keeps its intra-chunk quantities for the
    backward (``chunk_kda_fwd(..., keep_intermediates=True)``), inside one flat
    uint8 tensor: a list of ``(name, shape, dtype, byte offset)`` and the total
    number of bytes. Each piece starts on a 256-byte boundary. Empty (0 bytes)
    where the reference serves the op, which keeps none. Sizes may be symbolic.

      gam  [B, T, HV, K] fp32      cumulative log decay in each chunk
      akk, aqk, tm  [B, T, HV, C] fp32   the chunk's A_kk, A_qk and (I + diag(beta) A_kk)^-1
                                   (akk_dtype, aqk_dtype, tm_dtype: bf16 for bf16 inputs
                                   under BF16_AKK, BF16_AQK, BF16_TM)
      u    [B, T, HV, V] fp32      Tm diag(beta) V        (residual_dtype: bf16 for bf16 inputs)
      up   [B, T, HV, V] fp32      U - W S0, the residuals of the forward's scan (likewise)
      qg, kr, w  [B, T, HV, K]     what the scans read, bf16 for bf16 inputs else fp32
      steep [B, NC, HV] int32      each chunk's path: 0 split at its middle row; 1, 2 steep
                                   (intra_a_fwd.py: block references, or the steep launch)

    ``num_seqs``: N packed sequences (``cu_seqlens``, B = 1): NC (steep's chunk
    count) is then the bound ``varlen_chunk_slots(T, N)``.
    """
    if not chunked_kernels_serve(device_type, input_dtype):
        return [], 0
    NC = num_chunks(T) if num_seqs is None else varlen_chunk_slots(T, num_seqs)
    C = CHUNK_SIZE
    operand = scan_operand_dtype(input_dtype)
    pieces = [
        ("gam", (B, T, HV, K), torch.float32),
        ("akk", (B, T, HV, C), akk_dtype(input_dtype)),
        ("aqk", (B, T, HV, C), aqk_dtype(input_dtype)),
        ("tm", (B, T, HV, C), tm_dtype(input_dtype)),
        ("u", (B, T, HV, V), residual_dtype(input_dtype)),
        ("up", (B, T, HV, V), residual_dtype(input_dtype)),
        ("qg", (B, T, HV, K), operand),
        ("kr", (B, T, HV, K), operand),
        ("w", (B, T, HV, K), operand),
        ("steep", (B, NC, HV), torch.int32),
    ]
    layout, offset = [], 0
    for name, shape, dtype in pieces:
        layout.append((name, shape, dtype, offset))
        offset = offset + _round_up(math.prod(shape) * dtype.itemsize)
    return layout, offset

