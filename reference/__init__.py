"""NumPy reference: one function per CUDA kernel (same name, same arguments) and a whole Llama forward.

This package is the ground truth the kernels are tested against, and the engine's CPU backend. It follows
the project's numerics policy exactly: bf16 weights (uint16 bit patterns) widened to fp32, fp32 activations
and accumulation, a bf16 KV cache rounded to nearest even on write.
"""
