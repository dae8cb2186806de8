"""Collection: which files there are, and the cards each needs, before anything runs."""
