"""The onnxruntime backend: one runner per device over the exported graphs.

This file imports nothing heavy, so the config can name the cache places without loading onnxruntime.
"""

# Where the key/value caches live, one placement per device: working, host memory as the decoder's working
# batch (the CPU path, and the fallback where the captured step cannot run); fused, static device buffers
# stepped by the fused capturable decoder graph, one CUDA graph per row bucket (the CUDA path). auto: fused on
# CUDA where the variant can be captured, working everywhere else.
KV_CACHES = ("auto", "working", "fused")
