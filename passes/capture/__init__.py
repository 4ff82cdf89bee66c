"""Capture: an ``nn.Module`` and example inputs become an aten-level ``torch.fx`` graph."""
