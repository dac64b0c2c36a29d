"""Structured outputs: a request's grammar (JSON schema, regex, choice, EBNF), compiled by xgrammar off
the engine's step loop, and the per-request matcher the logits-processor hook masks tokens with."""
