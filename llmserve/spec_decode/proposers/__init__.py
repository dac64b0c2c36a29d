"""Draft proposers: n-gram prompt lookup (host only) and models (a draft model, the target's first layers)."""
