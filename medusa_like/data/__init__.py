"""Training data: conversation sources, the train/validation split, self-distilled or original rows, chunked storage
with its recipe check, and the Lightning datamodule."""
