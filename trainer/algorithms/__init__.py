"""The math of RL on token sequences: advantages, losses, KL, and the engine/actor mismatch correction.

Pure torch functions of tensors, no model, no Ray, no I/O.
"""
