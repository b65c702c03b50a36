"""Triton kernels (each with a torch reference in specdec/ and a test comparing them)."""
