"""The onnxruntime backend: runners over the exported graphs, caches on the host or the device.

This file imports nothing heavy, so the config can name the cache places without loading onnxruntime.
"""

# Where the key/value caches live; auto: device memory on cuda. static: device buffers stepped by the capturable
# decoder graph, one CUDA graph per row bucket; fused: the same, stepped by its build from fused contrib ops.
KV_CACHES = ("auto", "host", "working", "device", "static", "fused")
