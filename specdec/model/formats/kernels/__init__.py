"""Our own C++ kernels, compiled on first use for the CPU at hand (see build.py)."""
