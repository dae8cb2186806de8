"""The data of a run: prompts (synthetic tasks or users' files), reward rules, and TensorDict batch helpers."""
