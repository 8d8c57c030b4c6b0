"""The onnxruntime backend: runners over the exported graphs, caches on the host or the device.

This file imports nothing heavy, so the config can name the cache places without loading onnxruntime.
"""

KV_CACHES = ("auto", "host", "working", "device")  # where the key/value caches live; auto: device memory on cuda
