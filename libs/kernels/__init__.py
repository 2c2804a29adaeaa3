"""CUDA kernels for DeepSeek-V3 decode (Triton, optional FlashInfer), each with a plain-torch reference.

Modules: mla_decode (paged latent attention), fp8_gemm (block-scaled dense and grouped GEMMs), quant
(1x128 activation quantization, fused SwiGLU), routing (noaux_tc top-k), moe_ops (token permutation
for local experts), backend (device dispatch for the engine), flashinfer_mla (optional backend).
"""
