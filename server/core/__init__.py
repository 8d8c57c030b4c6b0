"""The decoding core: scheduler, engine loop, beam search and their events; no grpc, onnxruntime or prometheus."""
