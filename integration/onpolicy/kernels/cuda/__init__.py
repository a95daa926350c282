"""The CUDA backend: Triton kernels with the CPU backend's API and guarantees.

Every kernel runs one fixed configuration whatever the batch, so a row's reduction order never
depends on M; `ops` is its surface, the CPU backend's primitive names. docs/exactness.md ("GPU
backend") has the tile sizes and why each op keeps its bits.
"""
