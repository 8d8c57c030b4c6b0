"""Training the shipped model with PyTorch: the Transformer, batching, the training loop, the reference decoder,
evaluation; above the model-directory contract in model/, which never imports it."""
