"""Drafters behind one protocol (`protocol.py`): Medusa heads (`medusa.py`) and the EAGLE-3-style draft model
(`eagle3.py`), the reduced draft vocabulary (`vocab.py`) and the one rule for whether a drafter fits a target
(`base.py`)."""
