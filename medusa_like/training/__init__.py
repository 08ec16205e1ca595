"""Training the draft heads: losses, the Lightning module, the hidden-state cache and the LR schedule."""
