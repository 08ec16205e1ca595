"""Training drafters with Lightning: the Medusa heads module and losses, the EAGLE-3 module and its training-time test,
the hidden-state cache and the LR schedule."""
