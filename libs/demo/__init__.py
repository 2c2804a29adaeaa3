"""The trained demo model: a small DeepSeek-V3-architecture checkpoint (MLA, routed + shared experts,
noaux_tc gate, one MTP module) trained on CPython's own documentation, built on first use and cached."""
