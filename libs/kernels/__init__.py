"""CUDA kernels for DeepSeek-V3 (Triton, Gluon on Hopper, optional FlashInfer), each with a plain-torch
reference. The engine reaches them through `backend` (device dispatch) and the attention backends;
docs/structure.md says what each module holds."""
