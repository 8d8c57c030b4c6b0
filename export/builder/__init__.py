"""Inference graphs written node by node from model.safetensors and config.json, with onnx.helper: no torch."""
