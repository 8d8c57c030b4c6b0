"""The decoding core: scheduler, engine loop, beam search, documents; no grpc, onnxruntime or prometheus."""
