"""Kernel building: compilers (nvcc, g++ for the CPU emulation) and the resource reports they print."""
