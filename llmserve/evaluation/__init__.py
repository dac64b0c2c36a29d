"""Model-quality evaluation through the engine (`llmserve eval ...`)."""
