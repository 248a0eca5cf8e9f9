"""specedge.runtime: torch-free speculative decoding over static-shape bundles."""

__version__ = "0.1.0"
