"""Conversation sources, the train/validation split and the Lightning datamodule over self-distilled data."""
