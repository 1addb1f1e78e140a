"""Model definitions (one file per architecture family) and the checkpoint loader (loader.py)."""
