//! Quantized CPU kernels.
