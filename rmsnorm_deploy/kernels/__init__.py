"""Fused RMSNorm kernels derived from the spec (Triton), tested against the torch reference."""
