"""Checkpoints of a whole run: the files on disk, saving and resuming, RNG states, and export to Hugging Face."""
