"""Triton (CUDA) kernels of the KDA ops, one module per stage.

Empty until the CUDA kernels land: until then the ops have no CUDA kernel, and
calling them on CUDA tensors raises NotImplementedError from the dispatcher
rather than falling back to another device.
"""
