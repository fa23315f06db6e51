"""Triton kernels of the speculative path. Import submodules directly; kernels compile at first import."""
