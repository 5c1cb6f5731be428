"""Weight quantization: AWQ and GPTQ int4 checkpoints (formats, configs, reference dequantization, linear methods)."""

from vllm_lite.quantization.packing import dequantize_awq, dequantize_gptq

__all__ = ["dequantize_awq", "dequantize_gptq"]
