"""The gRPC edge: servicer, interceptors, status mapping, config, health, metrics and the entrypoint."""
