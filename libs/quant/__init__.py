"""Number formats shared by the engine, the kernels and EP dispatch (torch only, no Triton): fp8.py."""
