"""Quantizers: the codecs, kernels, schemes, 8-bit states and quantized collectives."""
