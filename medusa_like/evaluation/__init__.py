"""Evaluation: metrics and their definitions, question sets, tree search and the report."""
