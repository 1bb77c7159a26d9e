"""Tidal's in-pod elastic training agent (PyTorch)."""
