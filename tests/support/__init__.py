"""What the test rooms share: helpers, plug-in models, encoders and tokenizers named in configs, the torchrun probe; no tests."""
