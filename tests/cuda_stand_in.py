"""A base for the tests' stand-ins of a compiled cuda kernel module.

A stand-in implements the module's dense ``fwd`` / ``bwd`` (or ``decode``) in PyTorch so that
the cuda backend's host side (flash_dmattn/backends/cuda/kernels.py) can be tested without a
GPU. The host side also asks the module what it was built with; a stand-in of the dense
kernels answers as a module without gathered lists or key bits, with 64 x 64 tiles for every
operation.
"""


class DenseKernelModule:
    """The answers of a module whose only kernels are the dense ones."""

    def block_sizes(self):
        return 64, 64  # the forward's and the backward's tiles alike

    def fwd_gathers(self):
        return False

    def bwd_gathers(self):
        return False

    def bwd_key_bits(self):
        return False
