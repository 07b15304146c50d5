"""quantmla's fused CPU decode (a C++ extension JIT-built on first use; :mod:`quantmla.kernels.cpu.build`)."""
