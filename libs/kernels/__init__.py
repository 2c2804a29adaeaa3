"""CUDA kernels for DeepSeek-V3 decode (Triton, optional FlashInfer), each with a plain-torch reference.

Modules: mla_decode (paged latent attention), fp8_gemm (block-scaled dense and grouped GEMMs; the dense and
masked layouts pick per shape between its Triton kernel and fp8_gemm_sm90's Gluon WGMMA kernel on Hopper),
quant (1x128 activation quantization, fused SwiGLU), fused (add+RMSNorm, optionally into FP8; RoPE + KV
write), routing (noaux_tc top-k), moe_ops (token permutation for local experts), backend (device dispatch for
the engine's FP8 modules), flashinfer_mla (optional MLA backend), fp8_rowwise (per-token x per-channel FP8),
gumbel (one-pass Gumbel-max temperature sampling), interpreter (Triton's CPU interpreter patched to match the GPU, for tests).
"""
