"""What the ops promise about dtypes and chunking; shared by kernels and fake kernels."""

from __future__ import annotations

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
