"""ckpt-tools: streaming, CPU-only, exact checkpoint conversion for Megatron-core / HF / vLLM MoE models."""
__version__ = "0.1.0"
