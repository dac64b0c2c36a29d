"""Proposers (see ../proposer.py): n-gram prompt lookup and suffix decoding (host only), models (a draft
model, the target's first layers) and a draft head on the target's hidden states."""
